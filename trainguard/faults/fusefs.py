"""A FUSE layer over a directory that fails the job's own system calls on demand.

:class:`FuseLayer` mounts a passthrough file system (a daemon process running
:func:`serve`) at a mount point, backed by a real directory. While its trigger file exists the
layer applies a *policy* to every call the kernel forwards, from any process and any language
(torch.save's C++ writer, safetensors' Rust writer, ``cp``): the ``disk_full`` policy fails
every call that would take space with ENOSPC — ``write``, ``fallocate``, growing ``truncate``,
``mkdir`` — whatever the job frees first (a rename over a file, a delete, a truncation), which
a real, racing filler of a small disk cannot promise. Calls that take no space (open, create of
an empty file, read, rename, unlink, shrinking truncate) pass, as on a full ext4 disk.

The ``rules`` policy takes what to do from the trigger file itself (JSON, written by
:meth:`FuseLayer.arm`; the daemon re-reads it when it changes), for the ``storage`` and
``kill_during_save`` faults:

* ``errno``: operation -> errno (``{"write": 5}``: every write fails with EIO; operations:
  ``write``, ``read``, ``fsync`` (fsync, fdatasync and a directory's fsync), ``fallocate``,
  ``truncate_grow``, ``mkdir``, ``mknod``, ``setxattr``);
* ``latency_ms``: operation -> milliseconds added before the call is served (``delayed`` events
  carry the seconds added and the running total);
* ``hold``: ``{"op": "write", "pid": P, "max_s": S}``: the first such call from process ``P`` or
  one of its descendants (any process when ``pid`` is null) blocks inside the daemon and is
  recorded (``held``: path, the caller's pid and thread id from ``fuse_get_context``) until the
  trigger changes or is removed, or ``S`` seconds pass; it then fails with EIO (the data never
  reached the disk);
* ``paths``: when given, only calls on these paths (relative to the mount, ``/a/b``; a directory
  covers what is under it) are touched.

The daemon is ``python -m trainguard.faults.fusefs`` (its operations:
:class:`trainguard.faults.fuseops.Passthrough`); it needs root, ``/dev/fuse``, the libfuse shared library (Debian: ``libfuse3-3``) and the ``mfusepy`` package.
:func:`fuse_unavailable` says which is missing. The daemon leaves the mount when its parent dies
(no orphaned mount), and :meth:`FuseLayer.unmount` stops it (lazily when busy).
See docs/faults-memory-and-disk.md.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import dataclasses
import errno
import functools
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainguard._internal.pids import pid_alive
from trainguard._internal.signals import signals_deferred

__all__ = ["POLICIES", "RULE_OPS", "FuseLayer", "JournalEvent", "fuse_unavailable", "journal", "serve"]

#: what each policy fails while armed: the operation -> errno
#: (``rules``: none fixed; the trigger file's JSON says, see the module's docstring)
POLICIES: dict[str, dict[str, int]] = {
    "disk_full": {"write": errno.ENOSPC, "fallocate": errno.ENOSPC, "truncate_grow": errno.ENOSPC,
                  "mkdir": errno.ENOSPC, "setxattr": errno.ENOSPC, "mknod": errno.ENOSPC},
    "rules": {},
}
#: the operations a ``rules`` trigger may name
RULE_OPS = ("write", "read", "fsync", "fallocate", "truncate_grow", "mkdir", "mknod", "setxattr")
MOUNT_TIMEOUT_S = 15.0
_live: set[str] = set()


def fuse_unavailable() -> str | None:
    """Why a FUSE layer cannot be mounted here, or None when it can."""
    if not os.path.exists("/dev/fuse"):
        return "no /dev/fuse on this machine"
    if os.geteuid() != 0:
        return "mounting the FUSE layer needs root"
    return _mfusepy_problem()


@functools.cache
def _mfusepy_problem() -> str | None:
    """Why the daemon's interpreter cannot load mfusepy and libfuse (asked once per process: a
    check that mounts at every run paid an interpreter's start-up for it each time)."""
    done = subprocess.run([sys.executable, "-c", "import mfusepy"], capture_output=True, text=True,
                          timeout=60, check=False)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["?"])[-1]
        if "ModuleNotFoundError" in last:
            return "the mfusepy package is not installed (pip install mfusepy)"
        return f"libfuse could not be loaded ({last[:200]}); install libfuse3 (Debian: libfuse3-3)"
    return None


