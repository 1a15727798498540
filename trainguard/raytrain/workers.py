"""Ray Train workers as fault targets: a drill's ``rank`` of a ``kind: ray_train`` job.

trainguard launches one process for a Ray Train job, its driver; the job's ranks are Ray worker
processes, children of a raylet, not of the launched process. Every worker prints
``trainguard-worker rank=R pid=P node=IP`` to stderr when it starts
(:mod:`trainguard.raytrain.driver`), and Ray forwards it to the driver's stderr, which the
launcher logs. :class:`RayWorkerTracker` tails that log, stamping each worker line (and the
first Ray Train controller line after the fault) with the time trainguard read it; a worker
group Ray Train restarts prints new pids, so the latest pid of a rank is its live process.

:class:`RayWorkerLauncher` is what a fault's :meth:`~trainguard.faults.base.Fault.inject` sees
for such a job: the launcher, with ``ranks[R]`` the Ray worker of world rank R and
:meth:`~RayWorkerLauncher.kill_rank` signalling that worker's process. Two paths
(:func:`signal_path`):

* ``pid`` (trainguard's own one-node head): the pid from the worker line, signalled here; a
  worker on another node is refused with the reason;
* ``api`` (a cluster at ``RAY_ADDRESS``, or ``TRAINGUARD_RAY_SIGNALS=api``): the worker of world
  rank R is found in Ray Train's state and signalled by a task pinned to its node, through a
  :class:`~trainguard.raytrain.agent.RayAgent` -- trainguard needs to run only where the head is
  reachable. The pid path is then off: ``ranks[R].pid`` raises :class:`WorkerNotHere`, so a fault
  that only knows pids says so instead of acting on a local process.

docs/ray-train.md, "Drills on a cluster".
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict

import psutil

from trainguard._internal import envvars
from trainguard.launch.reach import WorkerNotHere, WorkerSighting
from trainguard.raytrain import WORKER_PREFIX, parse_worker_line

if TYPE_CHECKING:  # pragma: no cover
    from trainguard.launch import Launcher
    from trainguard.raytrain.agent import NodeEntry, RayAgent, TrainWorkers, WorkerEntry

__all__ = ["SIGNAL_PATH_ENV", "RayTarget", "RayWorkerLauncher", "RayWorkerTracker", "TargetEvidence", "signal_path"]

#: ``api`` / ``pid`` / ``auto`` (default): how a drill reaches a Ray Train worker
SIGNAL_PATH_ENV = envvars.RAY_SIGNALS
#: seconds a fault waits for Ray Train's state to record the worker group whose steps it saw (the
#: workers print before the controller marks their attempt RUNNING; under load that lag was long
#: enough to fail a drill); then the absence is an error. Below the agent's request timeout (60 s).
STATE_WAIT_S = 30.0


def signal_path(environ: dict[str, str] | None = None) -> str:
    """``api`` or ``pid``: ``TRAINGUARD_RAY_SIGNALS`` when it says which, else ``api`` for a
    cluster at ``RAY_ADDRESS`` (the workers may be on other nodes) and ``pid`` for trainguard's own
    one-node head. Raises ValueError naming the variable for another value."""
    env = os.environ if environ is None else environ
    value = env.get(SIGNAL_PATH_ENV, "auto").strip().lower() or "auto"
    if value not in ("auto", "api", "pid"):
        raise ValueError(f"{SIGNAL_PATH_ENV}={value!r}: expected api (through Ray's API), pid "
                         "(signal the worker's pid on this machine) or auto; unset it for auto")
    if value != "auto":
        return value
    address = env.get("RAY_ADDRESS", "").strip()
    return "api" if address and address not in ("local", "auto") else "pid"


class TargetEvidence(TypedDict):
    """A :class:`RayTarget` as a fault's evidence says it (``target``)."""

    world_rank: int
    actor_id: str
    node_id: str
    pid: int
    attempt_id: str
    actor_state: str | None


