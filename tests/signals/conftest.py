"""The ``watch`` fixture of the signal tests (the helpers are in tests/signals/watching.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.signals.watching import Watched, watch_fixture


@pytest.fixture
def watch(tmp_path: Path) -> Iterator[Callable[..., Watched]]:
    """``watch(argv, env=...)`` starts a watched command in ``tmp_path``; whatever is left when
    the test ends is killed, unmounted and removed."""
    yield from watch_fixture(tmp_path)
