"""The opening every drill judge shares: an error verdict when the fault never struck the running
job (nothing was tested, :func:`~trainguard.drills.judges.not_injected`), else the judge starts
from what every drill's report holds (:func:`~trainguard.drills.judges.common_evidence`)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TypeVar

from trainguard.drills.evidence import DrillEvidence
from trainguard.drills.judges import DrillContext, Judge, Judgement, common_evidence, not_injected

__all__ = ["judge_injected"]

E = TypeVar("E", bound=DrillEvidence)


def judge_injected(kind: type[E]) -> Callable[[Callable[[DrillContext, E], Judgement]], Judge]:
    """Make a judge of ``judge(c, evidence)``: the drill's verdict is
    :func:`~trainguard.drills.judges.not_injected`'s error when the fault never struck, else
    ``judge``'s, given the common evidence as the expectation's record ``kind`` to fill."""

    def wrap(judge: Callable[[DrillContext, E], Judgement]) -> Judge:
        @functools.wraps(judge)
        def run(c: DrillContext) -> Judgement:
            skipped = not_injected(c)
            if skipped:
                return skipped
            return judge(c, common_evidence(c, kind))

        return run

    return wrap
