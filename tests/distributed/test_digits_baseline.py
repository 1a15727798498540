"""The canary's baseline band on the shipped example: a clean run stays inside the band of the
baseline saved from the clean job; a run whose gradients accumulate across steps (no
``optimizer.zero_grad()``) still passes the plain canary but leaves the band.

One baseline (30 steps, seed 0) is saved once per module and shared: each digits canary costs
~6-9 s on 2 cores, most of it importing torch. The 60-step variant is marked slow.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.helpers import report_evidence
from trainguard._internal.machine import machine_id
from trainguard.checks.baseline import load_baseline
from trainguard.checks.statefiles import StoredRequest
from trainguard.report import CheckResult
from trainguard.session import check

if TYPE_CHECKING:
    from conftest import PatchedExample

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "digits"

JOB_FILE = """\
job:
  name: digits-baseline
  command: "python train.py --steps {steps} --ckpt-dir {checkpoint_dir} --seed {seed}"
  resume_args: "--resume"
  env: {OMP_NUM_THREADS: "1"}
  metrics:
    loss: 'step (?P<step>\\d+) loss (?P<value>\\S+)'
    val_loss: 'step (?P<step>\\d+) val_loss (?P<value>\\S+)'
  timeout: 120
  stall_timeout: 60
checks:
  canary: {steps: STEPS, max_seconds: 90, max_memory_mb: 1000, min_loss_drop: 0.3, val_metric: val_loss, min_val_drop: 0.05BASELINE}
"""

#: the planted defect: gradients are never reset, so each step applies the sum of all gradients
#: so far (Adam and the clipping at 1.0 keep it learning, only worse)
ACCUMULATING_GRADIENTS = {
    "train.py": (
        "            optimizer.zero_grad(set_to_none=True)\n",
        "            pass  # planted: gradients accumulate across steps\n",
    )
}


def _job(steps: int, baseline: Path | None = None) -> str:
    extra = f", baseline: '{baseline}'" if baseline is not None else ""
    return JOB_FILE.replace("STEPS", str(steps)).replace("BASELINE", extra)


def _canary(root: Path, **kwargs: object) -> CheckResult:
    report = check(root, only=["canary"], report_json=str(root / "report.json"), **kwargs)  # type: ignore[arg-type]
    (result,) = report.checks
    return result


def _clean_copy(directory: Path, steps: int) -> Path:
    root = directory / "digits"
    shutil.copytree(EXAMPLE, root, ignore=shutil.ignore_patterns(".trainguard", "__pycache__"))
    (root / "trainguard.yaml").write_text(_job(steps))
    return root


@pytest.fixture(scope="module")
def saved_baseline(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, CheckResult]]:
    """A clean copy of the example (30-step canary) with a baseline saved from its own run."""
    root = _clean_copy(tmp_path_factory.mktemp("baseline"), 30)
    result = _canary(root, save_baseline=True)
    assert result.status == "passed", result.summary
    yield root, result


@pytest.mark.canary
def test_the_saved_baseline_holds_the_clean_trajectories(saved_baseline: tuple[Path, CheckResult]) -> None:
    root, result = saved_baseline
    path = Path(report_evidence(result)["baseline"]["path"])
    assert path.parent == root / ".trainguard" / "baselines" / machine_id()
    assert path.name == "0001_nogit.json"  # the copy is not in a git repository
    baseline = load_baseline(path)
    assert baseline.request == StoredRequest(steps=30, seed=0, world_size=1, args=(), env={})
    assert sorted(baseline.trajectories["loss"]) == list(range(1, 31))
    assert sorted(baseline.trajectories["val_loss"]) == [20, 30]
    assert "saved as the baseline " in result.summary


@pytest.mark.canary
def test_a_clean_run_with_the_same_seed_stays_inside_the_band(saved_baseline: tuple[Path, CheckResult]) -> None:
    root, _ = saved_baseline
    result = _canary(root)
    assert result.status == "passed", result.summary
    compared = report_evidence(result)["baseline"]
    assert compared["status"] == "compared" and compared["path"].endswith("0001_nogit.json")
    for metric in ("loss", "val_loss"):
        # same seed, deterministic kernels, same machine: the same trajectory (a little slack
        # for machines whose kernels are not bitwise reproducible)
        assert compared["metrics"][metric]["max_deviation"] < 0.05, compared["metrics"][metric]
        assert compared["metrics"][metric]["failing"] == []
    assert "inside the baseline band of 0001_nogit.json (±20%" in result.summary
    (plot,) = report_evidence(result)["plots"]
    assert Path(plot).read_bytes()[:4] == b"\x89PNG" and Path(plot).parent == Path(report_evidence(result)["run_dir"])


@pytest.mark.canary
def test_accumulating_gradients_learn_but_leave_the_band(
    saved_baseline: tuple[Path, CheckResult], patched_example: PatchedExample
) -> None:
    _, saved = saved_baseline
    baseline = Path(report_evidence(saved)["baseline"]["path"])
    patched = patched_example(ACCUMULATING_GRADIENTS, _job(30, baseline))
    result = _canary(patched)
    assert result.status == "failed", result.summary
    # it still learns: the plain canary (loss and val_loss drops) passes it
    assert report_evidence(result)["loss"]["drop"] >= 0.3 and report_evidence(result)["val"]["drop"] >= 0.05
    assert "left the baseline band" in result.summary and "fell by only" not in result.summary
    val = report_evidence(result)["baseline"]["metrics"]["val_loss"]
    # measured on 2 cores: val_loss 0.871 vs 0.645 at step 20 (+35%), loss up to +27% at steps 20-22
    assert [e["worst_step"] for e in val["failing"]] == [20] and val["max_deviation"] > 0.25
    assert "val_loss left the baseline band at step 20 (1 of 2 points outside): up to " in result.summary
    assert "% above the baseline at step 20 (" in result.summary
    (plot,) = report_evidence(result)["plots"]
    assert f"; plot: {plot}" in result.summary and Path(plot).read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow
@pytest.mark.canary
def test_over_60_steps_the_loss_itself_leaves_the_band_for_many_steps(
    tmp_path: Path, patched_example: PatchedExample
) -> None:
    clean = _clean_copy(tmp_path / "clean", 60)
    saved = _canary(clean, save_baseline=True)
    assert saved.status == "passed", saved.summary
    again = _canary(clean)
    assert again.status == "passed", again.summary
    patched = patched_example(ACCUMULATING_GRADIENTS, _job(60, Path(report_evidence(saved)["baseline"]["path"])))
    result = _canary(patched)
    assert result.status == "failed", result.summary
    loss = report_evidence(result)["baseline"]["metrics"]["loss"]
    # measured: +15..48% over steps 15-40 (rolling median of 7), 15+ consecutive steps outside
    assert sum(e["points"] for e in loss["failing"]) >= 10 and loss["max_deviation"] > 0.3, loss
    assert result.summary.startswith("loss left the baseline band at steps "), result.summary
