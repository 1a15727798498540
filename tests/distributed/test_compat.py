"""checks.compat on the digits example in a temporary git repository: base is the example as
shipped (its data git-ignored, so the checkout has it only through the link), the current code
is the example with one planted change. A renamed layer, a buffer added without a default on
load and a changed data order each fail naming the key or the divergence; a compatible refactor
(the model class moved to a module of its own, a function renamed) passes.

Each case is three launches of digits on 40 steps (the current code's uninterrupted run, base
killed after step 5, the current code resumed from base's checkpoint), no DataLoader workers."""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import report_evidence
from trainguard.config import GatePolicy
from trainguard.gate.policy import Capabilities, Decision
from trainguard.gate.provenance import provenance_for
from trainguard.gate.run import GateReport, write_gate_report
from trainguard.report import CheckResult, Report
from trainguard.session import check

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "digits"

JOB = """\
job:
  name: digits-compat
  command: "python train.py --steps {{steps}} --ckpt-dir {{checkpoint_dir}} --seed {{seed}} --num-workers 0 --eval-every 1000"
  resume_args: "--resume"
  env: {{OMP_NUM_THREADS: "1"}}
  metrics:
    loss: 'step (?P<step>\\d+) loss (?P<value>\\S+)'
  timeout: 120
  stall_timeout: 60
checks:
  compat: {{base: {base}, steps: 40, after_step: 5}}
"""

Patches = dict[str, tuple[str, str]]


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True,
                          timeout=60).stdout.strip()


def make_digits_repo(tmp_path: Path, patches: Patches, *, commit: bool = True,
                     new_files: dict[str, str] | None = None, base: str = "base",
                     at_base: Callable[[Path], None] | None = None, sha256: bool = False) -> Path:
    """The digits example committed as ``base`` (tag) in ``tmp_path/repo``, then each planted
    replacement (applied exactly once) committed on top, or left uncommitted."""
    repo = tmp_path / "repo"
    shutil.copytree(EXAMPLE, repo, ignore=shutil.ignore_patterns(".trainguard", "__pycache__", "checkpoints"))
    (repo / ".gitignore").write_text("data/\n.trainguard/\n__pycache__/\n")
    (repo / "trainguard.yaml").write_text(JOB.format(base=base))
    _git(repo, "init", "-q", *(["--object-format=sha256"] if sha256 else []))
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "add", "-A")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "base")
    _git(repo, "tag", "base")
    if at_base is not None:
        at_base(repo)
    for name, (old, new) in patches.items():
        path = repo / name
        text = path.read_text()
        assert text.count(old) == 1, f"planted patch no longer applies to {name}: {old!r}"
        path.write_text(text.replace(old, new))
    for name, text in (new_files or {}).items():
        (repo / name).write_text(text)
    if commit:
        _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "add", "-A")
        _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "change")
    return repo


@pytest.fixture
def digits_repo(tmp_path: Path) -> Callable[..., Path]:
    """``make(patches, commit=True)``: :func:`make_digits_repo` in the test's temporary folder."""

    def make(patches: Patches, **options: Any) -> Path:
        return make_digits_repo(tmp_path, patches, **options)

    return make


def renamed_head() -> str:
    """digits/model.py with its ``head`` layer renamed ``classifier``."""
    model = (EXAMPLE / "digits" / "model.py").read_text()
    renamed = model.replace("self.head = nn.Linear", "self.classifier = nn.Linear").replace(
        "return self.head(", "return self.classifier(")
    assert renamed.count("self.classifier") == 2
    return renamed


#: planted changes of the current code that cannot resume base's checkpoint, or not exactly
BUFFER_WITHOUT_DEFAULT: Patches = {"digits/model.py": (
    "        self.head = nn.Linear(width, num_classes)\n",
    "        self.head = nn.Linear(width, num_classes)\n"
    "        self.register_buffer(\"input_scale\", torch.ones(in_features))\n")}
