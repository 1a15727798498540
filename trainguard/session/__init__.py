"""A trainguard session: a job file's checks run in order on one runner, one tracker, closed in one place."""

from __future__ import annotations

from trainguard.session.drills import drill, run_drills, soak
from trainguard.session.orchestrate import (
    available_checks,
    check,
    lane_plan,
    run_check,
    run_checks,
    run_in_order,
)
from trainguard.session.session import Session, open_session, session_settings

__all__ = [
    "Session",
    "available_checks",
    "check",
    "drill",
    "lane_plan",
    "open_session",
    "run_check",
    "run_checks",
    "run_drills",
    "run_in_order",
    "session_settings",
    "soak",
]
