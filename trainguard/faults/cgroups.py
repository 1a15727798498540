"""Memory cgroups for the oom fault: one cgroup per rank under a trainguard-owned parent.

Facts this module is built on (measured on cgroup v1, kernel 6.x):

* a v1 ``memory.limit_in_bytes`` below the current usage is refused with EBUSY when the kernel
  cannot reclaim down to it (anonymous memory, no swap): the limit is set just above the usage;
* a process moved into a cgroup after it started keeps its earlier charges in the old cgroup, so
  a rank joins its cgroup in :attr:`LaunchSpec.preexec` (after fork, before exec): everything
  its program allocates is then charged there;
* when the limit is reached and nothing can be reclaimed, the kernel's OOM killer SIGKILLs a
  process of that cgroup and counts it (v1 ``memory.oom_control`` ``oom_kill``; v2
  ``memory.events`` ``oom_kill``).

The parent goes under this process's own memory cgroup (v1), so the limits of whatever contains
trainguard (a CI job's cgroup, a container) still apply to the ranks; on v2 it goes where the
memory controller can be enabled for it. Needs root (or a delegated cgroup subtree).
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import os
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from trainguard._internal.pids import pid_alive
from trainguard.faults.base import FaultUnavailable
from trainguard.report import SkipReason

__all__ = ["CgroupCounters", "MemoryCgroups", "remove_stale"]

_UNLIMITED_V1 = "-1"
_UNLIMITED_V2 = "max"
_PREFIX = "trainguard-"


@dataclass
class CgroupCounters:
    """What a rank's memory cgroup says happened."""

    usage_bytes: int | None = None
    limit_bytes: int | None = None
    peak_bytes: int | None = None
    failcnt: int | None = None  # v1: times the limit was hit (memory or memory+swap)
    oom: int | None = None  # v2 memory.events oom; v1: under_oom at read time
    oom_kill: int | None = None  # processes the OOM killer killed in this cgroup
    raw: dict[str, str] = field(default_factory=dict)

    def as_dict(self) -> dict[str, int | None]:
        return {
            "usage_mb": _mb(self.usage_bytes), "limit_mb": _mb(self.limit_bytes),
            "peak_mb": _mb(self.peak_bytes), "failcnt": self.failcnt, "oom": self.oom,
            "oom_kill": self.oom_kill,
        }


def _mb(value: int | None) -> int | None:
    return None if value is None else round(value / 2**20)


