"""The wheel check's expected entry points are the ones pyproject.toml declares.

``ci/dist_check.py`` builds the wheel in CI only; an entry point renamed in pyproject.toml
and not there failed CI after the whole install (session 20). This compares the two without
building anything.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib", reason="tomllib is Python 3.11's")

ROOT = Path(__file__).resolve().parents[2]


def _dist_check():
    spec = importlib.util.spec_from_file_location("dist_check", ROOT / "ci" / "dist_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _declared() -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    groups = [project.get("scripts", {}), *project.get("entry-points", {}).values()]
    return {f"{name} = {target}" for group in groups for name, target in group.items()}


def test_every_entry_point_the_wheel_check_wants_is_declared():
    wanted = set(_dist_check().REQUIRED_ENTRY_POINTS)
    assert wanted <= _declared(), f"ci/dist_check.py wants {sorted(wanted - _declared())}"


def test_the_console_script_is_among_those_checked():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    wanted = set(_dist_check().REQUIRED_ENTRY_POINTS)
    assert {f"{name} = {target}" for name, target in scripts.items()} <= wanted
