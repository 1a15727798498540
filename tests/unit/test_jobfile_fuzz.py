"""Generated job files through ``trainguard validate``: a valid plan or a clean error, never a
traceback and never stuck.

Each example is a job file built from a valid one by a few mutations: any key of any section
set to a value of any type (huge and negative numbers, NaN, unicode, NUL bytes, placeholders
with format specs, broken regexes), keys removed, unknown keys added, drills of every fault kind
with odd parameters, and YAML oddities in the text (aliases, merge keys, tags, duplicate keys,
several documents, deep nesting, bytes that are not UTF-8). The dry-run path must answer
each with a plan (exit 0) or a :class:`ConfigError` naming the file (exit 2), within a time
limit. Five hundred examples run by default, thousands under ``-m slow``.
"""

from __future__ import annotations

import contextlib
import copy
import io
import itertools
import json
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers import time_limit
from trainguard.cli.main import main
from trainguard.config.faults import FAULTS
from trainguard.config.settings import resolve
from trainguard.errors import ConfigError
from trainguard.session.plan import make_plan

#: one example may take this long (the issue's bound for a stuck example)
EXAMPLE_LIMIT_S = 60
#: no error message may be longer than this (a value in the file may be megabytes)
MAX_MESSAGE = 50_000

REGEX = r"step (?P<step>\d+) loss (?P<value>\S+)"
BASE: dict[str, Any] = {
    "job": {
        "name": "fuzz",
        "command": "python train.py --steps {steps} --ckpt {checkpoint_dir} --seed {seed}",
        "resume_args": "--resume",
        "metrics": {"loss": REGEX},
    },
    "checks": {
        "smoke": {"steps": 3},
        "canary": {"steps": 10},
        "determinism": {"steps": 6},
        "resume": {"steps": 8, "after_step": 3},
        "parallel": {"steps": 4, "world_size": 2},
        "drills": [{"name": "kill", "fault": "kill_rank", "rank": 0, "steps": 6}],
    },
}

#: a Ray Train job (docs/ray-train.md): its config travels to the workers as JSON
BASE_RAY: dict[str, Any] = {
    "job": {
        "name": "fuzz-ray", "kind": "ray_train", "train_func": "train:train_func",
        "config": {"steps": "{steps}", "seed": "{seed}", "lr": 0.01},
        "scaling": {"num_workers": 2}, "metrics": ["loss"],
    },
    "checks": {"smoke": {"steps": 3}, "parallel": {"steps": 4, "world_size": 2}},
}

#: where a mutation may land: every key the schema knows, and a few it does not
PATHS = [
    ("job",), ("checks",), ("target",), ("gate",),
    *[("job", k) for k in ("name", "command", "resume_args", "world_size", "cwd", "env", "metrics",
                           "checkpoint_dir", "seed", "batch_size", "timeout", "stall_timeout",
                           "max_restarts", "restart", "distributed_env", "record_samples", "record_steps", "kind", "train_func",
                           "config", "scaling", "typo_key")],
    ("job", "metrics", "loss"), ("job", "metrics", "acc"), ("job", "env", "X"),
    ("job", "config", "lr"), ("job", "config", "when"), ("job", "scaling", "num_workers"),
    ("job", "scaling", "resources_per_worker"),
    *[("checks", c) for c in ("smoke", "canary", "determinism", "resume", "parallel", "profile",
                              "drills", "unknown")],
    *[("checks", c, k) for c in ("smoke", "canary", "determinism", "resume", "parallel")
      for k in ("steps", "args", "env", "timeout", "seed")],
    ("checks", "resume", "after_step"), ("checks", "parallel", "world_size"),
    ("checks", "canary", "grad_norm_range"), ("checks", "canary", "baseline"),
    ("checks", "profile", "world_sizes"), ("checks", "profile", "headroom"),
    *[("target", k) for k in ("steps", "samples", "tokens", "max_gpus", "mtbf_hours",
                              "mtbf_hours_by_gpus", "deadline_hours")],
    *[("gate", k) for k in ("require", "thresholds", "on_missing", "queue", "max_report_age")],
]

PLACEHOLDER_BITS = ["{steps}", "{seed}", "{run_dir}", "{checkpoint_dir}", "{world_size}", "{batch_size}",
                    "{latest_checkpoint}", "{steps:d}", "{run_dir:d}", "{seed!z}", "{seed!r}", "{0}", "{}",
                    "{seed:>99999999999999999999}", "{run_dir.x}", "{steps[0]}", "{", "}", "{{", "}}",
                    "{nope}", "{seed:{steps}}"]
