"""Per-session state of the pytest layer, kept in ``config.stash``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from trainguard.config.settings import Settings
from trainguard.report import CheckResult

__all__ = [
    "SEED_EXPLICIT_PROPERTY",
    "SEED_PROPERTY",
    "SESSION_KEY", "SeededFailure", "TrainguardSession", "get_session"]


#: user_properties a seeded test carries (they travel to the xdist controller with its report)
SEED_PROPERTY = "trainguard_seed"
SEED_EXPLICIT_PROPERTY = "trainguard_seed_explicit"


@dataclass(frozen=True)
class SeededFailure:
    """A failed seeded test and the command that reproduces it."""

    nodeid: str
    seed: int
    reproduce: str


@dataclass
class TrainguardSession:
    """What the plugin knows across one pytest session (the controller's view under xdist)."""

    settings: Settings
    seeded_failures: list[SeededFailure] = field(default_factory=list)
    check_results: list[tuple[str, CheckResult]] = field(default_factory=list)
    report_paths: list[str] = field(default_factory=list)
    #: one JobRunner per job file in this process: checks of one job share reference runs
    runners: dict[str, Any] = field(default_factory=dict)
    #: one trainguard.tracking.Tracker per tracking store, opened by the first check item using it
    trackers: dict[str, Any] = field(default_factory=dict)
    #: the terminal-summary lines of the gate verdicts (job files with a ``gate:`` section)
    gate_lines: list[str] = field(default_factory=list)


SESSION_KEY = pytest.StashKey[TrainguardSession]()


def get_session(config: pytest.Config) -> TrainguardSession:
    """The session object; a clear error when the plugin was not configured (e.g. -p no:)."""
    try:
        return config.stash[SESSION_KEY]
    except KeyError:
        raise RuntimeError(
            "the trainguard plugin is not active in this pytest run; "
            "remove `-p no:trainguard` to use tg_* fixtures"
        ) from None
