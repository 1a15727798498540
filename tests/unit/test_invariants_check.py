"""The invariants check's wiring (trainguard.checks.invariants_check): which run it reads (another
check's uninterrupted run when the session makes one, of two or more ranks first; else its own),
and a run that recorded no step is an error, never a pass."""

from __future__ import annotations

import textwrap
from pathlib import Path

from tests.helpers import TOY
from trainguard.config.settings import Settings
from trainguard.session import check
from trainguard.session.plan import make_plan


def _job(where: Path, checks: str, *, extra: str = "") -> Path:
    where.mkdir(parents=True, exist_ok=True)
    path = where / "trainguard.yaml"
    path.write_text(textwrap.dedent(f"""\
        job:
          name: toy
          command: "python {TOY} --steps {{steps}} --seed {{seed}} --ckpt-dir {{checkpoint_dir}}"
          world_size: 1
          metrics:
            loss: 'step (?P<step>\\d+) loss (?P<value>\\S+)'
          timeout: 60
          stall_timeout: 20
        """) + extra + "checks:\n" + textwrap.indent(checks, "  "))
    return path


def _invariants_runs(path: Path, only: list[str] | None = None) -> list[tuple[int, int, bool]]:
    plan = make_plan(path, Settings(), only=only)
    (planned,) = [c for c in plan.checks if c.name == "invariants"]
    return [(r.steps, r.world_size, r.reference is not None) for r in planned.runs]


def test_it_reads_the_run_another_check_makes_the_multi_rank_one_first(tmp_path: Path) -> None:
    both = "determinism: {steps: 6}\nparallel: {steps: 8, world_size: 2}\ninvariants: {}\n"
    assert _invariants_runs(_job(tmp_path / "a", both)) == [(8, 2, True)]
    without = make_plan(_job(tmp_path / "w", both.replace("invariants: {}\n", "")), Settings())
    assert make_plan(_job(tmp_path / "a", both), Settings()).launches == without.launches  # no launch of its own
    assert _invariants_runs(_job(tmp_path / "b", "determinism: {steps: 6}\ninvariants: {}\n")) == [(6, 1, True)]
    # another seed is another run: its own
    other = "determinism: {steps: 6}\ninvariants: {seed: 3}\n"
    assert _invariants_runs(_job(tmp_path / "c", other)) == [(20, 1, True)]
    assert _invariants_runs(_job(tmp_path / "d", "invariants: {steps: 5}\n")) == [(5, 1, True)]


def test_a_run_without_step_records_is_an_error_and_record_steps_off_a_skip(tmp_path: Path) -> None:
    # toy_train.py imports no torch: its run records no optimizer step
    report = check(_job(tmp_path / "toy", "invariants: {steps: 3}\n"))
    (result,) = report.checks
    assert result.status == "error", result.summary
    assert "left no step records, so no invariant was checked" in result.summary
    report = check(_job(tmp_path / "off", "invariants: {steps: 3}\n", extra="  record_steps: false\n"))
    (result,) = report.checks
    assert result.status == "skipped" and "job.record_steps is false" in result.summary, result.summary
