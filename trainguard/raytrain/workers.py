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
:meth:`~RayWorkerLauncher.kill_rank` signalling that worker's process. Signals need the worker
on this machine: a worker on another node of a real cluster (``RAY_ADDRESS``) is refused with
the reason (docs/ray-train.md, "Drills on a staging cluster").
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
from typing import TYPE_CHECKING, Any

import psutil

from trainguard.raytrain import WORKER_PREFIX, parse_worker_line

if TYPE_CHECKING:  # pragma: no cover
    from trainguard.launch import Launcher

__all__ = ["RayWorkerLauncher", "RayWorkerTracker", "WorkerNotHere", "WorkerSighting"]

#: the Ray Train controller's log lines, forwarded to the driver with this prefix
_CONTROLLER = "(TrainController"
_RESTARTING = "Attempting to start training worker group"


class WorkerNotHere(OSError):
    """The Ray worker of a rank cannot be signalled from this machine (the message says why)."""


@dataclass(frozen=True)
class WorkerSighting:
    """One ``trainguard-worker`` line: a worker process of world rank ``rank`` started."""

    rank: int
    pid: int
    node: str | None
    t: float  # launcher elapsed seconds when trainguard read the line


@dataclass
class RayWorkerTracker:
    """Reads the driver's stderr log incrementally: worker pids per rank, controller notices."""

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
                        new.append(WorkerSighting(worker.rank, worker.pid, worker.node, now))
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

    def __init__(self, rank: int, pid: int, node: str | None, stderr_log: Path) -> None:
        self.rank = rank
        self.node = node
        self.stderr_log = stderr_log
        self._pid = pid
        self._popen: _WorkerProcess | None = None

    @property
    def pid(self) -> int:
        ensure_local(self._pid, self.node, self.rank)
        return self._pid

    @property
    def popen(self) -> _WorkerProcess:
        if self._popen is None:
            self._popen = _WorkerProcess(self.pid)
        return self._popen


class RayWorkerLauncher:
    """The launcher as a fault sees it for a Ray Train job: its ranks are the Ray workers.

    Everything else (``elapsed``, ``spec``, ``stop``, ...) is the real launcher's.
    """

    def __init__(self, launcher: Launcher, tracker: RayWorkerTracker, world_size: int) -> None:
        self._launcher = launcher
        self.tracker = tracker
        self.world_size = world_size

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
            out.append(_WorkerRank(rank, seen.pid, seen.node, self._launcher.ranks[0].stderr_log))
        return out

    def kill_rank(self, rank: int, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to the Ray worker process of world rank ``rank``."""
        worker = self.ranks[rank]
        if worker.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker.pid, sig)


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
            "signal only processes on its own machine. Run the drill where the workers run "
            "(a single-node staging cluster, or `trainguard drill` on that node), see "
            "docs/ray-train.md"
        )
    try:
        name = " ".join(psutil.Process(pid).cmdline())
    except psutil.Error:
        return  # exited meanwhile: the signal is a no-op, the drill reports what followed
    if "ray::" not in name and "default_worker" not in name:
        raise WorkerNotHere(
            f"pid {pid} of rank {rank} is not a Ray worker process here ({name[:80]!r}): the "
            "worker runs on another machine or in another pid namespace (a container)"
        )
