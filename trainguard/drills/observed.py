"""What the step records show of a recover drill that diverged: the restart whose run parted
from the uninterrupted one, compared with it step by step
(:func:`trainguard.checks.divergence.observe_resume`, bit for bit, as the drill compares), with what
the attempt before it saved; the causes that shows come first, each citing the observation."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from trainguard.checks.diagnosis import RESUME_CAUSE_TEXT
from trainguard.checks.divergence import DivergenceEvidence, observe_resume
from trainguard.launch import RunResult

__all__ = ["observed_restart"]


def observed_restart(reference: RunResult, attempts: Sequence[RunResult], metric: str, diverged_at: int | None,
                     steps: int) -> tuple[DivergenceEvidence | None, list[str]]:
    """(where the restart that covers step ``diverged_at`` first differs from ``reference`` in the
    step records, the causes that shows as "cause: observation"); (None, []) when no restart
    resumed before that step or neither run recorded steps."""
    expected = reference.trajectory(metric)
    if diverged_at is None or not expected:
        return None, []
    counted_from = 0 if 0 in expected else 1
    for before, attempt in itertools.pairwise(attempts):
        printed = sorted(p.step for p in attempt.points if p.name == metric)
        if not printed or not printed[0] <= diverged_at <= printed[-1] or printed[0] <= counted_from:
            continue
        found, observed = observe_resume(reference.run_dir, attempt.run_dir, before.run_dir,
                                         resumed_from=printed[0] - 1, counted_from=counted_from,
                                         last_printed=max(expected) if counted_from == 0 else steps)
        return found, [f"{RESUME_CAUSE_TEXT[c.key]}: {c.observation}" for c in observed]
    return None, []
