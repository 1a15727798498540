"""The ``disk_full`` fault: from step k on, checkpoint writes fail with ENOSPC.

Modes (``mode`` parameter; ``auto``, the default, runs ``tmpfs`` as root and ``hook``
otherwise; :meth:`DiskFullFault.evidence` says which ran and why):

* ``tmpfs`` (root): :meth:`~DiskFullFault.setup` mounts a tmpfs of ``size_mb`` and moves the
  checkpoint directory onto it; after step k a filler thread fills it and keeps it full, taking
  back at once any space the job frees (other tenants of a shared disk do the same). Keeping it
  full matters: after a one-off fill, a checkpoint overwritten in place frees by its truncation
  exactly the space its new content needs. The filler is best effort (a race against the job's
  next write); real checkpoints take long enough to write that it wins.
* ``hook``: the start-up hook makes every write to a file under the checkpoint directory fail
  with ENOSPC from step k, while opening and truncating still succeed (the file descriptor is
  pointed at /dev/full: the kernel's own ENOSPC); ``torch.save`` to a path creates/truncates the
  file and raises torch's RuntimeError. Deterministic; needs no root. Every rank is affected,
  as every rank shares a full disk.

See docs/faults-memory-and-disk.md.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from trainguard.faults.base import FaultContext, FaultUnavailable
from trainguard.faults.hook import HookFault, hook_env, pull_trigger, rank_stderr

if TYPE_CHECKING:  # pragma: no cover
    from trainguard.launch import Launcher, RunResult

__all__ = ["DiskFullFault", "Filler", "mount_tmpfs", "unmount"]

MODES = ("auto", "tmpfs", "hook")
MOUNT_SOURCE = "trainguard-disk-full"  # how our mounts are named in /proc/mounts
FILLER_NAME = ".trainguard-filler"
#: what torch.save writes on ENOSPC, by version: it does not always say ENOSPC
_TORCH_WRITE_FAILURES = ("PytorchStreamWriter failed", "file write failed", "unexpected pos",
                         "inline_container.cc", "basic_ios::clear")


class DiskFullFault(HookFault):
    """The checkpoint directory's disk is full from step ``after_step`` on."""

    kind: ClassVar[str] = "disk_full"
    defaults: ClassVar[Mapping[str, Any]] = {
        "mode": "auto",
        "size_mb": 256,  # tmpfs size: must hold the job's checkpoints until the fault
    }

    def __init__(self, params: Mapping[str, Any] | None = None, **kwargs: Any) -> None:
        super().__init__(params, **kwargs)
        self.mode_ran: str | None = None
        self.fallback: str | None = None
        self.mount_point: Path | None = None
        self.filler: Filler | None = None
        self.filler_stats: dict[str, Any] = {}
        self.problems: list[str] = []
        self._ctx = None
        self._elapsed: Callable[[], float] | None = None

    @classmethod
    def validate(cls, params: Mapping[str, Any]) -> list[tuple[str, str]]:
        problems = super().validate(params)
        mode = params.get("mode", "auto")
        if mode not in MODES:
            problems.append(("mode", f"got {mode!r}; expected one of {', '.join(MODES)}"))
        size = params.get("size_mb", cls.defaults["size_mb"])
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            problems.append(("size_mb", f"got {size!r}; expected a whole number of MB >= 1"))
        return problems


    # -- life cycle --------------------------------------------------------------------------

    def setup(self, ctx: FaultContext) -> None:
        self._prepare(ctx)
        mode = self.params["mode"]
        if mode == "hook":
            self.mode_ran = "hook"
            return
        try:
            point = ctx.work_dir / "disk-full-tmpfs"
            mount_tmpfs(point, int(self.params["size_mb"]))
            self.mount_point = point
            checkpoints = point / "checkpoints"
            checkpoints.mkdir()
            if ctx.checkpoint_dir.is_dir() and any(ctx.checkpoint_dir.iterdir()):
                try:  # a drill resuming from existing checkpoints keeps them
                    shutil.copytree(ctx.checkpoint_dir, checkpoints, dirs_exist_ok=True)
                except OSError as exc:
                    raise FaultUnavailable(
                        f"the checkpoints in {ctx.checkpoint_dir} do not fit in a "
                        f"{self.params['size_mb']} MB tmpfs ({exc}); raise disk_full's size_mb"
                    ) from None
            ctx.checkpoint_dir = checkpoints
            self.mode_ran = "tmpfs"
        except FaultUnavailable as exc:
            self._unmount()
            if mode == "tmpfs":
                raise
            self.mode_ran, self.fallback = "hook", f"tmpfs mode unavailable: {exc}"

    def launch_env(self, ctx: FaultContext) -> dict[str, str]:
        if self.mode_ran != "hook":
            return {}
        spec = {
            "fault": "disk_full",
            "mode": "hook",
            "rank": None,  # a full disk is full for every rank
            "trigger": str(self.trigger),
            "events": str(self.events_path),
            "step": self.after_step,
            "dir": str(ctx.checkpoint_dir),
        }
        return hook_env(spec, ctx.env)

    def inject(self, launcher: Launcher) -> None:
        self.injected_at = launcher.elapsed()
        self._elapsed = launcher.elapsed
        if self.mode_ran == "tmpfs":
            assert self.mount_point is not None
            self.filler = Filler(self.mount_point)
            self.filler.start()
        else:
            pull_trigger(self.trigger)

    def clear(self) -> None:
        if self.injected_at is not None and self.cleared_at is None and self._elapsed:
            self.cleared_at = self._elapsed()
        if self.filler is not None:
            self.filler.stop()
            self.filler_stats = self.filler.stats()
            self.filler = None
        if self._ctx is not None:
            with contextlib.suppress(FileNotFoundError):
                self.trigger.unlink()

    def teardown(self) -> None:
        try:
            self.clear()
        finally:
            self._unmount()

    def _unmount(self) -> None:
        if self.mount_point is not None:
            problem = unmount(self.mount_point)
            if problem:
                self.problems.append(problem)
            self.mount_point = None

    # -- reporting ---------------------------------------------------------------------------

    def evidence(self) -> dict[str, Any]:
        out = super().evidence()
        out.update(mode=self.params["mode"], mode_ran=self.mode_ran,
                   size_mb=self.params["size_mb"] if self.mode_ran == "tmpfs" else None)
        if self._ctx is not None:
            out["checkpoint_dir"] = str(self._ctx.checkpoint_dir)
        if self.fallback:
            out["fallback"] = self.fallback
        if self.mode_ran == "tmpfs":
            out["filler"] = self.filler.stats() if self.filler is not None else self.filler_stats
        else:
            enospc = [e for e in self.hook_events() if e.get("event") == "enospc"]
            out["enospc_writes"] = len(enospc)
            out["enospc_paths"] = sorted({f"{e.get('path')} ({e.get('via')})" for e in enospc})[:10]
        if self.problems:
            out["problems"] = list(self.problems)
        return out

    def classify(self, result: RunResult) -> str:
        ranks = [self.rank, *[r for r in range(result.world_size) if r != self.rank]]
        for rank in ranks:
            text = rank_stderr(result, rank)
            torch_line = next((ln for ln in text.splitlines()
                               if any(m in ln for m in _TORCH_WRITE_FAILURES)), None)
            if torch_line is not None:
                return (f"ENOSPC: torch.save raised RuntimeError on rank {rank} "
                        f"({torch_line.strip()[:160]})")
            if "No space left on device" in text or "[Errno 28]" in text:
                return f"ENOSPC: OSError errno 28 (No space left on device) on rank {rank}"
        if result.ok:
            return "handled by the job (it completed despite the full disk)"
        return result.reason or result.outcome