@dataclass(frozen=True)
class RayTarget:
    """The Ray Train worker of one world rank, as Ray Train's state lists it."""

    rank: int
    actor_id: str
    node_id: str
    pid: int
    node_ip: str = ""
    attempt_id: str = ""
    #: Ray core's state of the actor (``ray.util.state.get_actor``), when the dashboard answered
    actor_state: str | None = None

    def evidence(self) -> TargetEvidence:
        return {"world_rank": self.rank, "actor_id": self.actor_id, "node_id": self.node_id,
                "pid": self.pid, "attempt_id": self.attempt_id, "actor_state": self.actor_state}

#: the Ray Train controller's log lines, forwarded to the driver with this prefix
_CONTROLLER = "(TrainController"
_RESTARTING = "Attempting to start training worker group"


@dataclass
class RayWorkerTracker:
    """Reads the driver's stderr log incrementally: worker pids per rank, controller notices (a
    :class:`~trainguard.launch.reach.RankWatch`); a ``trainguard-worker`` line is a
    :class:`~trainguard.launch.reach.WorkerSighting`."""

    log: Path
    clock: Callable[[], float] = time.monotonic
    sightings: list[WorkerSighting] = field(default_factory=list)
    #: (elapsed, line) of Ray Train controller lines, each at most once
    controller_lines: list[tuple[float, str]] = field(default_factory=list)
    _offset: int = 0
    _partial: bytes = b""
    _seen: set[tuple[int, int]] = field(default_factory=set)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def poll(self) -> list[WorkerSighting]:
        """Read what the driver wrote since the last call; returns the new worker sightings."""
        with self._lock:
            try:
                with open(self.log, "rb") as handle:
                    handle.seek(self._offset)
                    data = handle.read()
            except OSError:
                return []
            if not data:
                return []
            self._offset += len(data)
            lines = (self._partial + data).split(b"\n")
            self._partial = lines.pop()
            now = self.clock()
            new: list[WorkerSighting] = []
            for raw in lines:
                line = raw.decode("utf-8", errors="replace")
                worker = parse_worker_line(line)
                if worker is not None:
                    if (worker.rank, worker.pid) not in self._seen:  # Ray may forward a line twice
                        self._seen.add((worker.rank, worker.pid))
                        new.append(WorkerSighting(worker.rank, worker.pid, worker.node, now, worker.node_id))
                elif line.lstrip().startswith(_CONTROLLER):
                    self.controller_lines.append((now, line.strip()))
            self.sightings.extend(new)
            return new

    def latest(self, rank: int) -> WorkerSighting | None:
        """The newest worker of ``rank`` (after a Ray Train restart: the new process)."""
        self.poll()
        with self._lock:
            return next((s for s in reversed(self.sightings) if s.rank == rank), None)

    def pids(self) -> dict[int, int]:
        """The latest pid of every rank seen."""
        self.poll()
        with self._lock:
            return {s.rank: s.pid for s in self.sightings}

    def started_after(self, t: float, rank: int | None = None) -> list[WorkerSighting]:
        """Workers (of ``rank``, or all) whose line was read after elapsed time ``t``."""
        self.poll()
        with self._lock:
            return [s for s in self.sightings if s.t > t and (rank is None or s.rank == rank)]

    def controller_after(self, t: float, contains: str = "") -> tuple[float, str] | None:
        """The first Ray Train controller line read after ``t`` (that contains ``contains``)."""
        self.poll()
        with self._lock:
            return next(((at, line) for at, line in self.controller_lines
                         if at > t and contains in line), None)

    def restart_notice_after(self, t: float) -> tuple[float, str] | None:
        """The controller's "Attempting to start training worker group" after ``t``."""
        return self.controller_after(t, _RESTARTING)


