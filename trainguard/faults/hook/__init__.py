"""The start-up hook faults use to act inside a rank's Python process.

:func:`hook_env` returns the environment that puts this directory first on a rank's PYTHONPATH
(so its ``sitecustomize.py`` runs at start-up, chaining any existing one) and hands it the fault
spec in ``TRAINGUARD_FAULT_HOOK``. The fault fires when the drill creates the spec's trigger file
(:func:`pull_trigger`), which the armed process polls every 15 ms.

See docs/faults-memory-and-disk.md.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["ENV_SPEC", "HOOK_DIR", "hook_env", "pull_trigger", "read_events"]

ENV_SPEC = "TRAINGUARD_FAULT_HOOK"
#: the directory that goes first on the ranks' PYTHONPATH
HOOK_DIR = Path(__file__).resolve().parent


def hook_env(spec: Mapping[str, Any], base_env: Mapping[str, str] | None = None) -> dict[str, str]:
    """PYTHONPATH (the hook first, then the job's own entries) and the spec for the ranks.

    ``base_env`` is the job's environment; its PYTHONPATH (or this process's) is kept after ours.
    """
    if "trigger" not in spec:
        raise ValueError("a fault hook spec needs a 'trigger' file path")
    env = base_env if base_env is not None else os.environ
    existing = env.get("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
    parts = [str(HOOK_DIR), *[p for p in existing.split(os.pathsep) if p and p != str(HOOK_DIR)]]
    return {"PYTHONPATH": os.pathsep.join(parts), ENV_SPEC: json.dumps(dict(spec))}


def pull_trigger(path: Path, pid: int | None = None) -> None:
    """Create the trigger file (atomically); with ``pid`` only that process fires."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("" if pid is None else str(pid))
    os.replace(tmp, path)


def read_events(path: Path) -> list[dict[str, Any]]:
    """The hook's event log (armed, triggered, raised, enospc, ballast_held, error, ...)."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return []
    events = []
    for line in lines:
        try:
            events.append(json.loads(line))
        except ValueError:
            continue  # a line cut short by a kill
    return events
