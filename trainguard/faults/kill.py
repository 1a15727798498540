"""``kill_rank``: a rank dies by a signal right after step ``after_step``.

The real thing: :meth:`Launcher.kill_rank` sends the signal to the rank's own process (not its
process group), as the kernel's OOM killer, a node failure or a pre-empting scheduler would. The
launcher's watchdog sees the death within one poll interval and tears the group down.

A rank that runs behind the launched process (a Ray Train worker) is reached as the job's
backend says (:class:`~trainguard.launch.reach.RemoteRanks`): by its pid on this machine, or --
on a cluster at ``RAY_ADDRESS``, or with ``TRAINGUARD_RAY_SIGNALS=api`` -- through Ray: found in
Ray Train's state by world rank, signalled by a task pinned to its node; the evidence's ``via``
says which (``pid`` / ``ray_api``).
"""

from __future__ import annotations

import signal
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from trainguard.config.fault_params import FaultParams
from trainguard.evidence import UNSET, Unset
from trainguard.faults.base import Fault, FaultEvidence
from trainguard.launch.reach import RemoteRanks, WorkerNotHere

if TYPE_CHECKING:  # pragma: no cover
    from trainguard.launch import Launcher, RunResult

__all__ = ["KILL_SIGNALS", "KillEvidence", "KillRankFault"]

#: signals a kill_rank drill may send: SIGKILL (a hard death: nothing runs in the rank),
#: SIGTERM (a scheduler's polite stop), SIGINT (Ctrl-C: KeyboardInterrupt in Python)
KILL_SIGNALS = ("SIGKILL", "SIGTERM", "SIGINT")


@dataclass
class KillEvidence(FaultEvidence):
    """What a ``kill_rank`` fault sent, to which process, and how it got there."""

    signal: str
    pid: int | None
    sent: bool
    #: the target was a Ray Train worker (a ray_train job)
    ray_worker: bool
    #: how the signal reached it: "pid" or "ray_api"
    via: str | None
    #: what the task pinned to the worker's node saw (the ray_api path only)
    ray_api: dict[str, Any] | Unset = UNSET


class KillRankFault(Fault):
    """Send ``signal`` (default SIGKILL) to rank ``rank`` after step ``after_step``."""

    kind: ClassVar[str] = "kill_rank"
    defaults: ClassVar[FaultParams] = FaultParams({"signal": "SIGKILL"})

    def __init__(self, params: FaultParams | None = None, **kwargs: Any) -> None:
        super().__init__(params, **kwargs)
        self.pid: int | None = None
        self.sent: str | None = None
        self.ray_worker = False  # the target was a Ray Train worker (a ray_train job)
        self.via: str | None = None  # how the signal reached it: "pid" or "ray_api"
        self.ray_api: dict[str, Any] = {}  # what the pinned task saw (the ray_api path)

    @classmethod
    def validate(cls, params: FaultParams) -> list[tuple[str, str]]:
        problems = super().validate(params)
        sig = params.raw("signal", "SIGKILL")
        if sig not in KILL_SIGNALS:
            problems.append(
                ("signal", f"expected one of {', '.join(KILL_SIGNALS)}, got {sig!r}; "
                 "e.g. `params: {signal: SIGTERM}`")
            )
        return problems

    @property
    def signal(self) -> signal.Signals:
        return signal.Signals[self.params.text("signal")]

    def inject(self, launcher: Launcher) -> None:
        self.ray_worker = isinstance(launcher, RemoteRanks)
        if isinstance(launcher, RemoteRanks) and launcher.via_api:
            self.via = "ray_api"
            self.ray_api = launcher.signal_rank(self.rank, self.signal)
            self.pid = self.ray_api["pid"]
            if not self.ray_api.get("sent"):
                raise WorkerNotHere(f"the Ray worker of rank {self.rank} was not signalled: "
                                    f"{self.ray_api.get('why')}")
            self.sent = self.signal.name
            return
        self.via = "pid"
        self.pid = launcher.ranks[self.rank].pid
        launcher.kill_rank(self.rank, self.signal)
        self.sent = self.signal.name

    def no_effect(self, first: RunResult, steps: int, metric: str) -> str:
        """The rank was signalled, yet exited 0 after printing the run's last step: it caught or
        ignored the signal (a shell's background job starts with SIGINT ignored, and its
        children inherit that), so no death was tested. A rank that exited 0 early (a SIGTERM
        handler that saves and stops) did react, and is judged by the expectation."""
        if self.sent is None or self.ray_worker:  # Ray Train restarts a worker group inside one fit
            return ""
        exit_ = next((e for e in first.exits if e.rank == self.rank), None)
        last = max((p.step for p in first.points if p.rank == self.rank and p.name == metric), default=None)
        if exit_ is None or exit_.returncode != 0 or exit_.signal or last is None or last < steps:
            return ""
        return (f"rank {self.rank} was sent {self.sent} after step {self.after_step} and went on to its last "
                f"step ({last}) and exit code 0: the signal was caught or ignored, so no death was tested "
                "(does the job install a handler for it? a shell's background job starts with SIGINT "
                "ignored); use signal SIGKILL, or a signal the job does not handle")

    def evidence(self) -> KillEvidence:
        return KillEvidence(*self.struck(), signal=self.params.text("signal"), pid=self.pid,
                            sent=self.sent is not None, ray_worker=self.ray_worker, via=self.via,
                            ray_api=self.ray_api or UNSET)

    def classify(self, result: RunResult) -> str:
        if self.ray_worker:
            how = (f"the Ray worker of rank {self.rank} (pid {self.pid}) died of the injected "
                   f"{self.params.text('signal')}")
            return f"{how}; the fit completed" if result.ok else \
                f"{how}; the fit failed ({result.reason or result.outcome})"
        if result.failed_rank == self.rank:
            return f"rank {self.rank} died of the injected {self.params.text('signal')} ({result.reason})"
        return super().classify(result)
