"""Every import the docs, the README and the examples show still works (docs/architecture.md:
a module that moved keeps its documented path as a re-export or a forward)."""

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


#: what the docs and examples imported before the layout of issue 11 (they now show the new
#: paths): each old path must keep working for the code people wrote against it
BEFORE = [
    ("trainguard", "track"),
    ("trainguard.config", "load_config"),
    ("trainguard.distributed", "assert_ddp_gradients_match"),
    ("trainguard.distributed", "assert_state_roundtrip"),
    ("trainguard.faults", "FaultContext"),
    ("trainguard.faults.disk_full", "DiskFullFault"),
    ("trainguard.faults.toxiproxy", "open_toxiproxy"),
    ("trainguard.gate.local_ray", "LocalRay"),
    ("trainguard.gate.provenance", "staleness"),
    ("trainguard.gate.queue", "SubmissionSpec"),
    ("trainguard.gate.queue", "get_backend"),
    ("trainguard.gate.ray_jobs", "RayJobsBackend"),
    ("trainguard.gate.policy", "decide"),
    ("trainguard.launch", "Launcher"),
    ("trainguard.profiling", "profile_job"),
    ("trainguard.profiling", "parse_regressions"),
    ("trainguard.runner", "JobRunner"),
    ("trainguard.seeding", "deterministic_mode"),
    ("trainguard.seeding", "rng_state"),
    ("trainguard.strategies", "classification_batches"),
    ("trainguard.checks", "check"),
    ("trainguard.checks", "run_in_order"),
    ("trainguard.drills", "drill"),
    ("trainguard.tracking", "LIVE_INTERVAL_S"),
    ("trainguard.tracking", "LAUNCH_RUN_WAIT_S"),
]


def test_the_docs_show_imports_to_check() -> None:
    assert len(DOCUMENTED) >= 30 and any(module == "trainguard" for _, module, _ in DOCUMENTED)


@pytest.mark.parametrize(("module", "name"), BEFORE, ids=lambda v: str(v))
def test_an_import_documented_before_the_layout_still_works(module: str, name: str) -> None:
    assert hasattr(importlib.import_module(module), name)


@pytest.mark.parametrize(("where", "module", "name"), DOCUMENTED, ids=lambda v: str(v))
def test_a_documented_import_works(where: str, module: str, name: str) -> None:
    imported = importlib.import_module(module)
    if not hasattr(imported, name):
        importlib.import_module(f"{module}.{name}")  # `from pkg import submodule`
