"""The in-process half of trainguard's straggler finding: each optimizer step's clocks.

Loaded by ``_trainguard_run_agent`` (by file path, standard library only) when its spec has
``pace_dir``. Once the job imports ``torch.optim.optimizer``, torch's global optimizer step
post-hook appends one line per optimizer step to ``{pace_dir}/rank{RANK}.txt``::

    <time.thread_time()> <run-queue wait> <time.monotonic()>

of the thread that stepped (the training thread), in seconds. The run-queue wait is the thread's
``run_delay`` from ``/proc/thread-self/schedstat`` (0 where there is none): a rank throttled by a
CPU quota (or starved by its neighbours) is runnable but not running, which its CPU time alone
cannot show; CPU time plus that wait is the time the rank wanted the CPU, while a rank waiting in
a collective is blocked and wants none. The reader (``trainguard.launch.pace``) takes differences
between consecutive lines.

Cheap: three clock reads (one ``pread`` of a file kept open) and a buffered write per step; the
buffer is written every ``_FLUSH_EVERY`` steps and at exit. Bounded: at most ``_MAX_LINES`` lines
per process. Every failure is reported once on stderr and never reaches the job.
"""

from __future__ import annotations

import atexit
import os
import threading
import time
from typing import Any

#: lines kept in the buffer before one write
_FLUSH_EVERY = 20
#: the most lines one process writes (about 40 bytes each)
_MAX_LINES = 50_000
_SCHEDSTAT = "/proc/thread-self/schedstat"


class PaceAgent:
    """Registers the optimizer step post-hook once ``torch.optim.optimizer`` is imported."""

    def __init__(self, agent: Any, spec: dict[str, Any]) -> None:
        self.agent = agent
        self.path = os.path.join(str(spec["pace_dir"]), f"rank{os.environ.get('RANK', '0')}.txt")
        self.lines: list[str] = []
        self.written = 0
        self.pid = os.getpid()
        self._local = threading.local()
        self._lock = threading.Lock()
        self._registered = False

    def patches(self) -> dict[str, Any]:
        """The module whose import registers the hook."""
        return {"torch.optim.optimizer": self._register}

    def _register(self, module: Any) -> None:
        if self._registered:
            return
        self._registered = True
        module.register_optimizer_step_post_hook(self._step)
        atexit.register(self.agent.guard, "writing the step clocks", self.flush)

    def _delay(self) -> float:
        """This thread's run-queue wait so far, in seconds (0 without schedstat)."""
        fd = getattr(self._local, "fd", None)
        if fd is None:
            try:
                fd = os.open(_SCHEDSTAT, os.O_RDONLY)
            except OSError:
                fd = -1
            self._local.fd = fd
        if fd < 0:
            return 0.0
        return int(os.pread(fd, 64, 0).split()[1]) / 1e9

    def _step(self, _optimizer: Any, _args: Any, _kwargs: Any) -> None:
        try:
            cpu = time.thread_time()
            delay = self._delay()
            wall = time.monotonic()
            self.lines.append(f"{cpu:.6f} {delay:.6f} {wall:.6f}\n")
            if len(self.lines) >= _FLUSH_EVERY:
                self.flush()
        except Exception as exc:
            self.agent.report("recording the step clocks", exc)

    def flush(self) -> None:
        """Write the buffered lines (the process that registered the hook only; bounded)."""
        with self._lock:
            lines, self.lines = self.lines, []
            if os.getpid() != self.pid or not lines:
                return  # a forked child's copy of the buffer is its parent's to write
            lines = lines[: max(0, _MAX_LINES - self.written)]
            if not lines:
                return
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            try:
                os.write(fd, "".join(lines).encode())
            finally:
                os.close(fd)
            self.written += len(lines)


__all__ = ["PaceAgent"]
