"""The job file loader: valid documents, every error message, and a fuzz test.

Error tests assert on what a person needs to act: the file name, the key path, the fix.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trainguard.config import (
    CanaryCheck,
    DeterminismCheck,
    JobFile,
    MetricFile,
    ParallelCheck,
    ResumeCheck,
    SmokeCheck,
    is_job_file_name,
    load_config,
    parse_config,
)
from trainguard.errors import ConfigError, TrainguardError

LOSS_REGEX = r"step (?P<step>\d+) loss (?P<value>\S+)"

#: A document using every section; each test derives its variant from a deep copy.
FULL: dict[str, Any] = {
    "job": {
        "name": "mlp",
        "command": "python train.py --steps {steps} --ckpt-dir {checkpoint_dir} --seed {seed}",
        "resume_args": ["--resume"],
        "world_size": 1,
        "cwd": "src",
        "env": {"OMP_NUM_THREADS": 1, "RUN_DIR": "{run_dir}"},
        "metrics": {"loss": LOSS_REGEX, "acc": {"file": "{run_dir}/metrics-{rank}.jsonl"}},
        "batch_size": 32,
        "timeout": 120,
    },
    "checks": {
        "smoke": None,
        "canary": {"steps": 10, "max_seconds": 30},
        "determinism": {"steps": 3},
        "resume": {"steps": 10, "after_step": 5},
        "parallel": {"world_size": 2, "args": ["--bs={batch_size}"]},
    },
}

#: The smallest document the loader accepts with a resume check.
MINIMAL_JOB: dict[str, Any] = {
    "name": "mlp",
    "command": "python train.py --steps {steps} --ckpt-dir {checkpoint_dir}",
    "resume_args": "--resume",
    "metrics": {"loss": LOSS_REGEX},
}


def doc(
    job: dict[str, Any] | None = None,
    checks: dict[str, Any] | None = None,
    drop: tuple[str, ...] = (),
) -> str:
    """YAML text of MINIMAL_JOB updated with ``job``, without the ``drop`` keys, plus checks."""
    body = {**copy.deepcopy(MINIMAL_JOB), **(job or {})}
    for key in drop:
        del body[key]
    data: dict[str, Any] = {"job": body}
    if checks is not None:
        data["checks"] = checks
    return yaml.safe_dump(data, sort_keys=False)


def config_error(text: str, path: str = "jobs/trainguard.yaml") -> ConfigError:
    with pytest.raises(ConfigError) as info:
        parse_config(text, path=path)
    return info.value


# --------------------------------------------------------------------------------------------
# Valid documents
# --------------------------------------------------------------------------------------------


def test_full_document_loads_every_section(tmp_path: Path) -> None:
    path = tmp_path / "trainguard.yaml"
    jf = parse_config(yaml.safe_dump(FULL), path=path)

    assert isinstance(jf, JobFile)
    assert jf.path == path.resolve()
    assert jf.job.name == "mlp"
    assert jf.job.timeout == 120.0
    assert isinstance(jf.checks.smoke, SmokeCheck)
    assert isinstance(jf.checks.canary, CanaryCheck) and jf.checks.canary.max_seconds == 30
    assert isinstance(jf.checks.determinism, DeterminismCheck)
    assert isinstance(jf.checks.resume, ResumeCheck) and jf.checks.resume.after_step == 5
    assert isinstance(jf.checks.parallel, ParallelCheck)
    assert jf.checks.parallel.args == ["--bs={batch_size}"]


def test_string_command_is_split_like_a_shell() -> None:
    jf = parse_config(
        doc({"command": "python 'my train.py' --steps {steps} --ckpt-dir {checkpoint_dir}"})
    )
    assert jf.job.command == [
        "python",
        "my train.py",
        "--steps",
        "{steps}",
        "--ckpt-dir",
        "{checkpoint_dir}",
    ]
    assert jf.job.resume_args == ["--resume"]


def test_list_command_is_kept_token_for_token() -> None:
    command = ["python", "train.py", "--name=a b", "--steps", "{steps}", "{checkpoint_dir}"]
    jf = parse_config(doc({"command": command, "resume_args": ["--resume", "--strict"]}))
    assert jf.job.command == command
    assert jf.job.resume_args == ["--resume", "--strict"]


def test_env_scalars_become_strings() -> None:
    env = {"THREADS": 1, "LR": 0.5, "ON": True, "OFF": False, "NAME": "x", "DIR": "{run_dir}"}
    jf = parse_config(doc({"env": env}, checks={"smoke": {"env": {"N": 3}}}))
    assert jf.job.env == {
        "THREADS": "1",
        "LR": "0.5",
        "ON": "1",
        "OFF": "0",
        "NAME": "x",
        "DIR": "{run_dir}",
    }
    assert jf.checks.smoke is not None and jf.checks.smoke.env == {"N": "3"}


@pytest.mark.parametrize("name", ["smoke", "canary", "determinism", "resume", "parallel", "reshard", "profile"])
def test_null_check_means_enabled_with_defaults(name: str) -> None:
    text = doc(checks={name: None})
    if name == "resume":  # the one check without a default for a required field
        text = doc(checks={name: {"after_step": 3}})
    jf = parse_config(text)
    spec = getattr(jf.checks, name)
    assert spec is not None
    assert [n for n, _ in jf.enabled_checks()] == [name]
    if name != "resume":
        assert spec == type(spec).model_validate({})  # every field at its default


def test_smoke_written_bare_in_yaml_is_enabled_with_defaults() -> None:
    text = doc() + "checks:\n  smoke:\n"
    jf = parse_config(text)
    assert jf.checks.smoke == SmokeCheck.model_validate({})
    assert jf.checks.smoke.steps == 5
    assert jf.checks.canary is None


def test_no_checks_section_means_no_checks() -> None:
    jf = parse_config(doc())
    assert jf.enabled_checks() == []


def test_metric_file_source_and_its_rank_placeholder() -> None:
    jf = parse_config(
        doc({"metrics": {"loss": {"file": "{run_dir}/m-{rank}.jsonl"}, "acc": LOSS_REGEX}})
    )
    assert jf.job.metrics["loss"] == MetricFile(file="{run_dir}/m-{rank}.jsonl")
    assert jf.job.metrics["acc"] == LOSS_REGEX


def test_rank_placeholder_is_only_for_metric_files() -> None:
    err = config_error(
        doc({"command": "python t.py --steps {steps} --ckpt-dir {checkpoint_dir} --r {rank}"})
    )
    assert "unknown placeholder {rank}" in str(err)


def test_argv_keeps_a_placeholder_value_with_spaces_as_one_argument() -> None:
    jf = parse_config(doc())
    argv = jf.argv({"steps": 7, "checkpoint_dir": "/tmp/my runs/ckpt"})
    assert argv == ["python", "train.py", "--steps", "7", "--ckpt-dir", "/tmp/my runs/ckpt"]


def test_argv_appends_resume_args_then_extra_args() -> None:
    jf = parse_config(doc({"resume_args": ["--resume-from", "{checkpoint_dir}"]}))
    values = {"steps": 3, "checkpoint_dir": "ck"}
    plain = jf.argv({**values, "seed": 9}, extra_args=["--x={seed}"])
    resumed = jf.argv({**values, "seed": 9}, extra_args=["--x={seed}"], resume=True)
    assert plain == ["python", "train.py", "--steps", "3", "--ckpt-dir", "ck", "--x=9"]
    assert resumed == [
        "python",
        "train.py",
        "--steps",
        "3",
        "--ckpt-dir",
        "ck",
        "--resume-from",
        "ck",
        "--x=9",
    ]


def test_doubled_braces_are_literal() -> None:
    jf = parse_config(doc({"command": "python -c 'print({{1}})' --steps {steps} {checkpoint_dir}"}))
    assert jf.argv({"steps": 1, "checkpoint_dir": "c"})[2] == "print({1})"


def test_enabled_checks_follow_run_order_not_document_order() -> None:
    checks = {"parallel": None, "resume": {"after_step": 2}, "smoke": None, "determinism": None}
    jf = parse_config(doc(checks=checks))
    assert [name for name, _ in jf.enabled_checks()] == [
        "smoke",
        "determinism",
        "resume",
        "parallel",
    ]
    assert [name for name, _ in jf.enabled_checks(["parallel", "smoke"])] == ["smoke", "parallel"]
    assert jf.enabled_checks([]) == jf.enabled_checks()  # empty means "all"
    name, spec = jf.enabled_checks(["resume"])[0]
    assert name == "resume" and spec is jf.checks.resume


def test_enabled_checks_rejects_unknown_names() -> None:
    jf = parse_config(doc(checks={"smoke": None}), path="proj/trainguard.yaml")
    with pytest.raises(ConfigError) as info:
        jf.enabled_checks(["smoke", "smok", "lint"])
    message = str(info.value)
    assert "unknown check name(s) lint, smok" in message
    assert "known: smoke, canary, determinism, resume, compat, parallel" in message
    assert "trainguard.yaml" in message


def test_enabled_checks_rejects_checks_not_configured() -> None:
    jf = parse_config(doc(checks={"smoke": None}))
    with pytest.raises(ConfigError) as info:
        jf.enabled_checks(["canary", "smoke"])
    message = str(info.value)
    assert "canary requested but not configured" in message
    assert "checks: {canary: {}}" in message


def test_cwd_and_state_dir_are_relative_to_the_file(tmp_path: Path) -> None:
    path = tmp_path / "proj" / "trainguard.yaml"
    jf = parse_config(doc({"cwd": "../src"}), path=path)
    assert jf.base_dir == (tmp_path / "proj").resolve()
    assert jf.cwd == (tmp_path / "src").resolve()
    assert jf.state_dir == (tmp_path / "proj").resolve() / ".trainguard"


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("trainguard.yaml", True),
        ("trainguard.yml", True),
        ("mlp.trainguard.yaml", True),
        ("mlp.trainguard.yml", True),
        ("trainguard.json", False),
        ("my-trainguard.yaml", False),
        ("config.yaml", False),
    ],
)
def test_is_job_file_name(name: str, expected: bool) -> None:
    assert is_job_file_name(name) is expected


# --------------------------------------------------------------------------------------------
# Loading from disk
# --------------------------------------------------------------------------------------------


def test_load_config_from_file(tmp_path: Path) -> None:
    path = tmp_path / "mlp.trainguard.yaml"
    path.write_text(doc(), encoding="utf-8")
    jf = load_config(path)
    assert jf.path == path.resolve()
    assert jf.job.name == "mlp"


@pytest.mark.parametrize("name", ["trainguard.yaml", "trainguard.yml"])
def test_load_config_finds_the_job_file_in_a_directory(tmp_path: Path, name: str) -> None:
    (tmp_path / name).write_text(doc(), encoding="utf-8")
    assert load_config(tmp_path).path == (tmp_path / name).resolve()
    assert load_config(str(tmp_path)).path == (tmp_path / name).resolve()


def test_load_config_prefers_yaml_over_yml(tmp_path: Path) -> None:
    (tmp_path / "trainguard.yaml").write_text(doc({"name": "from-yaml"}), encoding="utf-8")
    (tmp_path / "trainguard.yml").write_text(doc({"name": "from-yml"}), encoding="utf-8")
    assert load_config(tmp_path).job.name == "from-yaml"


def test_directory_without_a_job_file(tmp_path: Path) -> None:
    (tmp_path / "config.yaml").write_text(doc(), encoding="utf-8")
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path)
    message = str(info.value)
    assert str(tmp_path) in message
    assert "no trainguard.yaml or trainguard.yml in this directory" in message
    assert "trainguard init" in message


def test_missing_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope" / "trainguard.yaml"
    with pytest.raises(ConfigError) as info:
        load_config(missing)
    assert info.value.path == str(missing)
    assert str(info.value).startswith(f"{missing}: file not found")
    assert "pass the path of your job file" in str(info.value)


def test_undecodable_file(tmp_path: Path) -> None:
    path = tmp_path / "trainguard.yaml"
    path.write_bytes(b"job:\n  name: \xff\xfe\n")
    with pytest.raises(ConfigError, match=r"not UTF-8 text .*save it as UTF-8"):
        load_config(path)


def test_errors_from_a_file_name_that_file(tmp_path: Path) -> None:
    path = tmp_path / "mlp.trainguard.yaml"
    path.write_text(doc({"world_size": 0}), encoding="utf-8")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value).startswith(f"{path}: job.world_size: ")


def test_config_error_is_a_trainguard_error() -> None:
    assert isinstance(config_error(""), TrainguardError)


# --------------------------------------------------------------------------------------------
# Every error, with the message a person acts on
# --------------------------------------------------------------------------------------------

ERRORS = [
    # (id, text, key path, fragments that must be in the message)
    pytest.param(
        doc({"nmae": "x"}, drop=("name",)),
        "job.nmae",
        [
            "unknown key 'nmae'",
            "(did you mean 'name'?)",
            "allowed here: name, command,",
            "job.name: required key is missing",
        ],
        id="unknown-job-key-typo",
    ),
    pytest.param(
        doc(checks={"smoek": None}),
        "checks.smoek",
        [
            "unknown key 'smoek'",
            "(did you mean 'smoke'?)",
            "allowed here: smoke, canary, determinism, resume, compat, parallel",
        ],
        id="unknown-check-typo",
    ),
    pytest.param(
        doc(checks={"canary": {"stpes": 3}}),
        "checks.canary.stpes",
        ["unknown key 'stpes'", "(did you mean 'steps'?)", "min_loss_drop"],
        id="unknown-check-field-typo",
    ),
    pytest.param(
        doc() + "chekcs: {}\n",
        "chekcs",
        ["unknown key 'chekcs'", "(did you mean 'checks'?)", "allowed here: job, checks"],
        id="unknown-top-level-key",
    ),
    pytest.param(
        doc({"metrics": {"loss": {"fiel": "m.jsonl"}}}),
        "job.metrics.loss.fiel",
        ["unknown key 'fiel'", "(did you mean 'file'?)", "allowed here: file"],
        id="unknown-metric-file-key",
    ),
    pytest.param(
        doc({"zzzz": 1}),
        "job.zzzz",
        ["unknown key 'zzzz'; allowed here: name"],
        id="unknown-key-without-close-match",
    ),
    pytest.param(
        doc({"world_size": "2"}),
        "job.world_size",
        [
            "expected an integer, got '2' (str)",
            "Fix: the number of ranks to launch, e.g. `world_size: 2`",
        ],
        id="world-size-string",
    ),
    pytest.param(
        doc({"world_size": True}),
        "job.world_size",
        ["expected an integer, got True (bool)"],
        id="world-size-bool",
    ),
    pytest.param(
        doc({"seed": 1.5}),
        "job.seed",
        ["expected an integer, got 1.5 (float)"],
        id="seed-float",
    ),
    pytest.param(
        doc({"name": 5}),
        "job.name",
        ["expected a string, got 5 (int)", "Fix: give the job a short name, e.g. `name: mlp`"],
        id="name-int",
    ),
    pytest.param(
        doc({"timeout": "ten"}),
        "job.timeout",
        ["expected a number, got 'ten' (str)", "Fix: seconds one run may take"],
        id="timeout-string",
    ),
    pytest.param(
        doc({"command": ["python", 3]}),
        "job.command",
        ["expected a list of strings, but item 3 is int; quote it", "Fix: the command that trains"],
        id="command-list-with-int",
    ),
    pytest.param(
        doc({"command": {"run": "python"}}),
        "job.command",
        ["expected a string or a list of strings, got {'run': 'python'} (dict)"],
        id="command-mapping",
    ),
    pytest.param(
        doc({"command": "python 'train.py --steps {steps}"}),
        "job.command",
        ["cannot split", "like a shell would (No closing quotation)"],
        id="command-unbalanced-quote",
    ),
    pytest.param(
        doc({"command": ""}),
        "job.command",
        ["must not be empty", "Fix: the command that trains"],
        id="command-empty",
    ),
    pytest.param(
        doc({"name": ""}),
        "job.name",
        ["must not be empty, got ''"],
        id="name-empty",
    ),
    pytest.param(
        doc({"env": ["A=1"]}),
        "job.env",
        [
            "expected a mapping of variable name to value, got ['A=1'] (list)",
            'Fix: a mapping such as `env: {OMP_NUM_THREADS: "1"}`',
        ],
        id="env-list",
    ),
    pytest.param(
        doc({"env": {"A": [1]}}),
        "job.env",
        ["value of A must be a string or number, got [1] (list)"],
        id="env-nested-value",
    ),
    pytest.param(
        doc(checks=["smoke"]),  # type: ignore[arg-type]
        "checks",
        ["expected a mapping, got ['smoke'] (list)"],
        id="checks-list",
    ),
    pytest.param(
        doc({"world_size": 0}),
        "job.world_size",
        ["expected a value >= 1, got 0", "Fix: the number of ranks to launch"],
        id="world-size-zero",
    ),
    pytest.param(
        doc({"timeout": -1}),
        "job.timeout",
        ["expected a value > 0", "got -1"],
        id="timeout-negative",
    ),
    pytest.param(
        doc({"stall_timeout": 0}),
        "job.stall_timeout",
        ["expected a value > 0", "got 0", "without a new metric line"],
        id="stall-timeout-zero",
    ),
    pytest.param(
        doc({"seed": -1}),
        "job.seed",
        ["expected a value >= 0, got -1"],
        id="seed-negative",
    ),
    pytest.param(
        doc({"seed": 2**32}),
        "job.seed",
        [f"expected a value <= {2**32 - 1}, got {2**32}"],
        id="seed-too-large",
    ),
    pytest.param(
        doc({"batch_size": 0}),
        "job.batch_size",
        ["expected a value >= 1, got 0"],
        id="batch-size-zero",
    ),
    pytest.param(
        doc({"max_restarts": -2}),
        "job.max_restarts",
        ["expected a value >= 0, got -2"],
        id="max-restarts-negative",
    ),
    pytest.param(
        doc(checks={"smoke": {"steps": 0}}),
        "checks.smoke.steps",
        ["expected a value >= 1, got 0"],
        id="smoke-steps-zero",
    ),
    pytest.param(
        doc(checks={"canary": {"steps": 1}}),
        "checks.canary.steps",
        ["expected a value >= 2, got 1"],
        id="canary-steps-one",
    ),
    pytest.param(
        doc(checks={"canary": {"min_loss_drop": 1}}),
        "checks.canary.min_loss_drop",
        ["expected a value < 1", "got 1"],
        id="canary-loss-drop-one",
    ),
    pytest.param(
        doc(checks={"parallel": {"world_size": 1}}),
        "checks.parallel.world_size",
        ["expected a value >= 2, got 1"],
        id="parallel-world-size-one",
    ),
    pytest.param(
        doc(checks={"determinism": {"atol": -0.1}}),
        "checks.determinism.atol",
        ["expected a value >= 0.0, got -0.1"],
        id="determinism-atol-negative",
    ),
    pytest.param(
        doc({"metrics": {}}),
        "job.metrics",
        [
            "must not be empty",
            "Fix: map metric names to a regex",
            "(?P<step>",
            "{file: metrics.jsonl}",
        ],
        id="metrics-empty",
    ),
    pytest.param(
        doc({"metrics": {"loss": r"step (?P<step>\d+ loss"}}),
        "job.metrics.loss",
        ["is not a valid regular expression", "missing ), unterminated subpattern"],
        id="bad-regex",
    ),
    pytest.param(
        doc({"metrics": {"loss": r"step (?P<step>\d+) loss (?P<value>\S+)a{4294967296}"}}),
        "job.metrics.loss",
        ["is not a usable regular expression", "the repetition number is too large"],
        id="regex-repetition-overflow",
    ),
    pytest.param(
        doc({"metrics": {"loss": r"step (\d+) loss (?P<value>\S+)"}}),
        "job.metrics.loss",
        [
            "lacks the named group(s) step (it has: ['value'])",
            r"write them as (?P<step>\d+) and (?P<value>\S+)",
        ],
        id="regex-without-step-group",
    ),
    pytest.param(
        doc({"metrics": {"loss": r"loss (\S+)"}}),
        "job.metrics.loss",
        ["lacks the named group(s) step, value (it has: none)"],
        id="regex-without-any-group",
    ),
    pytest.param(
        doc({"metrics": {"loss": 5}}),
        "job.metrics.loss",
        ["expected a regex string or a mapping ({file: path.jsonl}, {regex: ..., step: count} or "
         "{trainer: huggingface}), got 5 (int)"],
        id="metric-source-int",
    ),
    pytest.param(
        doc({"metrics": {"loss": {"file": ""}}}),
        "job.metrics.loss.file",
        ["must not be empty"],
        id="metric-file-empty",
    ),
    pytest.param(
        doc({"command": "python t.py --steps {steps} --ckpt-dir {checkpoint_dri}"}),
        "job.command[5]",
        [
            "unknown placeholder {checkpoint_dri}",
            "(did you mean {checkpoint_dir}?)",
            "known: {batch_size}, {checkpoint_dir}, {run_dir}, {seed}, {steps}, {world_size}",
            "write a literal brace as {{ or }}",
        ],
        id="unknown-placeholder-in-command",
    ),
    pytest.param(
        doc({"env": {"X": "{sede}"}}),
        "job.env.X",
        ["unknown placeholder {sede}", "(did you mean {seed}?)"],
        id="unknown-placeholder-in-env",
    ),
    pytest.param(
        doc(checks={"smoke": {"args": ["--n={world_sise}"]}}),
        "checks.smoke.args[0]",
        ["unknown placeholder {world_sise}", "(did you mean {world_size}?)"],
        id="unknown-placeholder-in-check-args",
    ),
    pytest.param(
        doc({"resume_args": ["--from={ckpt}"]}),
        "job.resume_args[0]",
        ["unknown placeholder {ckpt}"],
        id="unknown-placeholder-in-resume-args",
    ),
    pytest.param(
        doc({"checkpoint_dir": "{checkpoint_dir}/x"}),
        "job.checkpoint_dir",
        ["unknown placeholder {checkpoint_dir}"],
        id="checkpoint-dir-refers-to-itself",
    ),
    pytest.param(
        doc({"metrics": {"loss": {"file": "{rnak}.jsonl"}}}),
        "job.metrics.loss.file",
        ["unknown placeholder {rnak}", "(did you mean {rank}?)"],
        id="unknown-placeholder-in-metric-file",
    ),
    pytest.param(
        doc({"command": "python t.py --steps {steps} --ckpt-dir {checkpoint_dir"}),
        "job.command[5]",
        ["expected '}' before end of string", "write a literal brace as {{ or }}"],
        id="unbalanced-brace",
    ),
    pytest.param(
        doc({"command": "python train.py --ckpt-dir {checkpoint_dir}"}, checks={"smoke": None}),
        "checks.smoke.steps",
        [
            "the check runs 5 steps but job.command has no {steps} placeholder",
            "Fix: pass it to your script, e.g. add `--steps {steps}` to job.command",
        ],
        id="check-without-steps",
    ),
    pytest.param(
        doc(drop=("resume_args",), checks={"resume": {"after_step": 5}}),
        "job.resume_args",
        [
            "checks.resume needs to know how to resume the job",
            'Fix: set job.resume_args to the flags that make the script resume, e.g. "--resume"',
        ],
        id="resume-without-resume-args",
    ),
    pytest.param(
        doc({"command": "python train.py --steps {steps}"}, checks={"resume": {"after_step": 5}}),
        "job.command",
        [
            "checks.resume needs the job to write checkpoints",
            "Fix: pass {checkpoint_dir} to the script",
            "--ckpt-dir {checkpoint_dir}",
        ],
        id="resume-without-checkpoint-dir",
    ),
    pytest.param(
        doc(checks={"resume": {"steps": 10, "after_step": 10}}),
        "checks.resume",
        ["after_step (10) must be smaller than steps (10)", "so there are steps left to compare"],
        id="resume-after-step-equals-steps",
    ),
    pytest.param(
        doc(checks={"resume": {"steps": 10, "after_step": 12}}),
        "checks.resume",
        ["after_step (12) must be smaller than steps (10)"],
        id="resume-after-step-beyond-steps",
    ),
    pytest.param(
        doc(checks={"resume": None}),
        "checks.resume.after_step",
        [
            "required key is missing",
            "Fix: the step after which the run is killed, e.g. `after_step: 25`",
        ],
        id="resume-without-after-step",
    ),
    pytest.param(
        doc({"metrics": {"acc": LOSS_REGEX}}, checks={"canary": None}),
        "job.metrics",
        [
            "checks.canary judges the `loss` metric, but job.metrics has none (it has: acc)",
            "Fix: add loss: 'step (?P<step>",
        ],
        id="canary-without-loss",
    ),
    pytest.param(
        doc(
            {"command": "python t.py --steps {steps} --bs {batch_size} --ckpt-dir {checkpoint_dir}"}
        ),
        "job.batch_size",
        [
            "the command uses {batch_size} but job.batch_size is not set",
            "Fix: add `batch_size: 32`",
        ],
        id="batch-size-placeholder-without-batch-size",
    ),
    pytest.param(
        doc(checks={"parallel": {"args": ["--bs={batch_size}"]}}),
        "job.batch_size",
        ["the command uses {batch_size} but job.batch_size is not set"],
        id="batch-size-placeholder-in-check-args",
    ),
    pytest.param(
        "checks: {}\n",
        "job",
        [
            "required key is missing",
            "Fix: add a `job:` mapping with at least `name`, `command` and `metrics`",
        ],
        id="job-missing",
    ),
    pytest.param(
        "job: mlp\n",
        "job",
        ["expected a mapping, got 'mlp' (str)"],
        id="job-not-a-mapping",
    ),
]


@pytest.mark.parametrize(("text", "key", "fragments"), ERRORS)
def test_error_names_file_key_and_fix(text: str, key: str, fragments: list[str]) -> None:
    err = config_error(text, path="jobs/mlp.trainguard.yaml")
    message = str(err)
    assert message.startswith("jobs/mlp.trainguard.yaml: ")
    assert err.path == "jobs/mlp.trainguard.yaml"
    # One problem: "file: key: message"; several: "file: N problems:" then "  key: message" lines.
    assert f"trainguard.yaml: {key}: " in message or f"\n  {key}: " in message
    for fragment in fragments:
        assert fragment in message
    assert "Traceback" not in message and "pydantic" not in message


def test_single_problem_sets_key_attribute() -> None:
    err = config_error(doc({"world_size": 0}))
    assert err.key == "job.world_size"
    assert err.detail.startswith("expected a value >= 1")


def test_all_problems_are_reported_at_once() -> None:
    err = config_error(doc({"world_size": 0, "timeout": "x", "seeed": 3}))
    message = str(err)
    assert "3 problems:" in message
    lines = message.splitlines()[1:]
    assert sorted(line.split(":")[0].strip() for line in lines) == [
        "job.seeed",
        "job.timeout",
        "job.world_size",
    ]


def test_cross_check_problems_are_reported_together() -> None:
    text = doc(
        {"command": "python t.py --bs {batch_size}", "metrics": {"acc": LOSS_REGEX}},
        drop=("resume_args",),
        checks={"canary": None, "resume": {"after_step": 2}},
    )
    message = str(config_error(text))
    for key in (
        "job.batch_size",
        "checks.canary.steps",
        "checks.resume.steps",
        "job.resume_args",
        "job.command",
        "job.metrics",
    ):
        assert f"\n  {key}: " in message


def test_duplicate_keys_are_rejected_with_both_lines() -> None:
    text = "job:\n  name: a\n  command: python t.py\n  name: b\n"
    message = str(config_error(text))
    assert "invalid YAML at line 4, column 3" in message
    assert "duplicate key 'name'" in message
    assert "first defined on line 2" in message


def test_duplicate_top_level_keys_are_rejected() -> None:
    message = str(config_error(doc() + "job: {}\n"))
    assert "duplicate key 'job'" in message
    assert "first defined on line 1" in message


def test_yaml_merge_keys_merge_and_explicit_keys_win() -> None:
    text = doc({"command": "python t.py --steps {steps} --ckpt {checkpoint_dir}", "resume_args": "--resume"}) + (
        "checks:\n"
        "  determinism: &short {steps: 4, rtol: 0.001}\n"
        "  resume: {<<: *short, steps: 8, after_step: 3}\n"
    )
    job_file = parse_config(text, path="jobs/trainguard.yaml")
    assert job_file.checks.resume is not None
    assert (job_file.checks.resume.steps, job_file.checks.resume.rtol, job_file.checks.resume.after_step) == (8, 0.001, 3)
    # a key written twice by hand next to a merge is still a duplicate
    message = str(config_error(doc() + "checks:\n  determinism: &s {steps: 4}\n"
                               "  resume: {<<: *s, after_step: 3, after_step: 4}\n"))
    assert "duplicate key 'after_step'" in message


def test_yaml_syntax_error_names_the_line() -> None:
    text = "job:\n  name: mlp\n  command: [python, train.py\n  metrics: {}\n"
    message = str(config_error(text, path="x/trainguard.yaml"))
    assert message.startswith("x/trainguard.yaml: invalid YAML at line ")
    line = int(re.search(r"at line (\d+)", message).group(1))  # type: ignore[union-attr]
    assert line in (4, 5)  # where the scanner notices the unclosed flow sequence


def test_yaml_tab_indentation_names_line_and_column() -> None:
    message = str(config_error("job:\n\tname: x\n"))
    assert "invalid YAML at line 2, column 1" in message
    assert "'\\t'" in message


def test_unsafe_yaml_tags_are_rejected() -> None:
    message = str(config_error("job: !!python/object/apply:os.system ['echo hi']\n"))
    assert "invalid YAML" in message
    assert "could not determine a constructor" in message


@pytest.mark.parametrize(
    ("text", "kind"),
    [("- job\n- checks\n", "list"), ("just a string\n", "str"), ("42\n", "int")],
)
def test_top_level_must_be_a_mapping(text: str, kind: str) -> None:
    message = str(config_error(text))
    assert f"expected a mapping with a `job:` key at the top level, got {kind}" in message


@pytest.mark.parametrize("text", ["", "\n\n", "# only a comment\n", "---\n"])
def test_empty_file(text: str) -> None:
    err = config_error(text, path="t/trainguard.yaml")
    assert str(err) == "t/trainguard.yaml: job: the file is empty; it needs a `job:` section"


# --------------------------------------------------------------------------------------------
# Fuzz: anything at all is either a JobFile or a ConfigError
# --------------------------------------------------------------------------------------------

yaml_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4)
    ),
    max_leaves=12,
)

# Keys the schema knows, so mutations often land on something the validators look at.
schema_words = st.sampled_from(
    [
        "job",
        "checks",
        "name",
        "command",
        "metrics",
        "loss",
        "file",
        "steps",
        "after_step",
        "env",
        "args",
        "world_size",
        "resume_args",
        "smoke",
        "canary",
        "resume",
        "parallel",
        "determinism",
        "{steps}",
        "{checkpoint_dir}",
        "{batch_size}",
        "{",
        "}",
        "(?P<step>",
        "batch_size",
        "seed",
    ]
)


def _paths(node: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every location in a nested dict/list document (the root excluded)."""
    out = []
    if isinstance(node, dict):
        for key, value in node.items():
            out.append((*prefix, key))
            out.extend(_paths(value, (*prefix, key)))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            out.append((*prefix, i))
            out.extend(_paths(value, (*prefix, i)))
    return out