REGEX_BITS = [r"(?P<step>\d+)", r"(?P<value>\S+)", "(", ")", "a{4294967296}", "(?P<x>", "\\", "[", "*",
              "(?P<step>a)(?P<step>b)", "(?P<value>.)", "loss ", "(?P<global_step>\\d+)"]
ODD_TEXT = st.sampled_from(["", " ", "\0", "a\0b", "A=B", "é✓\U0001d518", "\u202e", "-rf", "/dev/null/ck", "/proc/x",
                            "..", "/", "~", "ray_train", "command", "$HOME", "`id`", "x" * 300, "\n", "\t", "'", '"', "#", ": ", "- "])


def _text() -> st.SearchStrategy[str]:
    pieces = st.one_of(st.sampled_from(PLACEHOLDER_BITS), st.sampled_from(REGEX_BITS), ODD_TEXT,
                       st.text(max_size=12))
    return st.lists(pieces, max_size=5).map("".join)


_SCALARS = st.one_of(
    st.none(), st.booleans(),
    st.integers(min_value=-(10**30), max_value=10**30),
    st.sampled_from([0, 1, 2, -1, 2**31, 2**32, 2**63, 10**20, 10**400]),
    st.floats(allow_nan=True, allow_infinity=True),
    _text(),
)
VALUES = st.recursive(
    _SCALARS,
    lambda inner: st.one_of(st.lists(inner, max_size=4),
                            st.dictionaries(st.one_of(_text(), st.integers(-5, 5)), inner, max_size=4)),
    max_leaves=12,
)
DRILLS = st.lists(
    st.fixed_dictionaries(
        {"name": st.one_of(st.sampled_from(["a", "b"]), _text()),
         "fault": st.one_of(st.sampled_from(sorted(FAULTS)), _text())},
        optional={"rank": VALUES, "steps": VALUES, "after_step": VALUES, "params": VALUES,
                  "expect": st.one_of(st.sampled_from(["recover", "fail_clean", "continue"]), VALUES),
                  "world_size": VALUES, "duration": VALUES, "deadline": VALUES},
    ),
    max_size=3,
)