DATA_ORDER_CHANGED: Patches = {"train.py": ("shuffle=True, seed=args.seed, drop_last=True",
                                            "shuffle=True, seed=args.seed + 1, drop_last=True")}


def _compat(repo: Path) -> CheckResult:
    report = check(repo / "trainguard.yaml", only=["compat"], report_json=str(repo.parent / "report.json"))
    (result,) = report.checks
    assert json.loads((repo.parent / "report.json").read_text())["checks"][0]["status"] == result.status
    # the checkout is gone, and git no longer lists it
    assert not list((repo / ".trainguard" / "compat").glob("checkout-*"))
    assert _git(repo, "worktree", "list").count("\n") == 0
    return result


def _promote(repo: Path) -> None:
    """A promoted gate report of the job at base, written by the gate's own writer."""
    path = repo / "trainguard.yaml"
    write_gate_report(GateReport(job="digits-compat", job_file=str(path), decision=Decision("promote"),
                                 report=Report(job="digits-compat", job_file=str(path)),
                                 provenance=provenance_for(path), capabilities=Capabilities.probe(),
                                 policy=GatePolicy.model_validate({})),
                      repo / ".trainguard" / "gate")


@pytest.mark.timeout(300)
def test_a_renamed_layer_fails_naming_the_keys_against_the_promoted_commit_of_a_sha256_repository(
        digits_repo: Callable[..., Path]) -> None:
    """base is the commit of the last promoted gate report, in a SHA-256 repository (64-digit
    commit ids): before issue 42 it was not found, and the rename passed as "nothing to be
    compatible with"."""
    repo = digits_repo({}, new_files={"digits/model.py": renamed_head()}, base="promoted", at_base=_promote, sha256=True)
    result = _compat(repo)
    assert result.status == "failed", result.summary
    assert len(report_evidence(result)["base_commit"]) == 64 and "promoted-report index" in report_evidence(result)["promoted"]
    assert "cannot resume base's" in result.summary and "classifier.weight" in result.summary, result.summary
    layout = report_evidence(result)["layout"]
    assert layout["renamed"] == [["model.head", "model.classifier"]], layout
    assert "map the old names on load" in result.summary
    # base ran in its own checkout, on the data the working tree's ignored folder holds
    assert "data" in report_evidence(result)["linked"]
    assert report_evidence(result)["base_commit"] == _git(repo, "rev-parse", "base")


@pytest.mark.timeout(300)
def test_a_buffer_added_without_a_default_on_load_fails_naming_it(digits_repo: Callable[..., Path]) -> None:
    repo = digits_repo(BUFFER_WITHOUT_DEFAULT)
    result = _compat(repo)
    assert result.status == "failed", result.summary
    assert "input_scale" in result.summary, result.summary
    assert report_evidence(result)["layout"]["only_in_new"] == ["model.input_scale"], report_evidence(result)["layout"]


@pytest.mark.timeout(300)
def test_a_changed_data_order_fails_at_the_first_step_after_the_resume(digits_repo: Callable[..., Path]) -> None:
    repo = digits_repo(DATA_ORDER_CHANGED)
    result = _compat(repo)
    assert result.status == "failed", result.summary
    ev = report_evidence(result)
    resumed_from = ev["resumed_from_step"]
    assert resumed_from >= 5 and f"at step {resumed_from + 1}" in result.summary, result.summary
    # the checkpoint's layout is the same; the samples drawn are not, from the first batch
    assert ev["layout"]["compared"] and not ev["layout"]["only_in_old"] and not ev["layout"]["only_in_new"]
    assert "the data order changed" in ev["samples"] and "in batch 1," in ev["samples"], ev["samples"]
    assert ev["before_resume"]["first_divergent_step"] == 1


