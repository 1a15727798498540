"""``kill_during_save``: rank ``rank`` is killed (SIGKILL) while it writes a checkpoint.

A passthrough FUSE layer (:mod:`trainguard.faults.fusefs`, policy ``rules``) lies over the
checkpoint directory from the start. After step ``after_step`` the fault arms a *hold*: the first
write under the checkpoint directory by the rank's process (or a process it started: a
DataLoader worker, a saver thread's process) blocks inside the layer's daemon, which records the
file and the caller's pid (``fuse_get_context``). The fault then sends SIGKILL to that process
and to the rank, and releases the held write with EIO. A process blocked in a FUSE request that
the daemon has already taken dies only when the daemon answers (the kernel waits for the reply
uninterruptibly): so the kill goes first, the release second, and the write's data never reaches
the disk, whichever writer made it (torch.save's C++ writer included). The drill then resumes:
``recover`` (trainguard restarts the group from the latest checkpoint) or ``fail_clean``.

Without root, /dev/fuse, libfuse or mfusepy the drill is skipped with the reason.
See docs/faults-memory-and-disk.md.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from trainguard.config.fault_params import FaultParams
from trainguard.evidence import UNSET, Evidence, Unset
from trainguard.faults.base import FaultContext, FaultEvidence, FaultUnavailable
from trainguard.faults.fusefs import fuse_unavailable
from trainguard.faults.fusemount import FuseFault
from trainguard.faults.storage import newest_checkpoint_files
from trainguard.report import SkipReason

if TYPE_CHECKING:  # pragma: no cover
    from trainguard.launch import Launcher, RunResult

__all__ = ["HeldWrite", "KillDuringSaveEvidence", "KillDuringSaveFault", "LatestComplete"]

_POLL_S = 0.005


@dataclass
class HeldWrite(Evidence):
    """The checkpoint write the FUSE layer held when the rank was killed: the file, the calling
    process and thread (as the layer saw them), the rank's pid and when the hold began."""

    path: str | None
    pid: int | None
    tid: int | None
    rank_pid: int
    held_after_s: float | None


@dataclass
class LatestComplete(Evidence):
    """The newest complete checkpoint the killed rank had left (its name and step) at the kill."""

    checkpoint: str | None
    step: int | None


@dataclass
class KillDuringSaveEvidence(FaultEvidence):
    """The write the ``kill_during_save`` fault caught, the kill, and what was left complete."""

    mechanism: str
    held_write: HeldWrite | None
    killed: list[int]
    kill_to_exit_s: float | None
    waited_for_write_s: float | None
    no_write: str | None
    latest_complete_at_kill: LatestComplete | None
    #: how long the write was held before the kill released it
    held_for_s: float | Unset | None = UNSET
    problems: list[str] | Unset = UNSET


