"""The parameters of one run (:class:`RunRequest`): what a check asks the runner for."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = ["RunRequest", "share_key"]


@dataclass(frozen=True)
class RunRequest:
    """The parameters of one run; equal requests give interchangeable reference runs."""

    steps: int
    seed: int
    world_size: int
    args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    timeout: float | None = None
    max_rss_mb: float | None = None  # per rank's process tree; the launcher stops the run above

    @classmethod
    def make(
        cls,
        *,
        steps: int,
        seed: int,
        world_size: int,
        args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        timeout: float | None = None,
        max_rss_mb: float | None = None,
    ) -> RunRequest:
        """A request from keyword arguments (``env`` as a mapping, kept sorted)."""
        return cls(
            steps, seed, world_size, tuple(args), tuple(sorted((env or {}).items())), timeout,
            max_rss_mb,
        )


def share_key(request: RunRequest) -> RunRequest:
    """The key an uninterrupted run is shared by: limits are not what a run computes, so a run
    that finished within any limits is the uninterrupted run of its steps, seed, world size,
    args and env."""
    return dataclasses.replace(request, timeout=None, max_rss_mb=None)
