"""The smoke and canary checks on the shipped example, clean and with realistic planted defects.

As in test_digits_checks.py, each defect is a textual patch of a private copy of
examples/digits that must apply exactly once. Each job runs once (30 steps, no DataLoader
workers, a few seconds, most of it importing torch), and every failure must name its cause.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.helpers import report_evidence
from trainguard.report import CheckResult
from trainguard.session import check

if TYPE_CHECKING:
    from conftest import PatchedExample


# Measured on 2 cores: the clean job's loss falls ~56% over 30 steps (median of steps 1-3 vs
# 28-30), peak RSS ~316 MB, ~5.5 s (4 s of it before the first step).
JOB_FILE = """\
job:
  name: digits-canary
  command: "python train.py --steps {steps} --ckpt-dir {checkpoint_dir} --seed {seed}"
  resume_args: "--resume"
  env: {OMP_NUM_THREADS: "1"}
  metrics:
    loss: 'step (?P<step>\\d+) loss (?P<value>\\S+)'
    val_loss: 'step (?P<step>\\d+) val_loss (?P<value>\\S+)'
  timeout: 120
  stall_timeout: 60
checks:
  smoke: {steps: 5}
  canary: {steps: 30, max_seconds: 60, max_memory_mb: 1000, min_loss_drop: 0.3}
"""




def _only(root: Path, tmp_path: Path, name: str) -> CheckResult:
    report = check(root, only=[name], report_json=str(tmp_path / "report.json"))
    (result,) = report.checks
    return result


# --------------------------------------------------------------------------------------------
# canary
# --------------------------------------------------------------------------------------------


@pytest.mark.canary
def test_clean_example_passes_the_canary_through_the_fixture(
    tmp_path: Path,
    tg_canary: Callable[..., CheckResult],
    request: pytest.FixtureRequest,
    patched_example: PatchedExample,
) -> None:
    root = patched_example({}, JOB_FILE)
    result = tg_canary(root / "trainguard.yaml", val_metric="val_loss", min_val_drop=0.05)
    assert request.node.get_closest_marker("canary") is not None
    loss = report_evidence(result)["loss"]
    assert (loss["early_steps"], loss["late_steps"]) == ("1-3", "28-30")
    assert loss["drop"] > 0.4, loss
    assert 100 < report_evidence(result)["peak_rss_mb"]["0"] < 1000
    assert report_evidence(result)["duration_s"] < 60


# what each planted defect does to the clean job, the canary settings it runs under, and the
# words its failure must contain
CANARY_BUGS: dict[str, tuple[dict[str, tuple[str, str]], str, list[str]]] = {
    "frozen_model": (
        {"train.py": ("            optimizer.step()\n", "            pass  # planted: no update\n")},
        "",
        ["loss fell by only", "min_loss_drop is 30%"],
    ),
    "exploding_learning_rate": ({}, 'args: "--lr 50"', ["loss spiked at step 2: "]),
    "nan_loss": (
        {"train.py": (
            "            loss = F.cross_entropy(ddp_model(images), labels)\n",
            "            loss = F.cross_entropy(ddp_model(images), labels)\n"
            "            if step >= 11:  # planted\n"
            "                loss = loss * float('nan')\n",
        )},
        "",
        ["loss is nan at step 12 (the first non-finite value; finite up to step 11)"],
    ),
    "slower_than_its_limit": (
        {"train.py": (
            "            scheduler.step()\n",
            "            scheduler.step()\n            time.sleep(0.5)  # planted\n",
        )},
        "max_seconds: 8",
        ["limit max_seconds (8) exceeded: the run was stopped after "],
    ),
    "memory_limit": (
        {"train.py": (
            "            step += 1\n",
            "            step += 1\n"
            # planted: 40 MB more per step, kept (on the function object: one patch per file)
            "            train.hog = [*getattr(train, 'hog', []), torch.ones(10_000_000)]\n"
            "            time.sleep(0.05)\n",
        )},
        "max_memory_mb: 600",
        ["limit max_memory_mb (600) exceeded: rank 0's processes used ", "MB over the limit of 600 MB"],
    ),
}


@pytest.mark.canary
@pytest.mark.parametrize("bug", sorted(CANARY_BUGS))
def test_canary_catches_planted_defect(
    tmp_path: Path, patched_example: PatchedExample, bug: str
) -> None:
    patches, setting, expected = CANARY_BUGS[bug]
    canary_line = "  canary: {steps: 30, max_seconds: 60, max_memory_mb: 1000, min_loss_drop: 0.3}"
    if setting:
        key = setting.split(":")[0]
        fields = [f for f in canary_line.split("{")[1].rstrip("}").split(", ") if not f.startswith(key)]
        job_file = JOB_FILE.replace(canary_line, "  canary: {" + ", ".join([*fields, setting]) + "}")
    else:
        job_file = JOB_FILE
    assert canary_line in JOB_FILE
    root = patched_example(patches, job_file)
    result = _only(root, tmp_path, "canary")
    assert result.status == "failed", result.summary
    for text in expected:
        assert text in result.summary, result.summary
    assert result.reproduce and "train.py --steps 30" in result.reproduce
    if bug == "slower_than_its_limit" and (report_evidence(result)["last_step"] or 0) >= 2:
        # by how much: its pace says how long it would have needed (on a loaded machine the
        # deadline may come before two steps, and then there is no pace to tell)
        assert " s per step) it needed about " in result.summary, result.summary


# --------------------------------------------------------------------------------------------
# smoke
# --------------------------------------------------------------------------------------------


@pytest.mark.smoke
def test_clean_example_passes_smoke_with_every_stage_timed(
    tmp_path: Path, patched_example: PatchedExample
) -> None:
    result = _only(patched_example({}, JOB_FILE), tmp_path, "smoke")
    assert result.status == "passed", result.summary
    assert result.summary.endswith(
        "metrics for every step, 1 checkpoint file(s); resumed from the checkpoint of step 5 at step 6"
    )
    stages = report_evidence(result)["stages"]
    for stage in ("launch_to_first_metric_s", "first_to_last_metric_s", "last_metric_to_exit_s",
                  "checkpoint_load_s", "resume_s"):
        assert isinstance(stages[stage], float) and stages[stage] >= 0, (stage, stages)
    assert report_evidence(result)["checkpoint"]["step"] == 5 and report_evidence(result)["checkpoint"]["loaded"]
    resume = report_evidence(result)["resume"]
    assert (resume["checkpoint_step"], resume["first_step"], resume["last_step"]) == (5, 6, 7)
    assert "--resume" in (result.reproduce or "")


SMOKE_BUGS = {
    "checkpoint_holds_a_pickled_object": (
        {"train.py": ('"rng": gathered,', '"rng": gathered, "args": args,  # planted')},
        ["the checkpoint does not load: ", "is refused: it holds the global argparse.Namespace, "
         "which loading would call", "Save plain state dicts"],
    ),
    "resume_restarts_at_step_1": (
        {"train.py": ("    if args.resume:\n        state = resume_state(",
                      "    if False:  # planted\n        state = resume_state(")},
        ["the resumed run started again from step 1 instead of step 6 (the checkpoint is of step 5)"],
    ),
}


@pytest.mark.smoke
@pytest.mark.parametrize("bug", sorted(SMOKE_BUGS))
def test_smoke_catches_planted_defect(
    tmp_path: Path, patched_example: PatchedExample, bug: str
) -> None:
    patches, expected = SMOKE_BUGS[bug]
    result = _only(patched_example(patches, JOB_FILE), tmp_path, "smoke")
    assert result.status == "failed", result.summary
    for text in expected:
        assert text in result.summary, result.summary