class MemoryCgroups:
    """One memory cgroup per rank (``<parent>/rank<N>``), created by :meth:`create`.

    :meth:`join` is safe to call from ``preexec`` (it only opens and writes one file);
    :meth:`set_limit_above_usage` and :meth:`counters` run in the drill's process;
    :meth:`teardown` moves stragglers out, waits for the cgroups to empty and removes them.
    """

    def __init__(self, world_size: int, *, root: Path | None = None, version: int | None = None) -> None:
        self.world_size = world_size
        if root is not None and version is not None:
            self.version, self.base, self.home = version, root, root
        else:
            self.version, self.base, self.home = _locate()
        self.parent = self.base / f"{_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._procs_files: list[bytes] = []
        self.created = False
        self.last_counters: dict[int, CgroupCounters] = {}

    # -- life cycle ----------------------------------------------------------------------------

    def create(self) -> None:
        """Make the parent and one cgroup per rank (FaultUnavailable when the kernel refuses).
        Empty cgroups a trainguard that no longer runs left here (SIGKILLed mid-drill) are
        removed first."""
        remove_stale(self.base)
        try:
            if self.version == 2:
                _enable_memory(self.base)
            self.parent.mkdir()
            self.created = True
            _live.add(self)
            if self.version == 2:
                _enable_memory(self.parent)
            for rank in range(self.world_size):
                self.path(rank).mkdir()
        except OSError as exc:
            self.teardown()
            raise FaultUnavailable(
                f"cannot create memory cgroups under {self.base}: {exc.strerror or exc}. "
                "Run the drill as root (or with a delegated cgroup subtree), or use the oom "
                "fault's mode: rlimit", needs=SkipReason.NEEDS_ROOT,
            ) from None
        except BaseException:  # Ctrl-C, SIGTERM between two mkdirs: nothing stays behind
            self.teardown()
            raise
        procs = "cgroup.procs"
        self._procs_files = [os.fsencode(self.path(r) / procs) for r in range(self.world_size)]

    def path(self, rank: int) -> Path:
        return self.parent / f"rank{rank}"

    def join(self, rank: int) -> None:
        """Move the calling process into ``rank``'s cgroup (for ``preexec``: no allocation of
        note, no locks)."""
        fd = os.open(self._procs_files[rank], os.O_WRONLY)
        try:
            os.write(fd, str(os.getpid()).encode())
        finally:
            os.close(fd)

    def move(self, rank: int, pid: int) -> None:
        """Move a running process (a Ray worker: not a child of ours) into ``rank``'s cgroup.
        Its earlier charges stay behind (v1 without move_charge_at_immigrate, v2 always): the
        limit set just above the cgroup's usage then bounds what it allocates from now on."""
        _write(self.path(rank) / "cgroup.procs", str(pid))

    def pids(self, rank: int) -> list[int]:
        try:
            text = (self.path(rank) / "cgroup.procs").read_text()
        except OSError:
            return []
        return [int(p) for p in text.split()]

    def set_limit_above_usage(self, rank: int, headroom_bytes: int, *, attempts: int = 20) -> int:
        """Set ``rank``'s memory limit to its usage plus ``headroom_bytes``; returns the limit.

        The usage moves while the rank runs, and v1 answers EBUSY for a limit below it: re-read
        and retry.
        """
        last: OSError | None = None
        for _ in range(attempts):
            limit = self._usage(rank) + headroom_bytes
            try:
                self._set_limit(rank, str(limit))
                return limit
            except OSError as exc:
                if exc.errno != errno.EBUSY:
                    raise
                last = exc
                time.sleep(0.01)
        raise OSError(errno.EBUSY, f"the kernel kept refusing a memory limit for rank {rank} "
                      f"just above its usage ({last})")

    def lift_limit(self, rank: int) -> None:
        d = self.path(rank)
        with contextlib.suppress(OSError):
            if self.version == 2:
                _write(d / "memory.max", _UNLIMITED_V2)
                return
            # memory+swap must stay >= memory: raise it first
            if (d / "memory.memsw.limit_in_bytes").exists():
                _write(d / "memory.memsw.limit_in_bytes", _UNLIMITED_V1)
            _write(d / "memory.limit_in_bytes", _UNLIMITED_V1)

    def counters(self, rank: int) -> CgroupCounters:
        """Read ``rank``'s counters (the last good read is kept in :attr:`last_counters`)."""
        d = self.path(rank)
        c = CgroupCounters()
        if not d.is_dir():
            return self.last_counters.get(rank, c)
        if self.version == 2:
            c.usage_bytes = _read_int(d / "memory.current")
            c.limit_bytes = _read_int(d / "memory.max")
            c.peak_bytes = _read_int(d / "memory.peak")
            events = _read_kv(d / "memory.events")
            c.raw = {k: str(v) for k, v in events.items()}
            c.oom, c.oom_kill = events.get("oom"), events.get("oom_kill")
            c.failcnt = events.get("max")
        else:
            c.usage_bytes = _read_int(d / "memory.usage_in_bytes")
            c.limit_bytes = _read_int(d / "memory.limit_in_bytes")
            c.peak_bytes = _read_int(d / "memory.max_usage_in_bytes")
            # with memory+swap limited too, the memsw counter is the one that fails first
            fails = [_read_int(d / "memory.failcnt"), _read_int(d / "memory.memsw.failcnt")]
            c.failcnt = max((f for f in fails if f is not None), default=None)
            control = _read_kv(d / "memory.oom_control")
            c.raw = {k: str(v) for k, v in control.items()}
            c.oom, c.oom_kill = control.get("under_oom"), control.get("oom_kill")
        self.last_counters[rank] = c
        return c

    def teardown(self, timeout: float = 5.0) -> list[str]:
        """Remove every cgroup this object made; returns problems (never raises).

        Processes still inside are moved back to trainguard's own cgroup; empty cgroups are removed
        (charges of exited processes move to the parent, as the kernel does on rmdir).
        """
        problems: list[str] = []
        if not self.created:
            return problems
        for rank in range(self.world_size):
            with contextlib.suppress(OSError):
                self.counters(rank)
        deadline = time.monotonic() + timeout
        for rank in range(self.world_size):
            d = self.path(rank)
            while d.exists():
                for pid in self.pids(rank):
                    with contextlib.suppress(OSError):
                        _write(self.home / "cgroup.procs", str(pid))
                try:
                    d.rmdir()
                except FileNotFoundError:
                    break
                except OSError as exc:
                    if time.monotonic() > deadline:
                        problems.append(f"{d}: {exc.strerror}")
                        break
                    time.sleep(0.05)
        try:
            self.parent.rmdir()
            self.created = False
        except FileNotFoundError:
            self.created = False
        except OSError as exc:
            problems.append(f"{self.parent}: {exc.strerror}")
        if not self.created:
            _live.discard(self)
        return problems

    # -- internals ---------------------------------------------------------------------------

    def _usage(self, rank: int) -> int:
        name = "memory.current" if self.version == 2 else "memory.usage_in_bytes"
        value = _read_int(self.path(rank) / name)
        if value is None:
            raise OSError(errno.ENOENT, f"cannot read {self.path(rank) / name}")
        return value

    def _set_limit(self, rank: int, value: str) -> None:
        d = self.path(rank)
        if self.version == 2:
            _write(d / "memory.max", value)
            if (d / "memory.swap.max").exists():
                _write(d / "memory.swap.max", "0")  # no escape into swap
            return
        _write(d / "memory.limit_in_bytes", value)
        # memory+swap too, or the rank swaps instead of being OOM-killed; only with swap: with
        # none, a memsw limit only stops memory.failcnt counting (measured: 0 after an OOM kill)
        if _has_swap() and (d / "memory.memsw.limit_in_bytes").exists():
            with contextlib.suppress(OSError):
                _write(d / "memory.memsw.limit_in_bytes", value)


