"""``hang``: a rank stops making progress right after step ``after_step`` (SIGSTOP).

A SIGSTOPped rank is what a rank stuck in a collective looks like from outside: alive, holding
its sockets, printing nothing. Its peers block in their next collective. The launcher's stall
detection must notice (no metric line for ``stall_timeout``), dump every rank's stack (py-spy
``--nonblocking`` reads a stopped process) and tear the group down; a job with a collective
timeout fails by itself first. With ``duration`` the rank is continued (SIGCONT) after that
many seconds: a pause the job should ride out (``expect: continue``).

Nothing is left stopped: :meth:`clear` and :meth:`teardown` send SIGCONT, and the launcher's
teardown continues every process group it terminates.

A Ray Train worker on a cluster (``RAY_ADDRESS``, or ``TRAINGUARD_RAY_SIGNALS=api``) is stopped and
continued through Ray: a task pinned to its node signals it (the launcher ``inject`` gets is then
a :class:`~trainguard.launch.reach.RemoteRanks`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import psutil

from trainguard.config.fault_params import FaultParams
from trainguard.evidence import UNSET, Unset
from trainguard.faults.base import Fault, FaultEvidence
from trainguard.launch.reach import RemoteRanks, WorkerNotHere
from trainguard.launch.stall_attribution import attribution_words

if TYPE_CHECKING:  # pragma: no cover
    from trainguard.launch import Launcher, RunResult

__all__ = ["HangEvidence", "HangFault"]


@dataclass
class HangEvidence(FaultEvidence):
    """What a ``hang`` fault stopped, and the state the process was in after the stop."""

    signal: str
    pid: int | None
    state_after_stop: str | None
    #: how the signal reached it: "pid" or "ray_api"
    via: str | None
    #: what the tasks pinned to the worker's node saw (the ray_api path only)
    ray_api: dict[str, Any] | Unset = UNSET


class HangFault(Fault):
    """SIGSTOP rank ``rank`` after step ``after_step``; SIGCONT on clear/teardown."""

    kind: ClassVar[str] = "hang"
    defaults: ClassVar[FaultParams] = FaultParams()

    def __init__(self, params: FaultParams | None = None, **kwargs: Any) -> None:
        super().__init__(params, **kwargs)
        self._proc: psutil.Process | None = None
        self.state_after: str | None = None
        self.pid: int | None = None
        self.via: str | None = None
        self.ray_api: dict[str, Any] = {}
        self._continue_ray: Callable[[], dict[str, Any]] | None = None

    def inject(self, launcher: Launcher) -> None:
        if isinstance(launcher, RemoteRanks) and launcher.via_api:
            self.via = "ray_api"
            target = launcher.find(self.rank)
            self.pid = target.pid
            self._continue_ray = lambda: launcher.signal_target(target, signal.SIGCONT)
            self.ray_api = launcher.signal_target(target, signal.SIGSTOP)
            state = self.ray_api.get("state_after")
            self.state_after = psutil.STATUS_STOPPED if state in ("T", "t") else state
            if not self.ray_api.get("sent"):
                raise WorkerNotHere(f"the Ray worker of rank {self.rank} was not stopped: "
                                    f"{self.ray_api.get('why')}")
            return
        self.via = "pid"
        pid = self.pid = launcher.ranks[self.rank].pid
        with contextlib.suppress(psutil.Error):
            self._proc = psutil.Process(pid)  # remembers its start time: no recycled-pid mix-up
        launcher.kill_rank(self.rank, signal.SIGSTOP)
        # evidence that the stop took: signal delivery is asynchronous, wait at most 0.1 s
        for _ in range(10):
            with contextlib.suppress(psutil.Error):
                if self._proc is not None:
                    self.state_after = self._proc.status()
            if self.state_after == psutil.STATUS_STOPPED:
                break
            time.sleep(0.01)

    def clear(self) -> None:
        self._continue()

    def teardown(self) -> None:
        self._continue()

    def _continue(self) -> None:
        resume, self._continue_ray = self._continue_ray, None
        if resume is not None:  # through Ray; a worker Ray already reaped has nothing to continue
            with contextlib.suppress(OSError):
                self.ray_api["continued"] = resume()
            return
        proc = self._proc
        if proc is None:
            return
        with contextlib.suppress(psutil.Error, ProcessLookupError):
            if proc.is_running():
                os.kill(proc.pid, signal.SIGCONT)

    def evidence(self) -> HangEvidence:
        return HangEvidence(*self.struck(), signal="SIGSTOP", pid=self.pid, state_after_stop=self.state_after,
                            via=self.via, ray_api=self.ray_api or UNSET)

    def classify(self, result: RunResult) -> str:
        if result.outcome == "hung":
            named = attribution_words(result.evidence.get("attribution"), "; {}")
            return f"trainguard's stall detection ended the hung group ({result.reason}){named}"
        return super().classify(result)
