"""Shared fixtures of the plugin tests (inner pytest runs through pytester)."""

from __future__ import annotations

import pytest

from trainguard.config.settings import OPTIONS


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Settings from the developer's shell must not leak into the inner runs."""
    for opt in OPTIONS:
        monkeypatch.delenv(opt.env, raising=False)
    monkeypatch.setenv("TRAINGUARD_TRACKING", "off")  # tracking has its own tests
    for name in ("PYTEST_XDIST_AUTO_NUM_WORKERS", "PYTEST_ADDOPTS", "CUBLAS_WORKSPACE_CONFIG"):
        monkeypatch.delenv(name, raising=False)
