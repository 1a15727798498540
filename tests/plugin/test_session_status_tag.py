"""The MLflow session run's ``trainguard.status`` follows the session report's status
(``failed``, ``interrupted``, ``skipped``, ``passed``), not only passed/failed (issue 24)."""

from __future__ import annotations

import types
from typing import Any

import pytest
from trainguard.plugins.session import SESSION_KEY, TrainguardSession
from trainguard.plugins.tracking import finish_session

from trainguard.config.settings import Settings
from trainguard.report import CheckResult, Report


class _Tracker:
    """What finish_session asks of a tracker, recorded."""

    def __init__(self, failed: bool) -> None:
        self.session = object()
        self.session_failed = failed
        self.tags: dict[str, str] = {}
        self.texts: list[str] = []

    def log_text(self, handle: Any, text: str, path: str) -> None:
        self.texts.append(text)

    def set_tags(self, handle: Any, tags: dict[str, str]) -> None:
        self.tags.update(tags)

    def close(self) -> None:
        pass


def _finish(results: list[CheckResult], *, interrupted: bool = False, failed_here: bool = False) -> _Tracker:
    state = TrainguardSession(settings=Settings())
    state.check_results = [(f"t::{r.name}", r) for r in results]
    tracker = _Tracker(failed_here)
    state.trackers["sqlite:///x.db"] = tracker
    config = types.SimpleNamespace(stash=pytest.Stash())
    config.stash[SESSION_KEY] = state
    status = Report(job="pytest-session", checks=results, interrupted=interrupted).status
    finish_session(config, None, status)  # type: ignore[arg-type]
    return tracker


PASSED = CheckResult("smoke", "passed", "ok")
SKIPPED = CheckResult("drill:kill", "skipped", "no fault for this job kind")
FAILED = CheckResult("resume", "failed", "diverged")


@pytest.mark.parametrize(("results", "interrupted", "failed_here", "tag"), [
    ([PASSED], False, False, "passed"),
    ([SKIPPED], False, False, "skipped"),  # was `passed`: nothing was tested
    ([PASSED], True, False, "interrupted"),  # was `passed`: a check was cut short
    ([PASSED, FAILED], False, True, "failed"),
    ([PASSED, FAILED], False, False, "passed"),  # another store's check failed
])
def test_the_session_tag_is_the_report_status(results: list[CheckResult], interrupted: bool,
                                              failed_here: bool, tag: str) -> None:
    tracker = _finish(results, interrupted=interrupted, failed_here=failed_here)
    assert tracker.tags["trainguard.status"] == tag
    expected = "failed" if FAILED in results else tag
    assert f'"status": "{expected}"' in tracker.texts[0]  # the summary logged to the run
