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


def test_a_chains_failing_cycle_names_the_cause_its_step_records_show(tmp_path: Path) -> None:
    """A chain whose second cycle (resumed from step 10) never loads the scheduler: its lr parts
    at step 12, the first resumed step's having come back with the optimizer. The cycle's step
    records against the uninterrupted run's name the scheduler first, with both values."""
    from dataclasses import replace

    from tests.steplines import restore, save, trajectory, write_rank
    from trainguard.checks.resume_judge import judge_cycle, judge_resume

    def run(name: str, losses: dict[int, float], outcome: str = "completed") -> RunResult:
        result = _run({"loss": losses})
        return replace(result, run_dir=tmp_path / name, outcome=outcome)  # type: ignore[arg-type]

    loss = {s: 1.0 / s for s in range(1, 31)}
    reference = run("ref", loss)
    write_rank(tmp_path / "ref", 0, trajectory(1, 30))
    runs = ResumeRuns(parse_config(JOB), ResumeCheck(steps=30, chain=[10, 20]), "loss", ToleranceUsed(0.0, 0.0, "spec"),
                      RunRequest.make(steps=30, seed=0, world_size=1), reference, 0.0, "")
    first = run("c1", {s: loss[s] for s in range(1, 11)}, outcome="stopped")
    write_rank(tmp_path / "c1", 0, trajectory(1, 10), extra=[save("model", "optimizer", "rng")])
    assert judge_cycle(runs, 1, 10, first) is None
    second = run("c2", {s: loss[s] if s == 11 else loss[s] + 0.1 for s in range(11, 21)}, outcome="stopped")
    write_rank(tmp_path / "c2", 0, [replace(s, lr=0.5) if s.n >= 2 else s for s in trajectory(1, 10, shift=10)],
               before=restore("Module.load_state_dict", "Optimizer.load_state_dict", "torch.set_rng_state"))
    assert judge_cycle(runs, 2, 20, second) is None
    result = judge_resume(runs)
    evidence = result.evidence.to_dict()
    assert result.status == "failed" and evidence["failing_cycle"] == 2
    assert evidence["first_divergence"]["step"] == 12 and evidence["first_divergence"]["kind"] == "lr"
    assert evidence["likely_causes"][0].startswith("LR scheduler state not saved or not restored (the schedule "
                                                   "restarts): the resumed run never loaded the scheduler's state: "
                                                   "group 0's lr is 0.5 at step 12 against"), evidence["likely_causes"]
    assert "Most likely LR scheduler state not saved or not restored: the resumed run never loaded" in result.summary
