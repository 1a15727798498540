"""``kill_worker``: a DataLoader worker of rank ``rank`` dies by a signal after step ``after_step``.

Data-loading workers are child processes of a rank (PyTorch's DataLoader with ``num_workers >
0``); the kernel's OOM killer picks them often, since they hold copies of the dataset. The rank
itself is still alive, so nothing outside it notices: the job must notice by itself. PyTorch's
DataLoader raises ``RuntimeError: DataLoader worker (pid(s) ...) exited unexpectedly`` in the
rank within a second or two; a loader of its own that waits on a queue without a timeout or a
liveness check hangs forever. The default expectation is ``fail_clean``: exit with an error,
checkpoint intact (``recover`` proves the restart too).
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import psutil

from trainguard.config.fault_params import FaultParams
from trainguard.config.faults import Expectation
from trainguard.faults.base import Fault, FaultContext, FaultEvidence
from trainguard.faults.kill import KILL_SIGNALS

if TYPE_CHECKING:  # pragma: no cover
    from trainguard.launch import Launcher, RunResult
    from trainguard.launch.backend import JobBackend

__all__ = ["KillWorkerEvidence", "KillWorkerFault"]

#: how long inject() looks for a worker (one may be between two epochs' loaders)
_FIND_S = 1.0


@dataclass
class KillWorkerEvidence(FaultEvidence):
    """The DataLoader worker a ``kill_worker`` fault signalled: which, its process, and how many
    workers the rank had."""

    signal: str
    worker: int
    worker_pid: int | None
    worker_cmdline: str | None
    workers_seen: int


class KillWorkerFault(Fault):
    """Send ``signal`` (default SIGKILL) to the ``worker``-th child process of rank ``rank``."""

    kind: ClassVar[str] = "kill_worker"
    expectations: ClassVar[tuple[Expectation, ...]] = (Expectation.FAIL_CLEAN, Expectation.RECOVER, Expectation.CONTINUE)
    defaults: ClassVar[FaultParams] = FaultParams({"signal": "SIGKILL", "worker": 0})

    def __init__(self, params: FaultParams | None = None, **kwargs: Any) -> None:
        super().__init__(params, **kwargs)
        self.pid: int | None = None
        self.cmdline: str | None = None
        self.workers_seen = 0

    @classmethod
    def validate(cls, params: FaultParams) -> list[tuple[str, str]]:
        problems = super().validate(params)
        sig = params.raw("signal", "SIGKILL")
        if sig not in KILL_SIGNALS:
            problems.append(("signal", f"expected one of {', '.join(KILL_SIGNALS)}, got {str(sig)[:40]!r}"))
        worker = params.raw("worker", 0)
        if isinstance(worker, bool) or not isinstance(worker, int) or not 0 <= worker < 1024:
            problems.append(("worker", f"expected the index of the worker among the rank's child processes "
                             f"(0 = the oldest), 0 to 1023, got {str(worker)[:40]!r}"))
        return problems

    @classmethod
    def unavailable_for(cls, backend: JobBackend) -> str | None:
        return None if backend.ranks_are_children() else (
            "kill_worker finds a rank's DataLoader workers among the children of the rank's process; "
            "a ray_train job's workers are Ray actors (use kill_rank)")

    def setup(self, ctx: FaultContext) -> None:
        self.require_job_kind(ctx)

    def inject(self, launcher: Launcher) -> None:
        rank_pid = launcher.ranks[self.rank].pid
        index = self.params.integer("worker")
        deadline = time.monotonic() + _FIND_S
        while True:  # a loader between two epochs: its workers go and new ones come
            try:
                children = sorted(psutil.Process(rank_pid).children(recursive=False),
                                  key=lambda p: (p.create_time(), p.pid))
            except psutil.Error:
                children = []
            self.workers_seen = max(self.workers_seen, len(children))
            if len(children) > index:
                target = children[index]
                try:
                    self.cmdline = " ".join(target.cmdline())[:200]
                    target.send_signal(signal.Signals[self.params.text("signal")])
                    self.pid = target.pid
                    return
                except psutil.NoSuchProcess:
                    pass  # it ended between the listing and the signal: look again
            if time.monotonic() > deadline:
                raise RuntimeError(f"rank {self.rank} (pid {rank_pid}) had {self.workers_seen} child "
                                   f"process(es) at most in {_FIND_S:g} s, so there was no worker {index} "
                                   "to kill: DataLoader workers need num_workers > 0")
            time.sleep(0.02)

    def evidence(self) -> KillWorkerEvidence:
        return KillWorkerEvidence(*self.struck(), signal=self.params.text("signal"), worker=self.params.integer("worker"),
                                  worker_pid=self.pid, worker_cmdline=self.cmdline, workers_seen=self.workers_seen)

    def likely_causes(self, result: RunResult) -> list[str]:
        if result.ok:
            return ["the worker's death was caught and ignored: the loader restarted it or skipped its "
                    "batches, and the job went on without part of its data"]
        if result.outcome in ("hung", "stopped", "timeout"):  # stopped: at the drill's deadline
            return ["the loader waits for the dead worker's batch without a timeout or a liveness check "
                    "(a queue.get() with no timeout; PyTorch's DataLoader checks and raises: use it, or "
                    "poll the worker with is_alive())"]
        return []

    def classify(self, result: RunResult) -> str:
        what = f"DataLoader worker {self.params.integer('worker')} of rank {self.rank} (pid {self.pid}) was killed"
        if result.outcome == "hung":
            return f"{what}, and the rank then hung ({result.reason}): it waits for the dead worker's batch"
        if result.failed_rank == self.rank:
            return f"{what}; rank {self.rank} failed ({result.reason})"
        return f"{what}; {super().classify(result)}"