class _WorkerProcess:
    """The part of ``subprocess.Popen`` a fault and a drill use, for a process we did not start."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._proc: psutil.Process | None = None
        with contextlib.suppress(psutil.Error):
            self._proc = psutil.Process(pid)  # remembers its start time: no recycled-pid mix-up

    def poll(self) -> int | None:
        """None while the worker runs; else -9 (its exit status belongs to the raylet)."""
        if self.returncode is None:
            alive = False
            with contextlib.suppress(psutil.Error):
                alive = (self._proc is not None and self._proc.is_running()
                         and self._proc.status() != psutil.STATUS_ZOMBIE)
            if not alive:
                self.returncode = -signal.SIGKILL
        return self.returncode


class _WorkerRank:
    """``launcher.ranks[R]`` of a Ray Train job: the Ray worker of world rank R. Its ``pid`` (and
    ``popen``) exist only for a worker on this machine: a pid from another node would name an
    unrelated local process, so reading it raises :class:`WorkerNotHere` instead."""

    def __init__(self, rank: int, pid: int, node: str | None, stderr_log: Path,
                 pid_path: bool = True) -> None:
        self.rank = rank
        self.node = node
        self.stderr_log = stderr_log
        self._pid = pid
        self._pid_path = pid_path
        self._popen: _WorkerProcess | None = None

    @property
    def pid(self) -> int:
        if not self._pid_path:
            raise WorkerNotHere(
                f"the pid path is off ({SIGNAL_PATH_ENV}=api, or a cluster at RAY_ADDRESS): "
                f"trainguard reaches the Ray worker of rank {self.rank} only through Ray's API, "
                "and this fault acts on a local pid"
            )
        ensure_local(self._pid, self.node, self.rank)
        return self._pid

    @property
    def popen(self) -> _WorkerProcess:
        if self._popen is None:
            self._popen = _WorkerProcess(self.pid)
        return self._popen


class RayWorkerLauncher:
    """The launcher as a fault sees it for a Ray Train job: its ranks are the Ray workers (a
    :class:`~trainguard.launch.reach.RemoteRanks`).

    Everything else (``elapsed``, ``spec``, ``stop``, ...) is the real launcher's.
    """

    def __init__(self, launcher: Launcher, tracker: RayWorkerTracker, world_size: int, *,
                 agent: RayAgent | None = None, run_name: str = "", via_api: bool = False) -> None:
        self._launcher = launcher
        self.tracker = tracker
        self.world_size = world_size
        self.agent = agent
        self.run_name = run_name
        #: the pid path is off: every signal goes through Ray (:meth:`signal_rank`)
        self.via_api = via_api and agent is not None
        self._found: dict[int, tuple[RayTarget, list[WorkerEntry]]] = {}
        self._nodes: list[NodeEntry] | None = None
        #: how each target was found: "state" (asked at the fault) or "prefetched"
        self.lookups: list[str] = []
        self._prefetch_started = False
        self._prefetched = threading.Event()

    def prefetch(self, rank: int) -> None:
        """Read rank ``rank``'s worker and the nodes from Ray's state now (before the fault), so
        that the fault lands right after its step; :meth:`find` uses it while the worker line of
        ``rank`` still names the same process. Never raises."""
        self._prefetch_started = True
        try:
            # best effort on its own thread (a failure here is a lookup at the fault instead):
            # RayAgentError, WorkerNotHere, a node that died meanwhile
            with contextlib.suppress(Exception):
                self._found[rank] = found = self._lookup(rank)
                self._nodes = self._agent().request("nodes")
                self._agent().request("warm", node_id=found[0].node_id)  # its actor, started now
        finally:
            self._prefetched.set()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._launcher, name)

    @property
    def ranks(self) -> list[_WorkerRank]:
        """The latest worker of every rank 0..world_size-1 (WorkerNotHere when one is unknown)."""
        out = []
        for rank in range(self.world_size):
            seen = self.tracker.latest(rank)
            if seen is None:
                raise WorkerNotHere(
                    f"no `{WORKER_PREFIX} rank={rank}` line in the driver's stderr "
                    f"({self.tracker.log}): the Ray worker of rank {rank} has not started, or its "
                    "output does not reach the driver (ray.init(log_to_driver=True))"
                )
            out.append(_WorkerRank(rank, seen.pid, seen.node, self._launcher.ranks[0].stderr_log,
                                   pid_path=not self.via_api))
        return out

    def kill_rank(self, rank: int, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to the Ray worker process of world rank ``rank`` (through Ray when the
        pid path is off)."""
        if self.via_api:
            self.signal_rank(rank, sig)
            return
        worker = self.ranks[rank]
        if worker.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker.pid, sig)

    def _agent(self) -> RayAgent:
        if self.agent is None:
            raise WorkerNotHere("no Ray agent: this drill reaches Ray workers by pid only")
        return self.agent

    def find(self, rank: int) -> RayTarget:
        """The worker of world rank ``rank`` in the newest running attempt of this job's Train
        run, from Ray Train's state (WorkerNotHere when the state has none)."""
        return self._find(rank)[0]

    def _find(self, rank: int) -> tuple[RayTarget, list[WorkerEntry]]:
        if self._prefetch_started:  # a lookup in flight: its answer comes no later than a new one
            self._prefetched.wait(timeout=STATE_WAIT_S + 15)
        found = self._found.get(rank)
        seen = self.tracker.latest(rank)
        if found is not None and seen is not None and seen.pid == found[0].pid:
            self.lookups.append("prefetched")
            return found
        self.lookups.append("state")
        self._nodes = None  # the group changed since the prefetch: the nodes may have too
        return self._lookup(rank)

    def _lookup(self, rank: int) -> tuple[RayTarget, list[WorkerEntry]]:
        from trainguard.raytrain.agent import RayAgentError

        try:
            # the process that printed the rank's steps: the state's group must hold it
            seen = self.tracker.latest(rank)
            found: TrainWorkers = self._agent().request("workers", run_name=self.run_name, rank=rank,
                                          pid=None if seen is None else seen.pid, wait_s=STATE_WAIT_S)
        except RayAgentError as exc:
            raise WorkerNotHere(f"Ray's state has no worker of rank {rank}: {exc}") from None
        for w in found["workers"]:
            if w["world_rank"] == rank:
                return RayTarget(rank, w["actor_id"], w["node_id"], int(w["pid"]), w.get("node_ip", ""),
                                 found["attempt_id"], w.get("actor_state")), found["workers"]
        raise WorkerNotHere(f"the running Train attempt {found['attempt_id']} has no world rank {rank} "
                            f"(ranks {[w['world_rank'] for w in found['workers']]})")

    def signal_target(self, target: RayTarget, sig: int) -> dict[str, Any]:
        """Send ``sig`` to ``target``'s process by a task pinned to its node; what the task saw
        (``sent``, ``state_after``, ``why`` when nothing was sent)."""
        from trainguard.raytrain.agent import RayAgentError

        t0 = time.monotonic()
        try:
            done = self._agent().request("signal", node_id=target.node_id, pid=target.pid, signal=int(sig))
        except RayAgentError as exc:
            raise WorkerNotHere(f"the signal task on node {target.node_id[:12]} failed: {exc}") from None
        return {**done, "via": "ray_api", "target": target.evidence(),
                "signal": signal.Signals(sig).name, "took_s": round(time.monotonic() - t0, 3)}

    def signal_rank(self, rank: int, sig: int) -> dict[str, Any]:
        """:meth:`find` the worker of ``rank``, then :meth:`signal_target` it."""
        t0 = time.monotonic()
        target = self.find(rank)
        found_s = time.monotonic() - t0
        return {**self.signal_target(target, sig), "lookup_s": round(found_s, 3),
                "lookup": self.lookups[-1]}

    def restart_lost_nodes(self, wait_s: float) -> list[str]:
        """Restart the nodes lost meanwhile of a :class:`~trainguard.raytrain.cluster.LocalRayCluster`
        this process started (nothing on a real cluster: its autoscaler or an operator does)."""
        from trainguard.raytrain.cluster import restart_lost_nodes

        return restart_lost_nodes(wait_s=wait_s)

    def stop_node_of(self, rank: int, sig: int = signal.SIGKILL) -> dict[str, Any]:
        """Stop the node that runs the worker of ``rank``: a task pinned to it kills its raylet.
        Refused for the head node (losing it loses the cluster)."""
        from trainguard.raytrain.agent import RayAgentError

        t0 = time.monotonic()
        target, workers = self._find(rank)
        listed: list[NodeEntry] = self._nodes or self._agent().request("nodes")
        node = {n["node_id"]: n for n in listed}.get(target.node_id)
        if node is not None and node["head"]:
            raise WorkerNotHere(
                f"the Ray worker of rank {rank} runs on the head node {target.node_id[:12]}: losing "
                "the head loses the cluster (GCS, driver, controller); node_loss needs worker nodes "
                "(a multi-node cluster at RAY_ADDRESS, or trainguard.raytrain.cluster.LocalRayCluster)"
            )
        try:
            done = self._agent().request("stop_node", node_id=target.node_id, signal=int(sig), delay=0.3)
        except RayAgentError as exc:
            raise WorkerNotHere(f"the task that stops node {target.node_id[:12]} failed: {exc}") from None
        if not done.get("sent"):
            raise WorkerNotHere(f"node {target.node_id[:12]} was not stopped: {done.get('why')}")
        others = [w for w in workers if w["node_id"] == target.node_id]
        return {**done, "via": "ray_api", "target": target.evidence(), "signal": signal.Signals(sig).name,
                "node_resources": {} if node is None else node["resources"],
                "ranks_on_node": sorted(w["world_rank"] for w in others),
                "took_s": round(time.monotonic() - t0, 3), "lookup": self.lookups[-1]}


