"""Rank processes: the :class:`RankProcess` record, signalling a rank's process group and
its strays, and reading per-process GPU memory through NVML.

Each rank runs in its own process group (its DataLoader workers and helpers with it), so a
signal to the group reaches everything the rank started.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

__all__ = [
    "GpuMemory",
    "RankProcess",
    "carrying",
    "group_alive",
    "live_processes",
    "process_running",
    "signal_all",
    "signal_group",
    "signal_name",
    "wait_stopped",
]


@dataclass
class RankProcess:
    """A live rank: fault injectors target it by rank (``launcher.ranks[1].pid``)."""

    rank: int
    popen: subprocess.Popen[bytes]
    stdout_log: Path
    stderr_log: Path
    stderr_tail: list[str] = field(default_factory=list)

    @property
    def pid(self) -> int:
        """The rank's process id (also its process group id)."""
        return self.popen.pid



class GpuMemory:
    """GPU memory per process through NVML (nvidia-ml-py); absent without it or without GPUs."""

    def __init__(self, nvml: Any, handles: list[Any]) -> None:
        self._nvml = nvml
        self._handles = handles

    @classmethod
    def open(cls) -> GpuMemory | None:
        """NVML's view of the GPUs, or None without nvidia-ml-py, a driver or a GPU."""
        try:
            import pynvml  # type: ignore[import-not-found]

            pynvml.nvmlInit()
        except Exception:  # not installed, no driver, no GPU: memory is reported as RSS only
            return None
        try:
            handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        except Exception:
            handles = []
        if not handles:
            with contextlib.suppress(Exception):
                pynvml.nvmlShutdown()
            return None
        return cls(pynvml, handles)

    def used_mb_by_pid(self) -> dict[int, float]:
        """GPU memory (MiB) each process holds, summed over the GPUs."""
        used: dict[int, float] = {}
        for handle in self._handles:
            with contextlib.suppress(Exception):
                for info in self._nvml.nvmlDeviceGetComputeRunningProcesses(handle):
                    if info.usedGpuMemory is not None:  # None: not visible from here
                        used[info.pid] = used.get(info.pid, 0.0) + info.usedGpuMemory / 2**20
        return used

    def close(self) -> None:
        """Shut NVML down."""
        with contextlib.suppress(Exception):
            self._nvml.nvmlShutdown()


def process_running(proc: psutil.Process) -> bool:
    """True while ``proc`` runs (a zombie counts as gone)."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def signal_all(procs: list[psutil.Process], sig: int) -> None:
    """Send ``sig`` to each of ``procs`` (SIGCONT after SIGTERM, so a stopped one can die)."""
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            proc.send_signal(sig)
            if sig == signal.SIGTERM:
                proc.send_signal(signal.SIGCONT)


def signal_group(popen: subprocess.Popen[bytes], sig: int) -> None:
    """Signal the rank's whole process group (its DataLoader workers and helpers too)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(popen.pid, sig)
    # a SIGSTOPped process never acts on SIGTERM; let it run so it can die
    if sig == signal.SIGTERM:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(popen.pid, signal.SIGCONT)


def signal_name(returncode: int | None) -> str | None:
    """The name of the signal a process died by ("SIGKILL"), from its ``Popen.returncode``;
    None while it runs or when it exited."""
    if returncode is None or returncode >= 0:
        return None
    try:
        return signal.Signals(-returncode).name
    except ValueError:
        return f"signal {-returncode}"


_ENVIRON_MAX = 1 << 21  # the kernel caps a process's arguments and environment near this


def carrying(name: str, value: str) -> list[psutil.Process]:
    """The live processes but this one whose environment holds ``name=value``: every process a
    launched run started (its ranks set it), wherever it went since (a double fork, a session of
    its own, adopted by init), unless it cleared its environment. Linux (``/proc``); elsewhere none."""
    entry, me = f"{name}={value}".encode(), os.getpid()
    found = []
    with contextlib.suppress(OSError):
        pids = [int(n) for n in os.listdir("/proc") if n.isdigit() and int(n) != me]
        for pid in pids:
            try:
                with open(f"/proc/{pid}/environ", "rb") as env:
                    if entry not in env.read(_ENVIRON_MAX).split(b"\0"):
                        continue
                proc = psutil.Process(pid)
            except (OSError, psutil.Error):  # gone, or another user's
                continue
            if process_running(proc):
                found.append(proc)
    return found


def live_processes(pids: list[int]) -> list[psutil.Process]:
    """The processes of ``pids`` that still exist."""
    out = []
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            out.append(psutil.Process(pid))
    return out


def wait_stopped(procs: list[psutil.Process], timeout: float = 2.0) -> list[psutil.Process]:
    """Wait until each of ``procs`` is stopped (a SIGSTOP takes effect when the process is next
    scheduled, after the system call it is in), gone or a zombie; those still running after
    ``timeout`` s are returned."""
    deadline = time.monotonic() + timeout
    running = list(procs)
    while running:
        left = []
        for proc in running:
            with contextlib.suppress(psutil.Error):
                if proc.status() not in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP, psutil.STATUS_ZOMBIE):
                    left.append(proc)
        running = left
        if not running or time.monotonic() > deadline:
            break
        time.sleep(0.002)
    return running


def group_alive(pgid: int) -> bool:
    """True while a live (non-zombie) process of group ``pgid`` remains."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # zombies count as gone: only our own un-reaped rank can be one, and wait() reaps it
    for proc in psutil.process_iter(["pid", "status"]):
        try:
            if os.getpgid(proc.pid) == pgid and proc.info["status"] != psutil.STATUS_ZOMBIE:
                return True
        except (ProcessLookupError, psutil.Error):
            continue
    return False

