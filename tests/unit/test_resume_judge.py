"""The resume judgement's shared rules (``checks.resume_judge``): where a resumed run began, read by
the resume, reshard and compat checks alike, and the one comparison every resumed run gets (a
single kill's resumed run and each cycle of a chain)."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainguard.checks.calibration import ToleranceUsed
from trainguard.checks.resume_judge import ResumeRuns, compare_resumed, where_resumed
from trainguard.config import ResumeCheck, parse_config
from trainguard.launch import MetricPoint, RunResult
from trainguard.run.request import RunRequest

JOB = """\
job:
  name: judged
  command: "python t.py --steps {steps}"
  resume_args: "--resume"
  metrics:
    loss: 'step (?P<step>\\d+) loss (?P<value>\\S+)'
    val_loss: 'step (?P<step>\\d+) val (?P<value>\\S+)'
"""


@pytest.mark.parametrize(("first_step", "expected_steps", "where"), [
    (6, range(1, 11), (False, 5)),  # resumed after step 5
    (1, range(1, 11), (True, 0)),  # began again at the first step
    (0, range(0, 11), (True, 0)),  # a job counting from 0 (nanoGPT's `iter 0`) began again
    (1, range(0, 11), (False, 0)),  # ... and resumed from its checkpoint of step 0
])
def test_where_a_resumed_run_began_is_one_rule(first_step: int, expected_steps: range,
                                               where: tuple[bool, int]) -> None:
    assert where_resumed(first_step, dict.fromkeys(expected_steps, 1.0)) == where


def _run(points: dict[str, dict[int, float]]) -> RunResult:
    return RunResult("completed", [], Path("."), 1, 0, [],
                     [MetricPoint(name, step, value, 0, float(step)) for name, values in points.items()
                      for step, value in values.items()], 1.0, None)


def _runs(reference: RunResult) -> ResumeRuns:
    spec = ResumeCheck(steps=10, after_step=4)
    return ResumeRuns(parse_config(JOB), spec, "loss", ToleranceUsed(0.0, 0.0, "spec"),
                      RunRequest.make(steps=10, seed=0, world_size=1), reference, 0.0, "")


def test_every_resumed_run_is_compared_in_the_progress_metric_first_then_where_the_reference_printed_the_others() -> None:
    loss = {s: 1.0 / s for s in range(1, 11)}
    reference = _run({"loss": loss, "val_loss": {5: 0.5, 10: 0.4}})
    resumed = _run({"loss": {s: v for s, v in loss.items() if s > 4}, "val_loss": {5: 0.5, 10: 0.3}})
    progress, val = compare_resumed(_runs(reference), resumed, range(5, 11))
    assert (progress.metric, progress.compared_steps, progress.ok) == ("loss", 6, True)
    assert (val.metric, val.compared_steps, val.first_divergent_step) == ("val_loss", 2, 10)


def test_a_resumed_run_with_no_step_of_the_progress_metric_in_common_is_compared_and_fails() -> None:
    reference = _run({"loss": {s: 1.0 for s in range(1, 11)}})
    (progress,) = compare_resumed(_runs(reference), _run({"loss": {11: 1.0}}), range(11, 11))
    assert progress.compared_steps == 0 and not progress.ok  # never skipped, never a pass
