"""The in-process half of trainguard's stall attribution: what a rank says when its job stalls.

Loaded by ``_trainguard_run_agent`` (by file path, standard library only) when its spec has
``stall_dir``. Once the job imports ``torch.distributed``, a daemon thread waits for the trigger
file ``{stall_dir}/trigger`` (the launcher's stall watchdog creates it when it calls the run hung;
the thread looks every 0.1 s; it says it is there with ``{stall_dir}/rank{RANK}.ready``) and then writes ``{stall_dir}/rank{RANK}.json`` once:

* ``fr``: PyTorch's Flight Recorder of this process (``_dump_fr_trace_json``: each collective of
  each process group with its sequence number, op, sizes and whether it completed; recorded when
  ``TORCH_FR_BUFFER_SIZE`` is set, which trainguard sets for the ranks it hooks), or ``fr_error``;
* ``main_stack``: the main thread's Python frames (innermost last), from ``sys._current_frames``;
* ``dataloader``: when the main thread waits in a DataLoader's ``__next__`` for a worker's batch,
  that worker's id and pid.

A rank that cannot answer (stopped, or a C call holding the GIL) writes nothing: its silence is
evidence too. A process that never joined a process group (a DataLoader worker started by
spawn) writes nothing. The file is written whole (a temporary file renamed), so a reader never
sees half of it.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
from typing import Any

_POLL_S = 0.1
#: the most frames of the main thread written
_MAX_FRAMES = 60


class StallAgent:
    """Waits (in a daemon thread, started once ``torch.distributed`` is imported) for the trigger
    file, then writes this rank's answer."""

    def __init__(self, agent: Any, spec: dict[str, Any]) -> None:
        self.agent = agent
        self.directory = str(spec["stall_dir"])
        self.trigger = os.path.join(self.directory, "trigger")
        self.rank = os.environ.get("RANK", "0")
        self._started = False

    def patches(self) -> dict[str, Any]:
        """The module whose import starts the thread."""
        return {"torch.distributed": self._start}

    def _start(self, _module: Any) -> None:
        if self._started:
            return
        self._started = True
        # the launcher waits at a stall only for the ranks that can answer
        os.makedirs(self.directory, exist_ok=True)
        with open(os.path.join(self.directory, f"rank{self.rank}.ready"), "w"):
            pass
        pid = os.getpid()
        thread = threading.Thread(target=self._wait, args=(pid,), name="trainguard-stall", daemon=True)
        thread.start()

    def _wait(self, pid: int) -> None:
        while not os.path.exists(self.trigger):
            if os.getpid() != pid:
                return  # pragma: no cover -- a forked child has no copy of this thread anyway
            time.sleep(_POLL_S)
        self.agent.guard("answering trainguard's stall watchdog", self.answer)

    def answer(self) -> None:
        """Write this rank's answer (once), when it is in a process group."""
        dist = sys.modules.get("torch.distributed")
        if dist is None or not dist.is_available() or not dist.is_initialized():
            return
        main = threading.main_thread().ident
        frame = sys._current_frames().get(main) if main is not None else None
        record: dict[str, Any] = {"rank": int(self.rank), "pid": os.getpid(), "time": time.time(),
                                  "main_stack": _frames(frame)}
        try:
            raw = sys.modules["torch"]._C._distributed_c10d._dump_fr_trace_json(True, False)
            record["fr"] = json.loads(raw)
        except Exception as exc:
            record["fr_error"] = f"{type(exc).__name__}: {exc}"
        with contextlib.suppress(Exception):
            waiting = _dataloader_wait(frame)
            if waiting is not None:
                record["dataloader"] = waiting
        path = os.path.join(self.directory, f"rank{self.rank}.json")
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as handle:
            json.dump(record, handle, separators=(",", ":"), default=repr)
        os.replace(tmp, path)


def _frames(frame: Any) -> list[list[Any]]:
    """``[function, file, line]`` of each frame, outermost first (the innermost ``_MAX_FRAMES``)."""
    out: list[list[Any]] = []
    while frame is not None and len(out) < _MAX_FRAMES:
        code = frame.f_code
        out.append([code.co_name, code.co_filename, frame.f_lineno])
        frame = frame.f_back
    return out[::-1]


def _dataloader_wait(frame: Any) -> dict[str, Any] | None:
    """The worker a multi-process DataLoader iterator on the main thread's stack waits for."""
    while frame is not None:
        it: Any = frame.f_locals.get("self") if frame.f_code.co_name in ("_next_data", "__next__") else None
        info = getattr(it, "_task_info", None)
        if isinstance(info, dict) and hasattr(it, "_rcvd_idx"):
            task = info.get(it._rcvd_idx)
            if task and len(task) == 1:  # (worker_id,): asked, not yet received
                worker = int(task[0])
                workers = getattr(it, "_workers", [])
                pid = getattr(workers[worker], "pid", None) if worker < len(workers) else None
                alive = getattr(it, "_workers_status", [])
                return {"worker": worker, "pid": pid, "batch": int(it._rcvd_idx),
                        "worker_active": bool(alive[worker]) if worker < len(alive) else None}
            return None
        frame = frame.f_back
    return None


__all__ = ["StallAgent"]
