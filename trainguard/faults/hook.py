"""Faults that act inside a rank's Python process through trainguard's start-up hook.

The hook itself lives in :mod:`trainguard.launch.hook` (its directory goes first on a rank's
PYTHONPATH; :func:`hook_env` hands it the fault spec in ``TRAINGUARD_FAULT_HOOK``). The fault
fires when the drill creates the spec's trigger file (:func:`pull_trigger`), which the armed
process polls every 15 ms.

See docs/faults-memory-and-disk.md.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Collection
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict

from trainguard.faults.base import Fault, FaultContext

if TYPE_CHECKING:  # pragma: no cover
    from trainguard.launch import RunResult

__all__ = ["HookEvent", "HookFault", "pull_trigger", "rank_stderr", "read_events"]


class HookEvent(TypedDict, total=False):
    """One line of the start-up hook's event log, as the hook writes it
    (``trainguard/launch/hook/_trainguard_fault_agent.py``: ``event()``): when, which process and
    rank, what happened, and that event's own keys (a fault's agent may add more)."""

    t: float
    pid: int
    #: the process's ``RANK`` as its environment gave it (None: none yet, a Ray worker)
    rank: str | None
    #: armed, triggered, cleared, raised, error, enospc, injected, torch_patched, ballast_*, gpu_*
    event: str
    fault: str
    mode: str
    argv: list[str]
    error: str
    #: enospc: the file and the call that got it
    path: str
    via: str
    #: nan's injected: where, what and at which step
    target: str
    value: str
    step: int | None
    optimizer_steps_done: int | None
    held_mb: float
    #: sdc's flipped: the tensor (a parameter's or a module's name), its optimizer state's key,
    #: the element (row-major in the rank's local tensor), the bit, the values before and after
    tensor: str
    state_key: str | None
    index: int
    bit: int
    dtype: str
    old: float
    new: float
    old_bits: str
    new_bits: str


def pull_trigger(path: Path, pid: int | Collection[int] | None = None) -> None:
    """Create the trigger file (atomically); with ``pid`` only that process fires (crash_loop:
    several pids, one a line, each fires)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("" if pid is None else str(pid) if isinstance(pid, int) else "\n".join(map(str, pid)))
    os.replace(tmp, path)


def read_events(path: Path) -> list[HookEvent]:
    """The hook's event log (armed, triggered, raised, enospc, ballast_held, error, ...)."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return []
    events: list[HookEvent] = []
    for line in lines:
        try:
            events.append(json.loads(line))
        except ValueError:
            continue  # a line cut short by a kill
    return events


class HookFault(Fault):
    """A fault that acts through the start-up hook: its trigger file and the hook's event log
    live in the drill's work directory, named after the fault's kind."""

    _ctx: FaultContext | None = None

    @property
    def trigger(self) -> Path:
        assert self._ctx is not None, "setup() first"
        return self._ctx.work_dir / f"{self.kind}.trigger"

    @property
    def events_path(self) -> Path:
        assert self._ctx is not None, "setup() first"
        return self._ctx.work_dir / f"{self.kind}-hook-events.jsonl"

    def _prepare(self, ctx: FaultContext) -> None:
        """Remember the context, create the work dir, remove a trigger left by an earlier run."""
        self._ctx = ctx
        ctx.work_dir.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            self.trigger.unlink()

    def hook_events(self) -> list[HookEvent]:
        return read_events(self.events_path) if self._ctx is not None else []


def rank_stderr(result: RunResult, rank: int, max_bytes: int = 16384) -> str:
    """The end of ``rank``'s stderr log (a whole traceback); the launcher's tail when the log is
    gone and ``rank`` is the one that failed."""
    try:
        with open(result.log_path(rank), "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - max_bytes))
            return f.read().decode("utf-8", errors="replace")
    except OSError:
        return result.stderr_tail if rank == (result.failed_rank or 0) else ""
