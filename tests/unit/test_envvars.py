"""Every ``TRAINGUARD_*`` name the code holds is named once and documented: a setting
(``config.settings.OPTIONS``) or an entry of ``_internal/envvars.py``, listed in
docs/markers-and-options.md; outside those two modules (and the start-up hook's agents, which run
on the standard library alone) the code uses the constant, never the literal."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from trainguard._internal import envvars
from trainguard.config.settings import OPTIONS

ROOT = Path(__file__).resolve().parents[2]
NAME = re.compile(r"\bTRAINGUARD_[A-Z0-9_]*[A-Z0-9]\b")
SETTINGS = {option.env for option in OPTIONS}
#: where a literal name is the definition (or the agents that cannot import trainguard)
DEFINED_IN = {
    "trainguard/_internal/envvars.py",
    "trainguard/config/settings.py",
    "trainguard/launch/hook/_trainguard_fault_agent.py",
    "trainguard/launch/hook/_trainguard_run_agent.py",
    "trainguard/launch/hook/sitecustomize.py",
}


def _sources() -> list[Path]:
    return sorted(p for folder in ("trainguard", "plugins", "fixtures") for p in (ROOT / folder).rglob("*.py"))


def _mentioned() -> dict[str, list[str]]:
    """Every TRAINGUARD_* name in the code's text (literals, messages, docstrings) -> where."""
    found: dict[str, list[str]] = {}
    for path in _sources():
        for name in NAME.findall(path.read_text(encoding="utf-8")):
            found.setdefault(name, []).append(str(path.relative_to(ROOT)))
    return found


def test_every_name_in_the_code_is_a_setting_or_named_in_envvars() -> None:
    known = SETTINGS | set(envvars.VARIABLES)
    unknown = {name: where for name, where in _mentioned().items() if name not in known}
    assert unknown == {}, "name each variable in trainguard/_internal/envvars.py (VARIABLES) and the docs"


def test_the_code_uses_the_constant_not_the_literal() -> None:
    literals = []
    for path in _sources():
        rel = str(path.relative_to(ROOT))
        if rel in DEFINED_IN:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in envvars.VARIABLES:
                literals.append(f"{rel}:{node.lineno}: {node.value}")
    assert literals == [], "use the constant of trainguard._internal.envvars"


def test_every_variable_and_setting_is_in_the_settings_docs() -> None:
    text = (ROOT / "docs" / "markers-and-options.md").read_text(encoding="utf-8")
    missing = sorted(name for name in SETTINGS | set(envvars.VARIABLES) if f"`{name}`" not in text)
    assert missing == []


def test_the_hook_agents_spell_their_names_as_envvars_does() -> None:
    hook = ROOT / "trainguard" / "launch" / "hook"
    spelled = {name for path in hook.glob("*.py") for name in NAME.findall(path.read_text(encoding="utf-8"))}
    assert {envvars.FAULT_HOOK, envvars.FAULT_HOOK_PID, envvars.RUN_HOOK} <= spelled
    assert spelled <= set(envvars.VARIABLES) | SETTINGS


def test_the_check_finds_an_unnamed_variable(tmp_path: Path) -> None:
    """The grep sees a name neither table holds (the test can fail)."""
    assert NAME.findall('os.environ.get("TRAINGUARD_NEW_THING")') == ["TRAINGUARD_NEW_THING"]
    assert "TRAINGUARD_NEW_THING" not in SETTINGS | set(envvars.VARIABLES)