class Filler(threading.Thread):
    """Fills a filesystem and keeps it full: every free block the job releases is written over
    again within about a millisecond."""

    def __init__(self, mount_point: Path, interval_s: float = 0.001) -> None:
        super().__init__(name="trainguard-disk-filler", daemon=True)
        self.path = mount_point / FILLER_NAME
        self.interval_s = interval_s
        self.started_at = time.monotonic()
        self.filled_bytes = 0
        self.full_at_s: float | None = None  # seconds after start
        self.takebacks = 0
        self.taken_back_bytes = 0
        self.error: str | None = None
        self._halt = threading.Event()
        self._full = threading.Event()

    def run(self) -> None:
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        except OSError as exc:
            self.error = str(exc)
            self._full.set()
            return
        try:
            while not self._halt.is_set():
                grabbed = self._grab(fd)
                if self._full.is_set():
                    if grabbed:
                        self.takebacks += 1
                        self.taken_back_bytes += grabbed
                else:
                    self.full_at_s = round(time.monotonic() - self.started_at, 4)
                    self._full.set()
                self._halt.wait(self.interval_s)
        finally:
            os.close(fd)

    def _grab(self, fd: int) -> int:
        grabbed = 0
        for size in (4 << 20, 256 << 10, 4 << 10):
            block = b"\0" * size
            while not self._halt.is_set():
                try:
                    written = os.write(fd, block)
                except OSError as exc:
                    if exc.errno != errno.ENOSPC:
                        self.error = str(exc)
                        self._halt.set()
                    break
                grabbed += written
                self.filled_bytes += written
                if written < size:
                    break
        return grabbed

    def wait_full(self, timeout: float = 30.0) -> bool:
        return self._full.wait(timeout)

    def stop(self, *, free: bool = True) -> None:
        """Stop filling; with ``free``, delete the filler file (the space is free again)."""
        self._halt.set()
        if self.is_alive():
            self.join(timeout=10)
        if free:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()

    def stats(self) -> dict[str, Any]:
        return {"filled_mb": round(self.filled_bytes / 2**20, 2), "full_after_s": self.full_at_s,
                "takebacks": self.takebacks,
                "taken_back_kb": round(self.taken_back_bytes / 1024, 1), "error": self.error}


