"""Suite-wide fixtures."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _tracking_off_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """MLflow tracking is tested by tests/unit/test_tracking.py (which turns it on); elsewhere it
    would only add its import and flush time to every check."""
    monkeypatch.setenv("TRAINGUARD_TRACKING", "off")
