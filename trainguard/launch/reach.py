"""How a drill's fault reaches a job's ranks, and how a failed attempt is restarted: what a
:class:`~trainguard.launch.backend.JobBackend` returns to the drill driver, so that the driver
and the faults ask the same questions of every backend (docs/backends.md).

* :class:`RankReach` (:meth:`JobBackend.fault_reach`, one per drill): what the launch needs
  (environment, ``preexec``), what :meth:`Fault.inject <trainguard.faults.base.Fault.inject>`
  gets as its launcher (the launcher itself when the ranks are its children; a view whose
  ``ranks`` are the processes that run the ranks elsewhere, a :class:`RemoteRanks` when they are
  reached through the backend's API), and a :class:`RankWatch` of the processes that run the
  ranks (who started after the fault: a restart inside the launch);
* :class:`Restarts` (:meth:`JobBackend.drill_restarts`): who restarts a failed attempt.

The command backend's forms are :class:`ChildRanks` and :class:`NoWatch`; the Ray Train
backend's live in :mod:`trainguard.raytrain.reach`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from trainguard.evidence import Evidence

if TYPE_CHECKING:  # pragma: no cover
    from trainguard.launch.launcher import Launcher

__all__ = [
    "ChildRanks",
    "NoWatch",
    "RankReach",
    "RankWatch",
    "ReachClient",
    "RemoteRanks",
    "Restarts",
    "WorkerNotHere",
    "WorkerSighting",
]


@dataclass
class ReachClient(Evidence):
    """The client a reach started to act on the ranks through its backend's API (Ray's: the
    drill report's ``ray_api``): how long it took to connect, and whether signals still go to
    the ranks' pids (False: through the API)."""

    agent_start_s: float
    pid_path: bool


class WorkerNotHere(OSError):
    """The process that runs a rank cannot be reached from this machine (the message says why)."""


@dataclass(frozen=True)
class WorkerSighting:
    """A process that runs world rank ``rank`` started (as the launch's output announced it)."""

    rank: int
    pid: int
    node: str | None
    t: float  # launcher elapsed seconds when trainguard read the announcement
    #: the backend's id of the node (Ray's node id: the nodes of one machine share ``node``, an IP)
    node_id: str | None = None


class RankWatch(Protocol):
    """The processes that run a launch's ranks, as they start (attempt 0 of a drill run): after a
    restart inside the launch, new ones. Every method reads what came since its last call."""

    def poll(self) -> list[WorkerSighting]:
        """Read what came since the last call; the new sightings."""
        ...

    def pids(self) -> dict[int, int]:
        """The latest pid of every rank seen."""
        ...

    def started_after(self, t: float, rank: int | None = None) -> list[WorkerSighting]:
        """Processes (of ``rank``, or all) seen after launcher elapsed time ``t``."""
        ...

    def controller_after(self, t: float, contains: str = "") -> tuple[float, str] | None:
        """The first line of what restarts the ranks read after ``t`` (containing ``contains``)."""
        ...

    def restart_notice_after(self, t: float) -> tuple[float, str] | None:
        """Its notice that it starts the ranks again, read after ``t``."""
        ...


class NoWatch:
    """The :class:`RankWatch` of ranks that are the launched processes: nothing starts behind
    the launcher, so it sees nothing."""

    def poll(self) -> list[WorkerSighting]:
        return []

    def pids(self) -> dict[int, int]:
        return {}

    def started_after(self, t: float, rank: int | None = None) -> list[WorkerSighting]:
        return []

    def controller_after(self, t: float, contains: str = "") -> tuple[float, str] | None:
        return None

    def restart_notice_after(self, t: float) -> tuple[float, str] | None:
        return None


@runtime_checkable
class RemoteRanks(Protocol):
    """The launcher a fault's :meth:`inject` gets when the ranks run elsewhere: besides the
    launcher's own ``ranks``/``kill_rank`` (by pid, on this machine), the rank's process reached
    through the backend's API. ``via_api``: the pid path is off, every signal goes that way."""

    via_api: bool

    def signal_rank(self, rank: int, sig: int) -> dict[str, Any]:
        """Find the process of ``rank`` and send it ``sig``; what was done (``sent``, ``pid``,
        ``why`` when nothing was sent)."""
        ...

    def find(self, rank: int) -> Any:
        """The process of ``rank`` as a target (its ``pid``), for :meth:`signal_target`."""
        ...

    def signal_target(self, target: Any, sig: int) -> dict[str, Any]:
        """Send ``sig`` to a target :meth:`find` returned."""
        ...

    def stop_node_of(self, rank: int, sig: int) -> dict[str, Any]:
        """Stop the node that runs ``rank``'s process; what was done (WorkerNotHere when refused)."""
        ...

    def restart_lost_nodes(self, wait_s: float) -> list[str]:
        """Start again the nodes lost meanwhile, where trainguard started them; their names."""
        ...


class RankReach(Protocol):
    """How the fault of one drill run reaches its ranks (:meth:`JobBackend.fault_reach`)."""

    def open(self) -> ReachClient | None:
        """Start what reaching the ranks needs (a client of the backend's API); its record for
        the drill's report (None: none started). Raises WorkerNotHere with the whole message when it
        cannot. Paired with :meth:`close`."""
        ...

    def launch_env(self) -> dict[str, str]:
        """Environment the drill's launches need for it."""
        ...

    def preexec(self, hook: Callable[[int], None]) -> Callable[[int], None] | None:
        """``hook`` (the fault's :meth:`preexec`) when it runs in the ranks' own processes, else None."""
        ...

    def watch(self, launcher: Launcher) -> RankWatch:
        """The watch of attempt 0's rank processes (made on the first call, the same after)."""
        ...

    def ready(self, launcher: Launcher, rank: int) -> None:
        """The ranks train (attempt 0 printed the progress metric): look ``rank`` up now, so the
        fault lands right after its step. Returns at once."""
        ...

    def target(self, launcher: Launcher) -> Launcher:
        """What :meth:`Fault.inject` gets: ``launcher``, or a view whose ranks are the processes
        that run them (a :class:`RemoteRanks`)."""
        ...

    def outlives_attempt(self) -> bool:
        """The ranks' processes are not ended by the launcher's teardown: a fault holding one (a
        stopped process) is cleared as soon as the attempt's launched processes ended."""
        ...

    def close(self) -> None:
        """Stop what :meth:`open` started. Idempotent."""
        ...


class ChildRanks:
    """The :class:`RankReach` of ranks that are the launcher's children: the fault gets the
    launcher, its ``preexec`` runs in each rank, the launcher's teardown ends them."""

    def __init__(self) -> None:
        self._watch = NoWatch()

    def open(self) -> ReachClient | None:
        return None

    def launch_env(self) -> dict[str, str]:
        return {}

    def preexec(self, hook: Callable[[int], None]) -> Callable[[int], None] | None:
        return hook

    def watch(self, launcher: Launcher) -> RankWatch:
        return self._watch

    def ready(self, launcher: Launcher, rank: int) -> None:
        pass

    def target(self, launcher: Launcher) -> Launcher:
        return launcher

    def outlives_attempt(self) -> bool:
        return False

    def close(self) -> None:
        pass


@dataclass(frozen=True)
class Restarts:
    """Who restarts a drill run's failed attempt (:meth:`JobBackend.drill_restarts`)."""

    #: how many times trainguard relaunches the group after a failed attempt
    relaunches: int
    #: the backend restarts the failed ranks inside the launch itself (its own machinery): the
    #: ``recover`` verdict reads that restart from the :class:`RankWatch`, not from a new attempt
    in_launch: bool = False
