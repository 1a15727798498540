"""An expectation's judge as registered: a :class:`JudgeEntry` per expectation, named by one
line of :data:`trainguard.config.faults.EXPECTATIONS` (docs/drills.md). The drill driver calls
the entry's judge and reads from the entry how to (its verdict may wait on an untimed run),
never from which function the judge is."""

from __future__ import annotations

from dataclasses import dataclass

from trainguard.drills.judges import Judge, judge_continue, judge_fail_clean, judge_recover

__all__ = ["CONTINUE", "FAIL_CLEAN", "RECOVER", "JudgeEntry"]


@dataclass(frozen=True)
class JudgeEntry:
    """One expectation's judge, as :data:`trainguard.config.faults.EXPECTATIONS` holds it."""

    #: the expectation it judges (``expect:``)
    name: str
    #: what the driver saw -> the verdict
    judge: Judge
    #: its verdict waits on an untimed verification run (fail_clean's resume from the checkpoint
    #: the fault left): while ``runner.untimed_later`` is set the drill returns a ``Later`` that
    #: the session finishes after its timed checks
    finishes_later: bool = False

    def but_judged_by(self, judge: Judge) -> JudgeEntry:
        """This expectation judged by ``judge`` (a fault's own form of it), finished at once."""
        return JudgeEntry(self.name, judge)


RECOVER = JudgeEntry("recover", judge_recover)
FAIL_CLEAN = JudgeEntry("fail_clean", judge_fail_clean, finishes_later=True)
CONTINUE = JudgeEntry("continue", judge_continue)
