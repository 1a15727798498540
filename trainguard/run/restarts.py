"""The waits and the stop of trainguard's restart policy (:meth:`trainguard.run.runner.JobRunner.supervise`,
``job.restart``; docs/launcher.md, "Restart policy").

After a failed attempt the next one waits ``backoff_s``; while attempts make no progress (none got
past the furthest step an earlier one printed) the wait doubles, at most ``max_backoff_s``; after
one that made progress it is ``backoff_s`` again, so each fault of a long run costs the same. A
``jitter`` lengthens each wait by a random fraction of itself (never past ``max_backoff_s``).
With ``max_attempts_without_progress`` the policy gives up after that many attempts in a row
without progress, before ``max_restarts`` runs out: a crash loop stops by itself.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from trainguard.config.restart import RestartPolicy

__all__ = ["Backoff", "Waited", "restart_policy"]


@dataclass(frozen=True)
class Waited:
    """One restart as the policy decided it: the attempt it follows, the furthest step any
    attempt had printed, whether that attempt made progress, the wait chosen and the wait
    measured (from the end of that attempt to the start of the next)."""

    after_attempt: int
    reached_step: int
    progress: bool
    wait_s: float
    measured_s: float | None = None


@dataclass
class Backoff:
    """The policy's state over the attempts of one supervised run."""

    policy: RestartPolicy
    rng: random.Random = field(default_factory=random.Random)
    best: int = 0
    streak: int = 0
    delay: float | None = None
    #: why the run stopped before ``max_restarts`` (empty: it did not)
    gave_up: str = ""

    def after(self, attempt: int, reached: int | None) -> Waited | None:
        """The wait before the next attempt after ``attempt`` got to step ``reached`` (its last
        step printed), or None when the policy gives up (``gave_up`` says why)."""
        step = reached or 0
        progress = step > self.best
        self.best = max(self.best, step)
        self.streak = 0 if progress else self.streak + 1
        limit = self.policy.max_attempts_without_progress
        if limit is not None and self.streak >= limit:
            self.gave_up = (f"gave up: {self.streak} attempt(s) in a row got no further than step {self.best} "
                            f"(job.restart.max_attempts_without_progress {limit})")
            return None
        base, top = self.policy.backoff_s, self.policy.max_backoff_s
        self.delay = base if progress or self.delay is None else min(self.delay * 2, top)
        wait = min(self.delay * (1 + self.policy.jitter * self.rng.random()), max(top, base))
        return Waited(attempt, self.best, progress, wait)


def restart_policy(policy: RestartPolicy, backoff_s: float | None) -> RestartPolicy:
    """The job's policy, its first wait set by the caller when given (a drill's short one)."""
    if backoff_s is None:
        return policy
    return policy.model_copy(update={"backoff_s": backoff_s, "max_backoff_s": max(policy.max_backoff_s, backoff_s)})
