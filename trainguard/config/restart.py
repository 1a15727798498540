"""``job.restart:`` -- how trainguard's own launcher waits between the attempts of a supervised
run and when it gives up (docs/launcher.md, "Restart policy"). ``job.max_restarts`` stays the
count; these keys shape the waits and the stop without progress."""

from __future__ import annotations

from pydantic import Field, model_validator

from trainguard._internal.limits import MAX_SECONDS
from trainguard._internal.model import ConfigModel

__all__ = ["RestartPolicy"]


class RestartPolicy(ConfigModel):
    """The restart policy's waits and stop (``job.restart``)."""

    #: the first wait before a restart, and the wait after an attempt that made progress
    backoff_s: float = Field(1.0, ge=0, le=MAX_SECONDS)
    #: the longest wait: the backoff doubles up to it while attempts make no progress
    max_backoff_s: float = Field(30.0, ge=0, le=MAX_SECONDS)
    #: each wait is lengthened by a random fraction of itself up to this (0: none), so the jobs
    #: of one failed node do not all come back in the same second; never beyond max_backoff_s
    jitter: float = Field(0.0, ge=0, le=1)
    #: give up after this many attempts in a row that got no further than an earlier one (None:
    #: only ``max_restarts`` stops a crash loop)
    max_attempts_without_progress: int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _ordered(self) -> RestartPolicy:
        if self.max_backoff_s < self.backoff_s:
            raise ValueError(
                f"max_backoff_s ({self.max_backoff_s:g}) is below backoff_s ({self.backoff_s:g}): the "
                f"backoff starts at backoff_s and doubles up to max_backoff_s; raise max_backoff_s to "
                f"at least {self.backoff_s:g}, e.g. `restart: {{backoff_s: {self.backoff_s:g}, "
                f"max_backoff_s: {max(30.0, self.backoff_s):g}}}`"
            )
        return self
