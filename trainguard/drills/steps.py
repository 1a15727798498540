"""Which steps of a restarted run are compared with the uninterrupted one (recover drills and
chaos soaks): every step, except one a rank saved and died before printing."""

from __future__ import annotations

from collections.abc import Iterable

from trainguard.launch import RunResult

__all__ = ["judged_steps", "unprinted_resumed_steps"]


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
