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

The daemon is ``python -m trainguard.faults.fusefs``; it needs root, ``/dev/fuse``, the libfuse shared library (Debian: ``libfuse3-3``) and the ``mfusepy`` package.
:func:`fuse_unavailable` says which is missing. The daemon leaves the mount when its parent dies
(no orphaned mount), and :meth:`FuseLayer.unmount` stops it (lazily when busy).
See docs/faults-memory-and-disk.md.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import errno
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from trainguard._internal.pids import pid_alive
from trainguard._internal.signals import signals_deferred
from trainguard.faults.fusejournal import Journal

__all__ = ["POLICIES", "RULE_OPS", "FuseLayer", "fuse_unavailable", "serve"]

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
_MAX_EVENTS = 200  # events written per operation kind (the count goes on)
_MAX_DELAYED = 100_000
_live: set[str] = set()


def fuse_unavailable() -> str | None:
    """Why a FUSE layer cannot be mounted here, or None when it can."""
    if not os.path.exists("/dev/fuse"):
        return "no /dev/fuse on this machine"
    if os.geteuid() != 0:
        return "mounting the FUSE layer needs root"
    done = subprocess.run([sys.executable, "-c", "import mfusepy"], capture_output=True, text=True,
                          timeout=60, check=False)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["?"])[-1]
        if "ModuleNotFoundError" in last:
            return "the mfusepy package is not installed (pip install mfusepy)"
        return f"libfuse could not be loaded ({last[:200]}); install libfuse3 (Debian: libfuse3-3)"
    return None


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


def _tgid(tid: int) -> int:
    """The process (thread group) of thread ``tid``, as fuse_get_context names a thread."""
    with contextlib.suppress(OSError, ValueError), open(f"/proc/{tid}/status") as status:
        for line in status:
            if line.startswith("Tgid:"):
                return int(line.split()[1])
    return tid


def _descends_from(pid: int, ancestor: int) -> bool:
    for _ in range(16):
        if pid == ancestor:
            return True
        try:
            with open(f"/proc/{pid}/status") as status:
                pid = next(int(ln.split()[1]) for ln in status if ln.startswith("PPid:"))
        except (OSError, ValueError, StopIteration):
            return False
        if pid <= 1:
            return False
    return False