# text-level YAML oddities applied to the dumped document
YAML_ODDITIES = [
    lambda t: t,
    lambda t: "defaults: &d {steps: 3}\n" + t.replace("smoke:\n    steps: 3", "smoke:\n    <<: *d"),
    lambda t: t + "x: &a [1, 2]\ny: [*a, *a, *a]\n",
    lambda t: t + "blob: !!binary aGVsbG8=\n",
    lambda t: t + "when: 2024-01-01\n",
    lambda t: t + "evil: !!python/object/apply:os.system ['true']\n",
    lambda t: t + "s: !!set {a, b}\n",
    lambda t: t + "job: {}\n",
    lambda t: t + "---\njob: {}\n",
    lambda t: "\ufeff" + t,
    lambda t: t.replace("  ", "\t", 1),
    lambda t: t + "deep: " + "[" * 300 + "]" * 300 + "\n",
    lambda t: t + "a: &a {b: *a}\n",
    lambda t: t[: len(t) // 2],
    lambda t: t + "? [1, 2]\n: x\n",
    lambda t: t + "k: *undefined\n",
    lambda t: t + "big: 1" + "0" * 5000 + "\n",
]


def _set(doc: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    node: Any = doc
    for key in path[:-1]:
        if not isinstance(node, dict):
            return
        if not isinstance(node.get(key), dict):
            node[key] = {}
        node = node[key]
    if isinstance(node, dict):
        node[path[-1]] = value


def _delete(doc: dict[str, Any], path: tuple[str, ...]) -> None:
    node: Any = doc
    for key in path[:-1]:
        node = node.get(key) if isinstance(node, dict) else None
    if isinstance(node, dict):
        node.pop(path[-1], None)


@st.composite
def job_texts(draw: st.DrawFn) -> bytes:
    doc = copy.deepcopy(draw(st.sampled_from([BASE, BASE, BASE_RAY])))
    for _ in range(draw(st.sampled_from([0, 1, 1, 1, 2, 3, 4]))):
        path = draw(st.sampled_from(PATHS))
        action = draw(st.sampled_from(["set", "set", "delete"]))
        if action == "delete":
            _delete(doc, path)
        elif path == ("checks", "drills"):
            _set(doc, path, draw(DRILLS))
        else:
            _set(doc, path, draw(VALUES))
    try:
        text = yaml.safe_dump(doc, allow_unicode=draw(st.booleans()),
                              default_flow_style=draw(st.sampled_from([False, None, True])))
    except (yaml.YAMLError, ValueError, OverflowError):  # a value YAML itself cannot write
        text = yaml.safe_dump(BASE)
    if draw(st.booleans()):
        text = draw(st.sampled_from(YAML_ODDITIES))(text)
    data = text.encode("utf-8", "surrogatepass")
    if b"ray_train" in data and draw(st.booleans()):  # YAML-only types in its config
        data = data.replace(b"lr: 0.01", draw(st.sampled_from([b"lr: 2024-01-01", b"lr: !!binary aGk=",
                                                                 b"lr: .nan", b"lr: !!set {a}", b"lr: {1: 2}"])))
    if draw(st.integers(0, 30)) == 0:
        data += b"\xff\xfe not utf-8"
    return data




def _try(tmp: Path, data: bytes) -> str:
    """Validate one file; 'plan' or 'error', and fail on anything else."""
    path = tmp / "trainguard.yaml"
    path.write_bytes(data)
    with time_limit(EXAMPLE_LIMIT_S):
        try:
            plan = make_plan(path, resolve(environ={}))
        except ConfigError as exc:
            message = str(exc)
            assert message.startswith(str(path)), message[:500]
            assert len(message) < MAX_MESSAGE, f"a {len(message)}-character message"
            return "error"
        json.dumps(plan.as_dict(), allow_nan=False)
        assert plan.lines()
        return "plan"


def _run(tmp_path_factory: pytest.TempPathFactory, examples: int) -> dict[str, int]:
    counts = {"plan": 0, "error": 0}
    tmp = tmp_path_factory.mktemp("fuzz")
    (tmp / "train.py").write_text("print('step 1 loss 1.0')\n")

    @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(job_texts())
    def property_(data: bytes) -> None:
        counts[_try(tmp, data)] += 1

    property_()
    return counts


def test_generated_job_files_give_a_plan_or_a_clean_error(tmp_path_factory: pytest.TempPathFactory) -> None:
    counts = _run(tmp_path_factory, 500)
    # both outcomes occur: the generator is neither all-broken nor all-valid
    print(counts)
    assert counts["plan"] >= 10 and counts["error"] >= 100, counts


@pytest.mark.slow
def test_generated_job_files_many(tmp_path_factory: pytest.TempPathFactory) -> None:
    counts = _run(tmp_path_factory, 5000)
    assert counts["plan"] and counts["error"], counts


@pytest.mark.parametrize(
    ("extra", "key"),
    [
        ('  env: {X: "{run_dir:d}"}\n', "job.env.X"),
        ('  env: {X: "{seed!z}"}\n', "job.env.X"),
        ('  env: {X: "{seed:>99999999999999999999}"}\n', "job.env.X"),
        ('  env: {X: "a\\0b"}\n', "job.env"),
        ('  env: {"A=B": "1"}\n', "job.env"),
        ('  cwd: "a\\0b"\n', "job.cwd"),
        ('  checkpoint_dir: "a\\0b"\n', "job.checkpoint_dir"),
        ("  checkpoint_dir: /dev/null/ck\n", "job.checkpoint_dir"),
        ("  checkpoint_dir: /proc/ck\n", "job.checkpoint_dir"),
        ('  checkpoint_dir: ""\n', "job.checkpoint_dir"),
        ("  cwd: nope\n", "job.cwd"),
        ("  world_size: 100000000000000000000\n", "job.world_size"),
    ],
)
def test_issue_reproducers_name_their_key(tmp_path: Path, extra: str, key: str) -> None:
    """The reproducers of issue 13 (items 2, 3, 4, 14): exit 2 naming the key, from validate."""
    (tmp_path / "trainguard.yaml").write_text(
        "job:\n  name: x\n  command: \"python t.py --steps {steps}\"\n"
        f"  metrics: {{loss: '{REGEX}'}}\n{extra}checks: {{smoke: {{steps: 2}}}}\n"
    )
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(["validate", str(tmp_path)])
    assert code == 2, err.getvalue()
    assert f": {key}" in err.getvalue() and "Traceback" not in err.getvalue(), err.getvalue()


def test_an_alias_bomb_and_a_huge_value_are_refused_quickly(tmp_path: Path) -> None:
    """Item 1: nine levels of nine aliases (687 bytes) and a 5 MB value give short messages."""
    levels = ['a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    names = "abcdefghi"
    for prev, cur in itertools.pairwise(names):
        levels.append(f"{cur}: &{cur} [{', '.join(['*' + prev] * 9)}]")
    bomb = "\n".join(levels) + f"\njob: {{name: x, command: 'true {{steps}}', metrics: {{loss: '{REGEX}'}}, world_size: *i}}\n"
    path = tmp_path / "trainguard.yaml"
    path.write_text(bomb)
    with time_limit(20), pytest.raises(ConfigError, match="aliases are expanded") as info:
        make_plan(path, resolve(environ={}))
    assert len(str(info.value)) < 1000
    path.write_text(f"job: {{name: x, command: 'true {{steps}}', metrics: {{loss: '{REGEX}'}}, "
                    f"world_size: '{'9' * 5_000_000}'}}\n")
    with time_limit(20), pytest.raises(ConfigError) as info:
        make_plan(path, resolve(environ={}))
    assert "at most 1,000,000" in str(info.value) and len(str(info.value)) < 1000
    path.write_text(f"job: {{name: x, command: 'true {{steps}}', metrics: {{loss: '{REGEX}'}}, "
                    f"world_size: '{'9' * 200_000}'}}\n")
    with time_limit(20), pytest.raises(ConfigError, match=r"job\.world_size") as info:
        make_plan(path, resolve(environ={}))
    assert len(str(info.value)) < 1000


def test_a_valid_file_gives_its_plan_and_exit_0(tmp_path: Path) -> None:
    (tmp_path / "trainguard.yaml").write_text(yaml.safe_dump(BASE))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["validate", str(tmp_path), "--json"])
    assert code == 0
    plan = json.loads(out.getvalue())
    assert [c["name"] for c in plan["checks"]] == ["smoke", "canary", "determinism", "resume", "parallel",
                                                   "drill:kill"]
    # determinism, resume and the drill ask for the same reference run? only equal requests share
    assert plan["launches"] == sum(len(c["runs"]) for c in plan["checks"]) - sum(
        len(s["checks"]) - 1 for s in plan["shared_references"])
    assert not list(tmp_path.glob(".trainguard/runs/*")), "validate launched something"


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))