@dataclass(frozen=True)
class JournalEvent:
    """One line of the layer's events as its readers (crash_points, the storage fault) read it:
    an operation the journal (:mod:`trainguard.faults.fusejournal`) saw made (``op``: ``t0`` when
    it began, ``t`` when it ended), a file ``opened`` to read or append (``mode``), the ``crashed``
    rank (in power mode, how many changes were ``undone``), a call the rules failed (``eio``:
    ``op``, ``path``)."""

    event: str
    op: str = ""
    path: str = ""
    rank: int | None = None
    ordinal: int = 0
    to: str | None = None
    t: float = 0.0
    t0: float | None = None
    mode: str | None = None
    undone: int | None = None
    #: the copy of the directory the daemon made right after this operation (``record`` with
    #: ``states``: :mod:`trainguard.faults.fusestates`), and the seconds it held the caller
    state: int | None = None
    copy_s: float = 0.0
    #: the calling process (a temporary name may hold it)
    pid: int | None = None

    @property
    def start(self) -> float:
        return self.t if self.t0 is None else self.t0


def journal(lines: list[dict[str, Any]]) -> list[JournalEvent]:
    """The journal's lines (:meth:`FuseLayer.read_events`, JSON objects) as events; the keys
    no reader reads (``pid``, ``n``, ...) left out."""
    names = {f.name for f in dataclasses.fields(JournalEvent)}
    return [JournalEvent(**{k: v for k, v in line.items() if k in names}) for line in lines if "event" in line]


def _mounted(point: Path) -> bool:
    target = os.path.realpath(point)
    try:
        lines = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return False
    return any(len(f) > 2 and f[1] == target and f[2].startswith("fuse") for f in (ln.split() for ln in lines))