@pytest.mark.timeout(300)
def test_a_compatible_refactor_passes_against_the_last_promoted_commit(digits_repo: Callable[..., Path]) -> None:
    """The model class moved to a module of its own, a data function renamed, left uncommitted
    (the current code is the working tree); base is the commit the last promoted gate report
    was made at (``base: promoted``)."""
    model = (EXAMPLE / "digits" / "model.py").read_text()
    repo = digits_repo(
        {"digits/model.py": (model, '"""The model (moved to digits.mlp)."""\n\nfrom digits.mlp import DigitsMLP\n\n'
                                    '__all__ = ["DigitsMLP"]\n'),
         "digits/data.py": ("def sample_seed(", "def augmentation_seed(")},
        commit=False, new_files={"digits/mlp.py": model}, base="promoted", at_base=_promote)
    data = (repo / "digits" / "data.py").read_text()
    (repo / "digits" / "data.py").write_text(data.replace("sample_seed(self.seed", "augmentation_seed(self.seed"))
    assert "sample_seed" not in (repo / "digits" / "data.py").read_text()
    result = _compat(repo)
    assert result.status == "passed", result.summary
    ev = report_evidence(result)
    assert ev["base"] == "promoted" and ev["base_commit"] == _git(repo, "rev-parse", "base")
    assert ev["current_dirty"] is True and ev["resumed_from_step"] >= 5
    assert ev["layout"]["compared"] and ev["layout"]["summary"] == ""
    assert all(m["first_divergent_step"] is None and m["compared_steps"] > 0 for m in ev["metrics"])


INEXACT = Path(__file__).resolve().parents[1] / "data" / "jobs" / "inexact_resume.py"
INEXACT_JOB = """\
job:
  name: inexact
  command: "python train.py --steps {steps} --seed {seed} --ckpt-dir {checkpoint_dir} --sleep 0.05"
  resume_args: "--resume"
  metrics:
    loss: 'step (?P<step>\\d+) loss (?P<value>\\S+)'
  timeout: 60
checks:
  compat: {base: base, steps: 30, after_step: 8}
"""


#: change -> its edits of inexact_resume.py: a refactor, and a resume path that skips a step
INEXACT_CHANGES = {
    "refactor": [("def latest(", "def newest_state("), ("(state := latest(", "(state := newest_state(")],
    "resume-path": [('start = state["w"], state["step"] + 1', 'start = state["w"], state["step"] + 2')],
}


def inexact_repo(tmp_path: Path, change: str) -> Path:
    """inexact_resume.py committed as ``base`` in ``tmp_path/repo``, with ``change`` on top (uncommitted)."""
    repo = tmp_path / "repo"
    repo.mkdir()
    source = INEXACT.read_text()
    (repo / "train.py").write_text(source)
    (repo / ".gitignore").write_text(".trainguard/\n")
    (repo / "trainguard.yaml").write_text(INEXACT_JOB)
    _git(repo, "init", "-q")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "add", "-A")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "base")
    _git(repo, "tag", "base")
    for old, new in INEXACT_CHANGES[change]:
        assert source.count(old) == 1, old
        source = source.replace(old, new)
    (repo / "train.py").write_text(source)
    return repo


@pytest.mark.parametrize("change", sorted(INEXACT_CHANGES))
def test_a_job_whose_resume_is_not_exact_is_judged_against_bases_own_resume(tmp_path: Path, change: str) -> None:
    """Its batch generator restarts from the seed on a resume (as nanoGPT's does): no resume of it
    matches the uninterrupted run. A refactor is still compatible (the current code continues
    base's checkpoint exactly as base does); a change of the resume path (one step skipped) is not."""
    repo = inexact_repo(tmp_path, change)
    result = _compat(repo)
    ev = report_evidence(result)
    assert "before_resume" in ev, result.summary
    assert ev["before_resume"]["first_divergent_step"] is None and ev["layout"]["summary"] == ""
    assert ev["control"]["compared_steps"] > 0, ev["control"]
    if change == "refactor":
        assert result.status == "passed", result.summary
        assert "continues its checkpoint exactly as base itself does" in result.summary
        assert "the job's resume is not exact" in result.summary
    else:
        assert result.status == "failed", result.summary
        assert "base itself, resumed from the same checkpoint, continues differently" in result.summary