def local_addresses() -> set[str]:
    """This machine's IP addresses and names (a worker line's ``node=`` is compared with them)."""
    found = {"127.0.0.1", "::1", "localhost", socket.gethostname()}
    with contextlib.suppress(OSError):
        for addresses in psutil.net_if_addrs().values():
            found.update(a.address.split("%")[0] for a in addresses)
    return found


def ensure_local(pid: int, node: str | None, rank: int) -> None:
    """Raise :class:`WorkerNotHere` unless ``pid`` is a live Ray worker process on this machine."""
    where = f"pid {pid}" + (f" on node {node}" if node else "")
    if node is not None and node not in local_addresses():
        raise WorkerNotHere(
            f"the Ray worker of rank {rank} ({where}) runs on another node: trainguard can "
            "signal only processes on its own machine. Reach it through Ray's API instead "
            "(TRAINGUARD_RAY_SIGNALS=api), or run the drill where the workers run; see "
            "docs/ray-train.md, \"Drills on a cluster\""
        )
    try:
        name = _command_line(psutil.Process(pid))
    except psutil.Error:
        return  # exited meanwhile: the signal is a no-op, the drill reports what followed
    if name is None:
        return  # a zombie: it exited meanwhile, as above
    if "ray::" not in name and "default_worker" not in name:
        raise WorkerNotHere(
            f"pid {pid} of rank {rank} is not a Ray worker process here ({name[:80]!r}): the "
            "worker runs on another machine or in another pid namespace (a container)"
        )


def _command_line(proc: psutil.Process, wait_s: float = 2.0) -> str | None:
    """The process's command line; None for a zombie. A process in the middle of ``exec`` reads
    as an empty command line for a moment, so an empty one is read again for up to ``wait_s``."""
    deadline = time.monotonic() + wait_s
    while True:
        name = " ".join(proc.cmdline())
        if name:
            return name
        if proc.status() == psutil.STATUS_ZOMBIE:
            return None
        if time.monotonic() >= deadline:
            return name
        time.sleep(0.02)