class FuseLayer:
    """A passthrough FUSE mount of ``backing`` at ``point`` with ``policy`` applied while armed."""

    def __init__(self, backing: Path, point: Path, *, policy: str, state_dir: Path) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown FUSE policy {policy!r}; expected one of {', '.join(POLICIES)}")
        self.backing, self.point, self.policy = backing, point, policy
        self.trigger = state_dir / f"fuse-{policy}.armed"
        self.events = state_dir / f"fuse-{policy}.events.jsonl"
        self.log = state_dir / f"fuse-{policy}.daemon.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def mount(self) -> None:
        """Start the daemon and wait until the mount is live (RuntimeError saying why not)."""
        self.point.mkdir(parents=True, exist_ok=True)
        self.backing.mkdir(parents=True, exist_ok=True)
        argv = [sys.executable, "-m", "trainguard.faults.fusefs", str(self.backing), str(self.point),
                "--policy", self.policy, "--trigger", str(self.trigger), "--events", str(self.events),
                "--parent", str(os.getpid())]
        deadline = time.monotonic() + MOUNT_TIMEOUT_S
        try:
            # a signal inside Popen would leave a daemon no unmount() knows of: it is held, and
            # delivered when the block ends, where the handler below unmounts what started
            with open(self.log, "wb") as log, signals_deferred():
                self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                             start_new_session=True)
                _live.add(str(self.point))
            while time.monotonic() < deadline:
                if _mounted(self.point):
                    return
                if self.proc.poll() is not None:
                    break
                time.sleep(0.02)
        except BaseException:  # Ctrl-C, SIGTERM while the daemon mounts: the caller has no layer
            self.unmount()
            raise
        why = self._log_tail() or f"no mount after {MOUNT_TIMEOUT_S:g} s"
        self.unmount()
        raise RuntimeError(f"the FUSE daemon did not mount {self.point}: {why}")

    def arm(self, rules: dict[str, Any] | None = None) -> None:
        """Arm the policy; for ``rules``, what to do (written atomically: the daemon never reads
        half a rule)."""
        if self.policy != "rules":
            self.trigger.write_text(str(time.time()))
            return
        unknown = [op for key in ("errno", "latency_ms") for op in (rules or {}).get(key, {})
                   if op not in RULE_OPS]
        if unknown:
            raise ValueError(f"unknown FUSE operation(s) {unknown}; expected {', '.join(RULE_OPS)}")
        tmp = self.trigger.with_name(self.trigger.name + ".tmp")
        tmp.write_text(json.dumps({**(rules or {}), "armed_at": time.time()}))
        os.replace(tmp, self.trigger)

    def disarm(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.trigger.unlink()

    def read_events(self) -> list[dict[str, Any]]:
        out = []
        with contextlib.suppress(OSError), open(self.events, encoding="utf-8") as handle:
            for line in handle:
                with contextlib.suppress(ValueError):
                    out.append(json.loads(line))
        return out

    def unmount(self) -> str | None:
        """Unmount (lazily when busy), stop the daemon; the problem, if any."""
        self.disarm()
        problem = None
        if _mounted(self.point):
            for argv in (["fusermount3", "-u", str(self.point)], ["umount", str(self.point)],
                         ["umount", "-l", str(self.point)]):
                with contextlib.suppress(OSError, subprocess.TimeoutExpired):
                    subprocess.run(argv, capture_output=True, timeout=30, check=False)
                if not _mounted(self.point):
                    break
            else:
                problem = f"{self.point} is still mounted after umount -l"
        if self.proc is not None:
            if problem is None and not _mounted(self.point) and self.proc.poll() is None:
                # not mounted (yet): a daemon still starting would mount after we looked
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
            self.proc = None
            if _mounted(self.point):  # it mounted meanwhile, or died and left its mount
                with contextlib.suppress(OSError, subprocess.TimeoutExpired):
                    subprocess.run(["umount", "-l", str(self.point)], capture_output=True, timeout=30,
                                   check=False)
                if _mounted(self.point):
                    problem = f"{self.point} is still mounted after umount -l"
        _live.discard(str(self.point))
        with contextlib.suppress(OSError):
            self.point.rmdir()
        return problem

    def _log_tail(self) -> str:
        with contextlib.suppress(OSError):
            lines = self.log.read_text(errors="replace").strip().splitlines()
            return " | ".join(lines[-3:])[:400]
        return ""


@atexit.register
def _unmount_leftovers() -> None:
    # a drill's finally unmounts; this covers an interpreter that exits some other way
    for point in list(_live):
        with contextlib.suppress(OSError, subprocess.TimeoutExpired):
            subprocess.run(["umount", "-l", point], capture_output=True, timeout=30, check=False)
        _live.discard(point)


# -- the daemon ---------------------------------------------------------------------------------


def serve(argv: list[str] | None = None) -> int:
    """The daemon: mount, serve until unmounted or the parent is gone."""
    parser = argparse.ArgumentParser(prog="python -m trainguard.faults.fusefs")
    parser.add_argument("backing")
    parser.add_argument("point")
    parser.add_argument("--policy", choices=sorted(POLICIES), required=True)
    parser.add_argument("--trigger", required=True)
    parser.add_argument("--events", required=True)
    parser.add_argument("--parent", type=int, default=0)
    args = parser.parse_args(argv)
    import mfusepy as fuse  # the daemon only: trainguard imports without it

    from trainguard.faults.fuseops import Passthrough

    ops = Passthrough(os.path.realpath(args.backing), POLICIES[args.policy] or None, args.trigger, args.events)

    def watch_parent() -> None:  # never an orphaned mount: leave when trainguard is gone
        while True:
            time.sleep(0.5)
            if args.parent and not pid_alive(args.parent):
                subprocess.run(["umount", "-l", args.point], capture_output=True, timeout=30, check=False)
                os._exit(0)

    threading.Thread(target=watch_parent, daemon=True).start()
    # rules: the kernel caches no entry or attribute (a power-loss crash changes the backing
    # directory behind the mount's back, and the restart must see what the crash left)
    fresh = {"entry_timeout": 0, "attr_timeout": 0, "negative_timeout": 0} if args.policy == "rules" else {}
    fuse.FUSE(ops, args.point, foreground=True, allow_other=True, nothreads=False,
              fsname="trainguard-fuse", **fresh)
    return 0


if __name__ == "__main__":
    sys.exit(serve())
