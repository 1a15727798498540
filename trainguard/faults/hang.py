"""``hang``: a rank stops making progress right after step ``after_step`` (SIGSTOP).

A SIGSTOPped rank is what a rank stuck in a collective looks like from outside: alive, holding
its sockets, printing nothing. Its peers block in their next collective. The launcher's stall
detection must notice (no metric line for ``stall_timeout``), dump every rank's stack (py-spy
``--nonblocking`` reads a stopped process) and tear the group down; a job with a collective
timeout fails by itself first. With ``duration`` the rank is continued (SIGCONT) after that
many seconds: a pause the job should ride out (``expect: continue``).

Nothing is left stopped: :meth:`clear` and :meth:`teardown` send SIGCONT, and the launcher's
teardown continues every process group it terminates.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

import psutil

from trainguard.faults.base import Fault

if TYPE_CHECKING:  # pragma: no cover
    from trainguard.launch import Launcher, RunResult

__all__ = ["HangFault"]


class HangFault(Fault):
    """SIGSTOP rank ``rank`` after step ``after_step``; SIGCONT on clear/teardown."""

    kind: ClassVar[str] = "hang"
    defaults: ClassVar[Mapping[str, Any]] = {}

    def __init__(self, params: Mapping[str, Any] | None = None, **kwargs: Any) -> None:
        super().__init__(params, **kwargs)
        self._proc: psutil.Process | None = None
        self.state_after: str | None = None

    def inject(self, launcher: Launcher) -> None:
        pid = launcher.ranks[self.rank].pid
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
        proc = self._proc
        if proc is None:
            return
        with contextlib.suppress(psutil.Error, ProcessLookupError):
            if proc.is_running():
                os.kill(proc.pid, signal.SIGCONT)

    def evidence(self) -> dict[str, Any]:
        return {**super().evidence(), "signal": "SIGSTOP",
                "pid": self._proc.pid if self._proc is not None else None,
                "state_after_stop": self.state_after}

    def classify(self, result: RunResult) -> str:
        if result.outcome == "hung":
            return f"trainguard's stall detection ended the hung group ({result.reason})"
        return super().classify(result)
