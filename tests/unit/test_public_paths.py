"""Every import the docs, the README and the examples show works, from the one path of each name
(docs/architecture.md, "One path per name"): the module that defines it, its package, or the
curated ``trainguard`` API. The old paths that re-exported or forwarded names are gone."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FENCE = re.compile(r"```python\n(.*?)```", re.S)
LINE = re.compile(r"^\s*from (trainguard[\w.]*) import ([\w, ]+)$", re.M)


def _documented_imports() -> list[tuple[str, str, str]]:
    """(where, module, name) of every ``from trainguard... import name`` shown to users."""
    found: list[tuple[str, str, str]] = []
    sources = [*ROOT.glob("docs/*.md"), ROOT / "README.md", *ROOT.glob("examples/**/*.py")]
    for path in sources:
        text = path.read_text(encoding="utf-8")
        blocks = [text] if path.suffix == ".py" else FENCE.findall(text)
        for block in blocks:
            try:
                tree = ast.parse(block)
            except SyntaxError:  # a snippet with elisions: read its import lines alone
                for module, names in LINE.findall(block):
                    found += [(path.name, module, n.strip()) for n in names.split(",") if n.strip()]
                continue
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("trainguard"):
                    found += [(path.name, node.module or "", a.name) for a in node.names]
    return found


DOCUMENTED = _documented_imports()


#: old path -> where its names live (0.x, nothing released: the shims and forwards were removed)
MOVED = {
    "trainguard.runner": "trainguard.run.runner",
    "trainguard.track": "trainguard.tracking.track (or `from trainguard import track`)",
    "trainguard.settings": "trainguard.config.settings",
    "trainguard.seeding": "trainguard.unit.seeding",
    "trainguard.assertions": "trainguard.unit.outputs, .gradients, .batches, .training, .equivalence",
    "trainguard.strategies": "trainguard.unit.strategies",
    "trainguard.distributed": "trainguard.unit.ddp, trainguard.unit.roundtrip",
    "trainguard.unit.assertions": "trainguard.unit.outputs, .gradients, .batches, .training, .equivalence",
    "trainguard.unit.distributed": "trainguard.unit.ddp, trainguard.unit.roundtrip",
    "trainguard.gate.local_ray": "trainguard.raytrain.local_ray",
    "trainguard.gate.queue": "trainguard.queue.base, trainguard.queue.backends",
    "trainguard.gate.ray_jobs": "trainguard.raytrain.ray_jobs",
    "trainguard.queue.ray_jobs": "trainguard.raytrain.ray_jobs",
}


def test_the_docs_show_imports_to_check() -> None:
    assert len(DOCUMENTED) >= 30 and any(module == "trainguard" for _, module, _ in DOCUMENTED)


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_path_is_gone(old: str) -> None:
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(old)


def test_the_old_session_forwards_are_gone() -> None:
    import trainguard.checks
    import trainguard.drills

    assert not hasattr(trainguard.checks, "check") and not hasattr(trainguard.drills, "drill")
    assert callable(importlib.import_module("trainguard.session").drill)


@pytest.mark.parametrize(("where", "module", "name"), DOCUMENTED, ids=lambda v: str(v))
def test_a_documented_import_works(where: str, module: str, name: str) -> None:
    imported = importlib.import_module(module)
    if not hasattr(imported, name):
        importlib.import_module(f"{module}.{name}")  # `from pkg import submodule`


def _home(module: str, name: str) -> str | None:
    """The module a documented function or class is defined in (None for constants)."""
    value = getattr(importlib.import_module(module), name, None)
    return getattr(value, "__module__", None) if callable(value) else None


@pytest.mark.parametrize(("where", "module", "name"), DOCUMENTED, ids=lambda v: str(v))
def test_the_docs_import_each_name_from_its_home(where: str, module: str, name: str) -> None:
    """A documented ``from M import N`` names N's defining module, a package above it, or the
    curated ``trainguard`` API, never a second home."""
    home = _home(module, name)
    if home is None or module == "trainguard":
        return
    assert home == module or home.startswith(module + "."), (
        f"{where} imports {name} from {module}; it is defined in {home}: import it from there"
    )