class KillDuringSaveFault(FuseFault):
    """SIGKILL rank ``rank`` while its first checkpoint write after ``after_step`` is in flight."""

    kind: ClassVar[str] = "kill_during_save"
    #: wait: seconds after step k for the rank's next checkpoint write
    defaults: ClassVar[FaultParams] = FaultParams({"wait": 60.0})

    def __init__(self, params: FaultParams | None = None, **kwargs: Any) -> None:
        super().__init__(params, **kwargs)
        self.backing: Path | None = None
        self.held: HeldWrite | None = None
        self.killed: list[int] = []
        self.kill_to_exit_s: float | None = None
        self.latest_complete: LatestComplete | None = None
        self.waited_s: float | None = None
        self.no_write: str | None = None  # why no write was caught
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def validate(cls, params: FaultParams) -> list[tuple[str, str]]:
        problems = super().validate(params)
        wait = params.raw("wait", 60.0)
        if isinstance(wait, bool) or not isinstance(wait, (int, float)) or not 0 < wait <= 3600:
            problems.append(("wait", "expected the seconds to wait after after_step for the rank's "
                             "next checkpoint write, more than 0 and at most 3600, e.g. `wait: 30`"))
        return problems

    def setup(self, ctx: FaultContext) -> None:
        backing = ctx.checkpoint_dir
        why = self.mount_over_checkpoints(ctx, "save-fuse", policy="rules", unavailable=fuse_unavailable())
        if why is None:
            self.backing = backing
            return
        raise FaultUnavailable(f"{why}; kill_during_save holds the rank's checkpoint write in a FUSE "
                               "layer over the checkpoint directory (root, /dev/fuse, libfuse3, mfusepy)",
                               needs=SkipReason.NEEDS_ROOT)

    def inject(self, launcher: Launcher) -> None:
        assert self.layer is not None
        self.injected_at = launcher.elapsed()
        pid = launcher.ranks[self.rank].pid
        self.layer.arm({"hold": {"op": "write", "pid": pid, "max_s": float(self.params.number("wait")) + 30}})
        self._thread = threading.Thread(target=self._follow, args=(launcher, pid),
                                        name="trainguard-kill-during-save", daemon=True)
        self._thread.start()

    def _follow(self, launcher: Launcher, pid: int) -> None:
        assert self.layer is not None
        started = time.monotonic()
        wait = float(self.params.number("wait"))
        rp = launcher.ranks[self.rank]
        while not self._stop.wait(_POLL_S):
            held = next((e for e in self.layer.read_events() if e.get("event") == "held"), None)
            if held is not None:
                break
            if rp.popen.poll() is not None or time.monotonic() - started > wait:
                self.waited_s = round(time.monotonic() - started, 3)
                self.no_write = (f"the rank exited {self.waited_s:g} s after step {self.after_step} without "
                                 "writing under the checkpoint directory" if rp.popen.poll() is not None
                                 else f"no write under the checkpoint directory within params.wait "
                                 f"({wait:g} s) after step {self.after_step}")
                self.layer.disarm()
                return
        else:
            return
        self.waited_s = round(time.monotonic() - started, 3)
        self.held = HeldWrite(held.get("path"), held.get("pid"), held.get("tid"), pid, self.waited_s)
        caller = int(held.get("pid") or pid)
        killed_at = time.monotonic()
        if caller != pid:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(caller, signal.SIGKILL)
        launcher.kill_rank(self.rank, signal.SIGKILL)
        self.killed = [self.rank]
        self.layer.disarm()  # the daemon answers: the killed caller dies inside its write
        while rp.popen.poll() is None and time.monotonic() - killed_at < 10:
            time.sleep(_POLL_S)
        self.kill_to_exit_s = round(time.monotonic() - killed_at, 3)
        if self.backing is not None:
            found, step, _ = newest_checkpoint_files(self.backing, self.rank, own_rank=True)
            self.latest_complete = LatestComplete(None if found is None else found.name, step)

    def clear(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=15)
        if self.layer is not None:
            self.layer.disarm()

    def evidence(self) -> KillDuringSaveEvidence:
        out = KillDuringSaveEvidence(
            *self.struck(), mechanism="fuse: a hold on the rank's first checkpoint write",
            held_write=self.held, killed=self.killed, kill_to_exit_s=self.kill_to_exit_s,
            waited_for_write_s=self.waited_s, no_write=self.no_write,
            latest_complete_at_kill=self.latest_complete, problems=list(self.problems) or UNSET)
        if self.layer is not None:
            released = [e for e in self.layer.read_events() if e.get("event") == "released"]
            if released:
                out.held_for_s = released[0].get("after_s")
        return out

    def classify(self, result: RunResult) -> str:
        from trainguard.faults.hook import rank_stderr

        killed = any(e.rank == self.rank and e.signal == "SIGKILL" for e in result.exits)
        if self.held is not None and killed and result.failed_rank == self.rank:
            return (f"rank {self.rank} killed (SIGKILL) while writing {self.held.path} under the "
                    "checkpoint directory")
        if not result.ok and result.failed_rank is not None:
            lines = [ln.strip() for ln in rank_stderr(result, result.failed_rank).splitlines() if ln.strip()]
            if lines:
                return f"{result.reason or result.outcome}: {lines[-1][:200]}"
        if self.held is None and self.no_write is not None:
            return f"rank {self.rank}: {self.no_write}"
        return result.reason or result.outcome
