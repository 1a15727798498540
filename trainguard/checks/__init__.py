"""The checks on a job file: smoke, canary (and its baselines), determinism, resume, parallel.

Running them as a session (``check``, ``run_check``, ``run_checks``, ``run_in_order``,
``lane_plan``, ``available_checks``) lives in :mod:`trainguard.session`, above the drills and the
profile it also runs; those names are forwarded from here on first use (their old path)."""

from __future__ import annotations

from typing import Any

_FORWARDED = (
    "LANE_CHECKS",
    "available_checks",
    "check",
    "lane_plan",
    "run_check",
    "run_checks",
    "run_in_order",
)


def __getattr__(name: str) -> Any:
    if name in _FORWARDED:
        from trainguard.session import orchestrate

        return getattr(orchestrate, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
