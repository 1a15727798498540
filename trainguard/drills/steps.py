"""Which steps of a restarted run are compared with the uninterrupted one (recover drills and
chaos soaks): every step, except one a rank saved and died before printing; and which samples
its attempts trained together (:func:`attempts_accounting`)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from trainguard.checks.accounting import SampleAccounting, Segment, account_samples
from trainguard.launch import RunResult
from trainguard.launch.metrics import first_step
from trainguard.launch.samples import read_samples

__all__ = ["attempts_accounting", "judged_steps", "unprinted_resumed_steps"]


def unprinted_resumed_steps(attempts: Iterable[RunResult], metric: str) -> list[int]:
    """Steps no attempt printed that a later attempt resumed right after: the rank checkpointed
    the step and died before printing it (a job that saves before it logs). The step was done and
    its state was kept, only its line was lost with the process, so it is not a missing step."""
    attempts = list(attempts)
    printed = {p.step for a in attempts for p in a.points if p.name == metric}
    out = []
    for later in attempts[1:]:
        steps = [p.step for p in later.points if p.name == metric]
        if steps and min(steps) - 1 >= 1 and min(steps) - 1 not in printed:
            out.append(min(steps) - 1)
    return sorted(set(out))


def judged_steps(attempts: Iterable[RunResult], metric: str, steps: int) -> tuple[list[int], list[int]]:
    """Steps 1..``steps`` to compare with the uninterrupted run, and those left out (see
    :func:`unprinted_resumed_steps`)."""
    excused = unprinted_resumed_steps(attempts, metric)
    return [s for s in range(1, steps + 1) if s not in excused], excused


def attempts_accounting(reference: RunResult, attempts: Sequence[RunResult], metric: str,
                        steps: int) -> SampleAccounting | None:
    """Every sample exactly once across a restarted run's attempts, against the uninterrupted
    run, per epoch (:func:`~trainguard.checks.accounting.account_samples`): each attempt keeps
    the steps up to the one the next attempt resumed after. None when no attempt restarted or
    nothing was recorded."""
    if len(attempts) < 2:
        return None
    reference_samples = read_samples(reference.run_dir)
    if not reference_samples:
        return None
    base = first_step(reference.points, metric)
    firsts = [min((p.step for p in a.points if p.name == metric), default=None) for a in attempts]
    segments, start = [], base
    for i, attempt in enumerate(attempts):
        if firsts[i] is None and i > 0:
            continue  # an attempt that printed nothing kept nothing
        later = next((f for f in firsts[i + 1:] if f is not None), None)
        last = later - 1 if later is not None else steps
        label = "before the first fault" if i == 0 else f"after restart {i} (resumed from step {start - 1})"
        segments.append(Segment(read_samples(attempt.run_dir), start, last, label))
        if later is not None:
            start = later
    return account_samples(reference_samples, segments, steps=steps, first_step=base)
