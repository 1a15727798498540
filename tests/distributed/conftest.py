"""Shared fixtures of the multi-process tests."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.helpers import patched_copy

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "digits"

PatchedExample = Callable[[dict[str, tuple[str, str]], str], Path]


@pytest.fixture
def patched_example(tmp_path: Path) -> PatchedExample:
    """Make a private copy of examples/digits with planted bugs and a job file of the test's own.

    ``patched_example({file: (old, new)}, job_yaml)`` applies each replacement exactly once: a
    change to the example that moves a patched line fails the test loudly instead of silently
    testing nothing. The shipped script itself is never modified.
    """

    def make(patches: dict[str, tuple[str, str]], job_file: str) -> Path:
        return patched_copy(EXAMPLE, tmp_path / "digits", patches, job_file)

    return make