# -- mounts --------------------------------------------------------------------------------------

_live_mounts: set[str] = set()


def mount_tmpfs(point: Path, size_mb: int) -> None:
    """Mount a tmpfs of ``size_mb`` at ``point`` (FaultUnavailable when that is not possible)."""
    if os.geteuid() != 0:
        raise FaultUnavailable("mounting a tmpfs needs root; disk_full's mode: hook needs none")
    if shutil.which("mount") is None:
        raise FaultUnavailable("no `mount` command on PATH; use disk_full's mode: hook")
    point.mkdir(parents=True, exist_ok=True)
    try:
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size_mb}m,mode=0777", MOUNT_SOURCE, str(point)],
            capture_output=True, text=True, timeout=30, check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise FaultUnavailable(f"mount -t tmpfs failed: {exc}; use disk_full's mode: hook") from None
    if done.returncode != 0:
        raise FaultUnavailable(
            f"mount -t tmpfs at {point} failed: {(done.stderr or done.stdout).strip()}; "
            "use disk_full's mode: hook"
        )
    _live_mounts.add(str(point))


def is_mounted(point: Path) -> bool:
    target = os.path.realpath(point)
    try:
        lines = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return False
    return any(len(f) > 1 and f[1] == target for f in (ln.split() for ln in lines))


def unmount(point: Path) -> str | None:
    """Unmount ``point`` (lazily when busy) and remove the directory; the problem, if any."""
    problem = None
    if is_mounted(point):
        for argv in (["umount", str(point)], ["umount", "-l", str(point)]):
            try:
                subprocess.run(argv, capture_output=True, timeout=30, check=False)
            except (OSError, subprocess.TimeoutExpired) as exc:
                problem = f"{' '.join(argv)}: {exc}"
            if not is_mounted(point):
                problem = None
                break
        else:
            problem = problem or f"{point} is still mounted after umount -l"
    _live_mounts.discard(str(point))
    with contextlib.suppress(OSError):
        point.rmdir()
    return problem


@atexit.register
def _unmount_leftovers() -> None:
    # the drill's finally unmounts; this covers an interpreter that exits some other way
    for point in list(_live_mounts):
        unmount(Path(point))