FULL_PATHS = _paths(FULL)


def _parse_or_config_error(text: str) -> None:
    try:
        result = parse_config(text, path="fuzz/trainguard.yaml")
    except ConfigError as exc:
        assert str(exc).startswith("fuzz/trainguard.yaml: ")
    else:
        assert isinstance(result, JobFile)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    path=st.sampled_from(FULL_PATHS),
    action=st.sampled_from(["replace", "rename", "insert"]),
    value=yaml_values | schema_words,
    key=st.text(max_size=10) | schema_words,
)
def test_fuzz_mutated_documents_raise_only_config_error(
    path: tuple[Any, ...], action: str, value: Any, key: str
) -> None:
    data = copy.deepcopy(FULL)
    parent = data
    for part in path[:-1]:
        parent = parent[part]
    last = path[-1]
    if action == "replace" or isinstance(parent, list):
        parent[last] = value
    elif action == "rename":
        parent[key] = parent.pop(last)
    else:
        parent[key] = value
    _parse_or_config_error(yaml.safe_dump(data, sort_keys=False, allow_unicode=True))


yaml_ish_text = st.text(
    alphabet=st.sampled_from(
        list("jobnamecommandmetricsloss:{}[]-?!&*#|>'\"\n\t ,.0123456789%@`\\")
    ),
    max_size=80,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=st.text(max_size=200) | yaml_ish_text | schema_words.map(lambda w: f"job:\n  {w}: "))
def test_fuzz_arbitrary_text_raises_only_config_error(text: str) -> None:
    _parse_or_config_error(text)


def test_fuzz_reference_document_is_valid() -> None:
    # The fuzz tests mutate FULL; it must itself load, or they would test only error paths.
    assert isinstance(parse_config(yaml.safe_dump(FULL)), JobFile)


@pytest.mark.parametrize(("section", "key", "text"), [
    ("determinism", "rtol", ".inf"), ("resume", "atol", ".inf"), ("parallel", "rtol", "-.inf"),
    ("determinism", "rtol", ".nan"), ("canary", "max_seconds", ".inf"),
])
def test_an_infinite_tolerance_or_limit_is_refused_naming_the_key(section: str, key: str, text: str) -> None:
    """``rtol: .inf`` switched determinism off ("match on all 10 steps" for runs 0.4 apart) while
    NaN was refused (issue 42): every number of the job file must be finite."""
    error = config_error(doc(checks={section: {"steps": 10}}).replace(
        f"{section}:\n    steps: 10", f"{section}:\n    steps: 10\n    {key}: {text}"))
    assert f"checks.{section}.{key}" in str(error)
    assert "finite" in str(error) and "Fix:" in str(error)