HARMLESS = """\
import os, sys
steps = int(sys.argv[1])
os.makedirs(sys.argv[2], exist_ok=True)
for step in range(1, steps + 1):
    print(f"step {step} loss {1.0 / step}", flush=True)
with open(os.path.join(sys.argv[2], f"step{steps}.json"), "w") as f:
    f.write("{}")
"""


@st.composite
def accepted_jobs(draw: st.DrawFn) -> dict[str, Any]:
    """Valid job files with odd but legal values: names, env values, paths, escaped braces."""
    odd = st.text(st.characters(blacklist_categories=("Cs", "Cc")), min_size=1, max_size=12)
    env_value = st.one_of(odd, st.integers(-(10**6), 10**6), st.booleans(), st.just("{{literal}}"),
                          st.just("{run_dir}/x"), st.just("{seed}"))
    return {
        "job": {
            "name": draw(odd),
            "command": ["python", "harmless.py", "{steps}", "{checkpoint_dir}"],
            "metrics": {"loss": REGEX},
            "env": draw(st.dictionaries(st.from_regex(r"\A[A-Z][A-Z0-9_]{0,8}\Z"), env_value, max_size=3)),
            "checkpoint_dir": draw(st.sampled_from(["{run_dir}/checkpoints", "{run_dir}/ck é ✓",
                                                    "ck dir/{seed}", "{run_dir}"])),
            "timeout": 60,
        },
        "checks": {"smoke": {"steps": draw(st.integers(1, 4)),
                             "args": draw(st.lists(st.sampled_from(["--flag", "{{x}}", "é"]), max_size=2))}},
    }


def test_accepted_files_launch(tmp_path_factory: pytest.TempPathFactory) -> None:
    """A handful of generated files that validate are launched for real with a harmless command:
    what validate accepts, a launch must run (no error that validate should have caught)."""
    from trainguard.session import check

    launched: list[str] = []

    @settings(max_examples=6, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(accepted_jobs())
    def property_(doc: dict[str, Any]) -> None:
        tmp = tmp_path_factory.mktemp("launch")
        (tmp / "harmless.py").write_text(HARMLESS)
        (tmp / "trainguard.yaml").write_text(yaml.safe_dump(doc, allow_unicode=True), encoding="utf-8")
        with time_limit(EXAMPLE_LIMIT_S):
            make_plan(tmp, resolve(environ={}))
            report = check(str(tmp), only=["smoke"])
        assert report.status == "passed", report.checks[0].summary
        launched.append(doc["job"]["name"])

    property_()
    assert len(launched) == 6


def test_a_baseline_path_with_an_unknown_user_is_named(tmp_path: Path) -> None:
    (tmp_path / "trainguard.yaml").write_text(
        f"job: {{name: x, command: 'true {{steps}}', metrics: {{loss: '{REGEX}'}}}}\n"
        "checks: {canary: {steps: 2, baseline: '~nouser-trainguard/x.json'}}\n")
    with pytest.raises(ConfigError, match=r"checks\.canary\.baseline: .*~user in it does not exist"):
        make_plan(tmp_path, resolve(environ={}))