def _operations(backing: str, policy: dict[str, int] | None, trigger: str, events: str) -> Any:
    """The passthrough operations; ``policy`` None: the ``rules`` policy (the trigger's JSON)."""
    import mfusepy as fuse  # the daemon only: trainguard imports without it

    counts: dict[str, int] = {}
    totals: dict[str, float] = {}
    lock = threading.Lock()
    cache: dict[str, Any] = {"key": None, "rules": None, "held": None}

    def record(op: str, event: str, path: str, **extra: Any) -> None:
        with lock:
            counts[op + event] = n = counts.get(op + event, 0) + 1
            # every delay is written (the stall is summed from them; a sleeping call is slow anyway)
            if n <= (_MAX_DELAYED if event == "delayed" else _MAX_EVENTS) or event == "held":
                line = {"event": event, "op": op, "path": path, "t": time.time(), "n": n, **extra}
                with contextlib.suppress(OSError), open(events, "a", encoding="utf-8") as out:
                    out.write(json.dumps(line) + "\n")

    def armed() -> tuple[Any, dict[str, Any]] | None:
        try:
            st = os.stat(trigger)
        except OSError:
            return None
        if policy is not None:
            return None, {"errno": policy}
        key = (st.st_ino, st.st_mtime_ns, st.st_size)
        if cache["key"] != key:
            try:
                with open(trigger, encoding="utf-8") as handle:
                    rules = json.load(handle)
            except (OSError, ValueError):
                return None
            cache.update(key=key, rules=rules if isinstance(rules, dict) else {})
        return key, cache["rules"]

    def hold(op: str, path: str, key: Any, spec: dict[str, Any]) -> None:
        _, _, tid = fuse.fuse_get_context()
        pid = _tgid(tid)
        target = spec.get("pid")
        if target is not None and not _descends_from(pid, int(target)):
            return
        with lock:
            if cache["held"] == key:  # one call held per arming
                return
            cache["held"] = key
        record(op, "held", path, pid=pid, tid=tid)
        started = time.monotonic()
        limit = float(spec.get("max_s", 120.0))
        while time.monotonic() - started < limit:
            now = armed()
            if now is None or now[0] != key:
                break
            time.sleep(0.005)
        record(op, "released", path, pid=pid, after_s=round(time.monotonic() - started, 3),
               caller_alive=pid_alive(pid))
        raise fuse.FuseOSError(errno.EIO)

    def deny(op: str, path: str, **extra: Any) -> None:
        now = armed()
        if now is None:
            return
        key, rules = now
        paths = rules.get("paths")
        if paths and not any(path == p or path.startswith(p.rstrip("/") + "/") for p in paths):
            return
        spec = rules.get("hold")
        if isinstance(spec, dict) and spec.get("op", "write") == op:
            hold(op, path, key, spec)
        delay = (rules.get("latency_ms") or {}).get(op)
        if delay:
            time.sleep(float(delay) / 1000.0)
            with lock:
                totals[op] = total = totals.get(op, 0.0) + float(delay) / 1000.0
            record(op, "delayed", path, added_s=float(delay) / 1000.0, total_s=round(total, 3),
                   pid=_tgid(fuse.fuse_get_context()[2]), **extra)
        code = (rules.get("errno") or {}).get(op)
        if code:
            record(op, errno.errorcode.get(int(code), "e" + str(code)).lower(), path, **extra)
            raise fuse.FuseOSError(int(code))

    journal = Journal(events, backing)

    def change(op: str, path: str = "", to: str | None = None) -> Any:
        """Before a call that changes the file system: the armed rules (None: not armed); EIO
        once the ``crash`` rule has struck."""
        now = armed()
        if now is not None:
            code = journal.before(now[0], now[1], op, path, to, _tgid(fuse.fuse_get_context()[2]))
            if code:
                raise fuse.FuseOSError(code)
            return (*now, time.time())
        return None

    def done(now: Any, op: str, path: str, **extra: Any) -> None:
        """After it: the ``record`` / ``crash`` rules count it (fusejournal)."""
        if now is not None:
            journal.after(now[0], now[1], op, path, _tgid(fuse.fuse_get_context()[2]), t0=now[2], **extra)

    def real(path: str) -> str:
        return os.path.join(backing, path.lstrip("/"))

    def _fd_path(fh: int | None) -> str:
        """The path under the mount of an open file (an ftruncate names none)."""
        with contextlib.suppress(OSError, TypeError):
            return "/" + os.path.relpath(os.readlink(f"/proc/self/fd/{fh}"), backing)
        return ""

    def oserror(exc: OSError) -> Any:
        return fuse.FuseOSError(exc.errno or errno.EIO)

    class Passthrough(fuse.Operations):  # type: ignore[misc]
        use_ns = True

        def __call__(self, op: str, *args: Any) -> Any:
            try:
                return getattr(self, op)(*args)
            except fuse.FuseOSError:
                raise
            except OSError as exc:
                raise oserror(exc) from None

        def access(self, path: str, amode: int) -> int:
            if not os.access(real(path), amode):
                raise fuse.FuseOSError(errno.EACCES)
            return 0

        def getattr(self, path: str, fh: int | None = None) -> dict[str, Any]:
            st = os.fstat(fh) if fh is not None and fh > 0 else os.lstat(real(path))
            keys = ("st_mode", "st_nlink", "st_uid", "st_gid", "st_size", "st_blocks", "st_ino")
            out: dict[str, Any] = {k: getattr(st, k) for k in keys}
            out.update(st_atime=st.st_atime_ns, st_mtime=st.st_mtime_ns, st_ctime=st.st_ctime_ns)
            return out

        def readdir(self, path: str, fh: int) -> list[str]:
            return [".", "..", *os.listdir(real(path))]

        def readlink(self, path: str) -> str:
            return os.readlink(real(path))

        def mkdir(self, path: str, mode: int) -> int:
            now = change("mkdir", path)
            deny("mkdir", path)
            os.mkdir(real(path), mode)
            done(now, "mkdir", path)
            return 0

        def mknod(self, path: str, mode: int, dev: int) -> int:
            deny("mknod", path)
            os.mknod(real(path), mode, dev)
            return 0

        def rmdir(self, path: str) -> int:
            now = change("rmdir", path)
            os.rmdir(real(path))
            done(now, "rmdir", path)
            return 0

        def unlink(self, path: str) -> int:
            now = change("unlink", path)
            os.unlink(real(path))
            done(now, "unlink", path)
            return 0

        def symlink(self, target: str, source: str) -> int:
            now = change("symlink", target, target)
            os.symlink(source, real(target))
            done(now, "symlink", target)
            return 0

        def link(self, target: str, source: str) -> int:
            now = change("link", source, target)
            os.link(real(source), real(target))
            done(now, "link", source, to=target)
            return 0

        def rename(self, old: str, new: str, flags: int = 0) -> int:
            now = change("rename", old, new)
            os.rename(real(old), real(new))
            done(now, "rename", old, to=new)
            return 0

        def chmod(self, path: str, mode: int, fh: int | None = None) -> int:
            os.chmod(real(path), mode)
            return 0

        def chown(self, path: str, uid: int, gid: int, fh: int | None = None) -> int:
            os.chown(real(path), uid, gid)
            return 0

        def utimens(self, path: str, times: tuple[int, int] | None = None, fh: int | None = None) -> int:
            os.utime(real(path), ns=times) if times else os.utime(real(path))
            return 0

        def truncate(self, path: str, length: int, fh: int | None = None) -> int:
            target: int | str = fh if fh is not None and fh > 0 else real(path)
            size = os.fstat(target).st_size if isinstance(target, int) else os.stat(target).st_size
            now = change("truncate", path or _fd_path(fh))
            if length > size:
                deny("truncate_grow", path or "", length=length)
            os.truncate(target, length)
            done(now, "truncate", path or "", length=length)
            return 0

        def open(self, path: str, flags: int) -> int:
            if not flags & os.O_TRUNC or not flags & (os.O_WRONLY | os.O_RDWR):
                return os.open(real(path), flags)
            now = change("truncate", path)  # an existing file opened with O_TRUNC: emptied in place
            fh = os.open(real(path), flags)
            done(now, "truncate", path, length=0)
            return fh

        def create(self, path: str, mode: int, fi: Any = None) -> int:
            now = change("create", path)
            fh = os.open(real(path), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
            done(now, "create", path)
            return fh

        def read(self, path: str, size: int, offset: int, fh: int) -> bytes:
            deny("read", path, bytes=size)
            return os.pread(fh, size, offset)

        def write(self, path: str, data: bytes, offset: int, fh: int) -> int:
            now = change("write", path)
            deny("write", path, bytes=len(data))
            written = os.pwrite(fh, data, offset)
            done(now, "write", path, bytes=written, offset=offset)
            return written

        def fallocate(self, path: str, mode: int, offset: int, size: int, fh: int) -> int:
            deny("fallocate", path, bytes=size)
            os.posix_fallocate(fh, offset, size)
            return 0

        def setxattr(self, path: str, name: str, value: bytes, options: int, position: int = 0) -> int:
            deny("setxattr", path)
            os.setxattr(real(path), name, value, options)
            return 0

        def statfs(self, path: str) -> dict[str, Any]:
            st = os.statvfs(real(path))
            out = {k: getattr(st, k) for k in ("f_bsize", "f_frsize", "f_blocks", "f_bfree",
                                                "f_bavail", "f_files", "f_ffree", "f_favail",
                                                "f_flag", "f_namemax")}
            if policy is not None and "write" in policy and os.path.exists(trigger):
                out.update(f_bfree=0, f_bavail=0)  # df agrees with the writes: the disk is full
            return out

        def flush(self, path: str, fh: int) -> int:
            return 0

        def release(self, path: str, fh: int) -> int:
            os.close(fh)
            return 0

        def fsync(self, path: str, datasync: int, fh: int) -> int:
            now = change("fsync", path)
            deny("fsync", path, datasync=bool(datasync))
            if datasync:
                os.fdatasync(fh)
            else:
                os.fsync(fh)
            done(now, "fdatasync" if datasync else "fsync", path, ino=os.fstat(fh).st_ino)
            return 0

        def fsyncdir(self, path: str, datasync: int, fh: int) -> int:
            now = change("fsyncdir", path)
            deny("fsync", path, directory=True)
            done(now, "fsyncdir", path)
            return 0

    return fuse, Passthrough()


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
    fuse, ops = _operations(os.path.realpath(args.backing), POLICIES[args.policy] or None,
                            args.trigger, args.events)

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
