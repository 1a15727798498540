"""The FUSE daemon's operations: a passthrough of a backing directory that applies the armed
policy to each call (:mod:`trainguard.faults.fusefs` mounts it and says what the policies do)
and tells the journal (:mod:`trainguard.faults.fusejournal`) of every change.

Only the daemon (:func:`trainguard.faults.fusefs.serve`) imports this module: it needs the
``mfusepy`` package, which trainguard itself does not.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import stat
import threading
import time
from typing import Any

import mfusepy as fuse

from trainguard._internal.pids import pid_alive
from trainguard.faults.fusejournal import HoldRule, Journal, Rules
from trainguard.faults.fuseseen import Observer, lookup_level

__all__ = ["Passthrough"]

_MAX_EVENTS = 200  # events written per operation kind (the count goes on)
_MAX_DELAYED = 100_000


def _tgid(tid: int) -> int:
    """The process (thread group) of thread ``tid``, as fuse_get_context names a thread."""
    with contextlib.suppress(OSError, ValueError), open(f"/proc/{tid}/status") as status:
        for line in status:
            if line.startswith("Tgid:"):
                return int(line.split()[1])
    return tid


def _caller() -> int:
    """The process of the thread whose call the daemon is serving."""
    return _tgid(fuse.fuse_get_context()[2])


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


class Passthrough(fuse.Operations):  # type: ignore[misc]
    """Every call served on ``backing``, after the armed policy (``policy`` None: the ``rules``
    policy, read from the trigger file's JSON) and the journal had their say.

    One method per FUSE operation; the helpers and the state the daemon's threads share start
    with ``_`` (mfusepy takes any attribute named after an operation, ``lock`` say, for one).
    """

    use_ns = True

    def __init__(self, backing: str, policy: dict[str, int] | None, trigger: str, events: str) -> None:
        self.backing, self.policy, self.trigger, self.events = backing, policy, trigger, events
        self._journal = Journal(events, backing)
        self._guard = threading.Lock()  # the counts, the totals and the held call
        self._counts: dict[str, int] = {}
        self._totals: dict[str, float] = {}
        self._rules_key: Any = None  # the trigger file (inode, mtime, size) its rules were read from
        self._rules = Rules()
        self._held: Any = None  # the arming whose call is held (one per arming)
        self._observer = Observer()  # what a restart observed (the ``observe`` rule)

    # -- the policy ------------------------------------------------------------------------------

    def _record(self, op: str, event: str, path: str, **extra: Any) -> None:
        with self._guard:
            self._counts[op + event] = n = self._counts.get(op + event, 0) + 1
            # every delay is written (the stall is summed from them; a sleeping call is slow anyway)
            if n <= (_MAX_DELAYED if event == "delayed" else _MAX_EVENTS) or event == "held":
                line = {"event": event, "op": op, "path": path, "t": time.time(), "n": n, **extra}
                with contextlib.suppress(OSError), open(self.events, "a", encoding="utf-8") as out:
                    out.write(json.dumps(line) + "\n")

    def _armed(self) -> tuple[Any, Rules] | None:
        """(the arming's key, its rules) while the trigger exists, else None."""
        try:
            st = os.stat(self.trigger)
        except OSError:
            return None
        if self.policy is not None:
            return None, Rules(errno=self.policy)
        key = (st.st_ino, st.st_mtime_ns, st.st_size)
        if self._rules_key != key:
            try:
                with open(self.trigger, encoding="utf-8") as handle:
                    rules = json.load(handle)
            except (OSError, ValueError):
                return None
            self._rules_key, self._rules = key, Rules.read(rules)
        return key, self._rules

    def _hold(self, op: str, path: str, key: Any, spec: HoldRule) -> None:
        _, _, tid = fuse.fuse_get_context()
        pid = _tgid(tid)
        target = spec.pid
        if target is not None and not _descends_from(pid, int(target)):
            return
        with self._guard:
            if self._held == key:  # one call held per arming
                return
            self._held = key
        self._record(op, "held", path, pid=pid, tid=tid)
        started = time.monotonic()
        limit = spec.max_s
        while time.monotonic() - started < limit:
            now = self._armed()
            if now is None or now[0] != key:
                break
            time.sleep(0.005)
        self._record(op, "released", path, pid=pid, after_s=round(time.monotonic() - started, 3),
                     caller_alive=pid_alive(pid))
        raise fuse.FuseOSError(errno.EIO)

    def _deny(self, op: str, path: str, **extra: Any) -> None:
        """The armed rules for ``op`` on ``path``: hold it, delay it, fail it (FuseOSError)."""
        now = self._armed()
        if now is None:
            return
        key, rules = now
        paths = rules.paths
        if paths and not any(path == p or path.startswith(p.rstrip("/") + "/") for p in paths):
            return
        spec = rules.hold
        if spec is not None and spec.op == op:
            self._hold(op, path, key, spec)
        delay = rules.latency_ms.get(op)
        if delay:
            time.sleep(float(delay) / 1000.0)
            with self._guard:
                self._totals[op] = total = self._totals.get(op, 0.0) + float(delay) / 1000.0
            self._record(op, "delayed", path, added_s=float(delay) / 1000.0, total_s=round(total, 3),
                         pid=_caller(), **extra)
        code = rules.errno.get(op)
        if code:
            self._record(op, errno.errorcode.get(int(code), "e" + str(code)).lower(), path, **extra)
            raise fuse.FuseOSError(int(code))

    def _change(self, op: str, path: str = "", to: str | None = None) -> Any:
        """Before a call that changes the file system: the armed rules (None: not armed); EIO
        once the ``crash`` rule has struck."""
        now = self._armed()
        if now is not None:
            code = self._journal.before(now[0], now[1], op, path, to, _caller())
            if code:
                raise fuse.FuseOSError(code)
            return (*now, time.time())
        return None

    def _done(self, now: Any, op: str, path: str, **extra: Any) -> None:
        """After it: the ``record`` / ``crash`` rules count it (fusejournal)."""
        if now is not None:
            self._journal.after(now[0], now[1], op, path, _caller(), t0=now[2], **extra)

    def _opened(self, path: str, flags: int) -> None:
        """A file opened to read or to append: the journal writes it down (the files a restart
        reads, the logs)."""
        emptied = flags & (os.O_TRUNC | os.O_CREAT)  # nothing left in it to read
        mode = ("append" if flags & os.O_APPEND else
                "read" if flags & os.O_ACCMODE != os.O_WRONLY and not emptied else None)
        now = self._armed() if mode else None
        if now is not None and mode is not None:
            self._journal.opened(now[0], now[1], path, _caller(), mode)

    def _seen(self, level: str, *paths: str) -> None:
        """The ``observe`` rule: what the call showed the program of ``paths`` (``lookup``: the
        level of the syscall its thread waits in)."""
        now = self._armed()
        file = now[1].observe if now is not None else None
        if file is not None:
            if level == "lookup":
                level = lookup_level(fuse.fuse_get_context()[2])
            for path in paths:
                self._observer.add(now[0] if now is not None else None, file, level, path)

    def _made(self, *paths: str) -> None:
        """The ``observe`` rule: the run made ``paths`` itself (fuseseen)."""
        now = self._armed()
        file = now[1].observe if now is not None else None
        if file is not None and now is not None:
            self._observer.made(now[0], *paths)

    def _real(self, path: str) -> str:
        return os.path.join(self.backing, path.lstrip("/"))

    def _fd_path(self, fh: int | None) -> str:
        """The path under the mount of an open file (an ftruncate names none)."""
        with contextlib.suppress(OSError, TypeError):
            return "/" + os.path.relpath(os.readlink(f"/proc/self/fd/{fh}"), self.backing)
        return ""

    # -- the operations ----------------------------------------------------------------------------

    def access(self, path: str, amode: int) -> int:
        self._seen("stat", path)
        if not os.access(self._real(path), amode):
            raise fuse.FuseOSError(errno.EACCES)
        return 0

    def getattr(self, path: str, fh: int | None = None) -> dict[str, int]:
        self._seen("stat" if fh is not None and fh > 0 else "lookup", path)
        st = os.fstat(fh) if fh is not None and fh > 0 else os.lstat(self._real(path))
        keys = ("st_mode", "st_nlink", "st_uid", "st_gid", "st_size", "st_blocks", "st_ino")
        out: dict[str, int] = {k: getattr(st, k) for k in keys}
        out.update(st_atime=st.st_atime_ns, st_mtime=st.st_mtime_ns, st_ctime=st.st_ctime_ns)
        return out

    def readdir(self, path: str, fh: int) -> list[Any]:
        self._seen("list", path)
        # each entry with its kind (the d_type a program reads: os.scandir's is_dir() needs no stat)
        entries: list[Any] = [".", ".."]
        with os.scandir(self._real(path)) as found:
            for entry in found:
                try:
                    entries.append((entry.name, {"st_mode": stat.S_IFMT(entry.stat(follow_symlinks=False).st_mode)}, 0))
                except OSError:  # gone meanwhile: a name without its kind
                    entries.append(entry.name)
        return entries

    def readlink(self, path: str) -> str:
        self._seen("read", path)
        return os.readlink(self._real(path))

    def mkdir(self, path: str, mode: int) -> int:
        self._seen("name", path)
        now = self._change("mkdir", path)
        self._deny("mkdir", path)
        os.mkdir(self._real(path), mode)
        self._made(path)
        self._done(now, "mkdir", path)
        return 0

    def mknod(self, path: str, mode: int, dev: int) -> int:
        self._seen("name", path)
        self._deny("mknod", path)
        os.mknod(self._real(path), mode, dev)
        return 0

    def rmdir(self, path: str) -> int:
        self._seen("name", path)
        now = self._change("rmdir", path)
        os.rmdir(self._real(path))
        self._made(path)
        self._done(now, "rmdir", path)
        return 0

    def unlink(self, path: str) -> int:
        self._seen("name", path)
        now = self._change("unlink", path)
        os.unlink(self._real(path))
        self._made(path)
        self._done(now, "unlink", path)
        return 0

    def symlink(self, target: str, source: str) -> int:
        self._seen("name", target)
        now = self._change("symlink", target, target)
        os.symlink(source, self._real(target))
        self._made(target)
        self._done(now, "symlink", target)
        return 0

    def link(self, target: str, source: str) -> int:
        self._seen("tree", source)
        self._seen("name", target)
        now = self._change("link", source, target)
        os.link(self._real(source), self._real(target))
        self._made(target)
        self._done(now, "link", source, to=target)
        return 0

    def rename(self, old: str, new: str, flags: int = 0) -> int:
        self._seen("tree", old, new)  # a folder renamed away moves all it holds; onto one: fails unless empty
        now = self._change("rename", old, new)
        os.rename(self._real(old), self._real(new))
        self._made(old, new)
        self._done(now, "rename", old, to=new)
        return 0

    def chmod(self, path: str, mode: int, fh: int | None = None) -> int:
        self._seen("name", path)
        os.chmod(self._real(path), mode)
        return 0

    def chown(self, path: str, uid: int, gid: int, fh: int | None = None) -> int:
        self._seen("name", path)
        os.chown(self._real(path), uid, gid)
        return 0

    def utimens(self, path: str, times: tuple[int, int] | None = None, fh: int | None = None) -> int:
        self._seen("name", path)
        os.utime(self._real(path), ns=times) if times else os.utime(self._real(path))
        return 0

    def truncate(self, path: str, length: int, fh: int | None = None) -> int:
        self._seen("name", path or self._fd_path(fh))
        target: int | str = fh if fh is not None and fh > 0 else self._real(path)
        size = os.fstat(target).st_size if isinstance(target, int) else os.stat(target).st_size
        now = self._change("truncate", path or self._fd_path(fh))
        if length > size:
            self._deny("truncate_grow", path or "", length=length)
        os.truncate(target, length)
        self._done(now, "truncate", path or "", length=length)
        return 0

    def open(self, path: str, flags: int) -> int:
        self._seen("name" if flags & os.O_ACCMODE == os.O_WRONLY or flags & os.O_TRUNC else "read", path)
        if not flags & os.O_TRUNC or not flags & (os.O_WRONLY | os.O_RDWR):
            fh = os.open(self._real(path), flags)
            self._opened(path, flags)
            return fh
        now = self._change("truncate", path)  # an existing file opened with O_TRUNC: emptied in place
        fh = os.open(self._real(path), flags)
        self._made(path)
        self._done(now, "truncate", path, length=0)
        self._opened(path, flags)
        return fh

    def create(self, path: str, mode: int, fi: Any = None) -> int:
        self._seen("name", path)
        now = self._change("create", path)
        fh = os.open(self._real(path), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
        self._made(path)
        self._done(now, "create", path)
        if isinstance(fi, int):  # the open's flags (mfusepy passes them as an int)
            self._opened(path, fi | os.O_CREAT)
        return fh

    def read(self, path: str, size: int, offset: int, fh: int) -> bytes:
        self._deny("read", path, bytes=size)
        return os.pread(fh, size, offset)

    def write(self, path: str, data: bytes, offset: int, fh: int) -> int:
        now = self._change("write", path)
        self._deny("write", path, bytes=len(data))
        written = os.pwrite(fh, data, offset)
        self._done(now, "write", path, bytes=written, offset=offset)
        return written

    def fallocate(self, path: str, mode: int, offset: int, size: int, fh: int) -> int:
        self._deny("fallocate", path, bytes=size)
        os.posix_fallocate(fh, offset, size)
        return 0

    def setxattr(self, path: str, name: str, value: bytes, options: int, position: int = 0) -> int:
        self._seen("name", path)
        self._deny("setxattr", path)
        os.setxattr(self._real(path), name, value, options)
        return 0

    def statfs(self, path: str) -> dict[str, int]:
        self._seen("all", "/")  # the room left depends on everything in it
        st = os.statvfs(self._real(path))
        out: dict[str, int] = {k: getattr(st, k) for k in ("f_bsize", "f_frsize", "f_blocks", "f_bfree", "f_bavail",
                                            "f_files", "f_ffree", "f_favail", "f_flag", "f_namemax")}
        if self.policy is not None and "write" in self.policy and os.path.exists(self.trigger):
            out.update(f_bfree=0, f_bavail=0)  # df agrees with the writes: the disk is full
        return out

    def flush(self, path: str, fh: int) -> int:
        return 0

    def release(self, path: str, fh: int) -> int:
        os.close(fh)
        return 0

    def fsync(self, path: str, datasync: int, fh: int) -> int:
        now = self._change("fsync", path)
        self._deny("fsync", path, datasync=bool(datasync))
        if datasync:
            os.fdatasync(fh)
        else:
            os.fsync(fh)
        self._done(now, "fdatasync" if datasync else "fsync", path, ino=os.fstat(fh).st_ino)
        return 0

    def fsyncdir(self, path: str, datasync: int, fh: int) -> int:
        now = self._change("fsyncdir", path)
        self._deny("fsync", path, directory=True)
        self._done(now, "fsyncdir", path)
        return 0