#: cgroups made and not removed yet; what a teardown cut short left is removed at exit
_live: set[MemoryCgroups] = set()


@atexit.register
def _remove_leftovers() -> None:
    for cgroups in list(_live):
        cgroups.teardown(timeout=2.0)


def remove_stale(base: Path) -> list[Path]:
    """Remove the ``trainguard-<pid>-*`` cgroups under ``base`` whose trainguard process is gone
    and that hold no process (a SIGKILLed trainguard never ran its teardown); the removed."""
    removed = []
    with contextlib.suppress(OSError):
        for parent in base.glob(f"{_PREFIX}*-*"):
            pid = parent.name[len(_PREFIX):].split("-", 1)[0]
            if not pid.isdigit() or pid_alive(int(pid)) or not parent.is_dir():
                continue
            with contextlib.suppress(OSError):  # EBUSY: a process is still inside; left alone
                for child in [c for c in parent.iterdir() if c.is_dir()]:
                    child.rmdir()
                parent.rmdir()
                removed.append(parent)
    return removed


def _write(path: Path, value: str) -> None:
    # one write() per value: the kernel's answer (EBUSY, EINVAL) comes back from it, not from
    # a buffered close that Python would swallow
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max":
        return None
    try:
        value = int(text)
    except ValueError:
        return None
    return None if value >= 2**62 else value  # v1's "unlimited" is a page-rounded 2**63 - 1


def _read_kv(path: Path) -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        parts = line.split()
        if len(parts) == 2:
            with contextlib.suppress(ValueError):
                out[parts[0]] = int(parts[1])
    return out


def _has_swap() -> bool:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("SwapTotal:"):
                return int(line.split()[1]) > 0
    except (OSError, ValueError, IndexError):
        pass
    return False


def _enable_memory(cgroup: Path) -> None:
    control = cgroup / "cgroup.subtree_control"
    if "memory" not in control.read_text().split():
        _write(control, "+memory")


def _mounts() -> list[tuple[str, str, str, str]]:
    """(root, mount point, fs type, super options) per cgroup mount, from mountinfo."""
    out: list[tuple[str, str, str, str]] = []
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        left, _, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if len(fields) >= 5 and len(tail) >= 3 and tail[0] in ("cgroup", "cgroup2"):
            out.append((fields[3], fields[4], tail[0], tail[2]))
    return out


def _own_cgroups() -> dict[str, str]:
    """hierarchy key ('memory' for v1's memory controller, '' for v2) -> this process's path."""
    out: dict[str, str] = {}
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        _, controllers, path = line.split(":", 2)
        for name in controllers.split(",") if controllers else [""]:
            out[name] = path
    return out


def _inside(mount_root: str, own: str, mount_point: str) -> Path:
    rel = os.path.relpath(own, mount_root) if own.startswith(mount_root) else "."
    return Path(mount_point) / ("" if rel == "." else rel)


def _locate() -> tuple[int, Path, Path]:
    """(version, base directory for the trainguard parent, this process's own cgroup) or
    FaultUnavailable."""
    if os.geteuid() != 0:
        raise FaultUnavailable(
            "memory cgroups need root: run the drill as root (or in a container with a "
            "delegated cgroup), or use the oom fault's mode: rlimit", needs=SkipReason.NEEDS_ROOT,
        )
    own = _own_cgroups()
    mounts = _mounts()
    for root, point, fstype, options in mounts:
        if fstype == "cgroup" and "memory" in options.split(","):
            base = _inside(root, own.get("memory", "/"), point)
            if base.is_dir() and os.access(base, os.W_OK):
                return 1, base, base
            return 1, Path(point), Path(point)
    for root, point, fstype, _ in mounts:
        if fstype != "cgroup2":
            continue
        controllers = Path(point) / "cgroup.controllers"
        try:
            available = controllers.read_text().split()
        except OSError:
            continue
        if "memory" not in available:
            continue
        # v2 forbids processes in a cgroup whose children get controllers ("no internal
        # processes"): the parent goes beside our own cgroup, under its parent (or the root)
        mine = _inside(root, own.get("", "/"), point)
        return 2, (mine.parent if mine != Path(point) else Path(point)), mine
    raise FaultUnavailable(
        "no memory cgroup controller is mounted (neither cgroup v1 'memory' nor a cgroup2 "
        "hierarchy with 'memory' in cgroup.controllers); use the oom fault's mode: rlimit",
        needs=SkipReason.NEEDS_ROOT,
    )
