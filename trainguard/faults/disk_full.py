"""The ``disk_full`` fault: from step k on, no write under the checkpoint directory succeeds.

Modes (``mode`` parameter; ``auto``, the default, runs ``fuse`` where a FUSE file system can be
mounted and ``hook`` otherwise; :meth:`DiskFullFault.evidence` says which ran and why):

* ``fuse`` (root, /dev/fuse, libfuse, mfusepy): :meth:`~DiskFullFault.setup` mounts a
  passthrough FUSE layer (:mod:`trainguard.faults.fusefs`) over the checkpoint directory; from
  the trigger on, the kernel answers every call that would take space — ``write``, growing
  ``truncate``, ``fallocate``, ``mkdir`` — with ENOSPC, from any process and any writer
  (torch.save's C++ writer, safetensors, ``cp``), however much space the job frees first (a
  rename over the old checkpoint, a delete, a truncation). Deterministic: an atomic writer's
  temp file can never be completed; an in-place writer's truncated file stays torn.
* ``hook``: the start-up hook makes every write to a file under the checkpoint directory fail
  with ENOSPC from step k, while opening and truncating still succeed (the file descriptor is
  pointed at /dev/full: the kernel's own ENOSPC); ``torch.save`` to a path creates/truncates the
  file and raises torch's RuntimeError. Deterministic for Python and torch.save writes; needs
  no root. Every rank is affected, as every rank shares a full disk.
* ``tmpfs``: the former racing mode (a size-limited tmpfs kept full by a filler thread) could
  lose the race to a small atomic checkpoint; it now runs ``fuse`` (the evidence says so).

See docs/faults-memory-and-disk.md.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from trainguard.config.fault_params import FaultParams
from trainguard.config.faults import Expectation
from trainguard.evidence import UNSET, Unset
from trainguard.faults.base import FaultContext, FaultEvidence, FaultUnavailable
from trainguard.faults.fusefs import fuse_unavailable
from trainguard.faults.fusemount import FuseFault
from trainguard.faults.hook import HookFault, pull_trigger, rank_stderr
from trainguard.launch.hook import hook_env
from trainguard.report import SkipReason

if TYPE_CHECKING:  # pragma: no cover
    from trainguard.launch import Launcher, RunResult

__all__ = ["DiskFullEvidence", "DiskFullFault"]

MODES = ("auto", "fuse", "hook", "tmpfs")
#: what torch.save writes on ENOSPC, by version: it does not always say ENOSPC
_TORCH_WRITE_FAILURES = ("PytorchStreamWriter failed", "file write failed", "unexpected pos",
                         "inline_container.cc", "basic_ios::clear")


@functools.lru_cache(maxsize=1)
def _fuse_unavailable() -> str | None:
    return fuse_unavailable()


@dataclass
class DiskFullEvidence(FaultEvidence):
    """What a ``disk_full`` fault ran (the mode asked for, the one that ran, why another) and
    the writes it failed: the FUSE layer's calls (fuse) or the hook's writes (hook)."""

    mode: str
    mode_ran: str | None
    checkpoint_dir: str | Unset = UNSET
    fallback: str | Unset = UNSET
    note: str | Unset = UNSET
    #: fuse: the calls answered ENOSPC
    enospc_calls: int | Unset = UNSET
    #: hook: the writes failed with ENOSPC
    enospc_writes: int | Unset = UNSET
    #: the first 10 paths (and call or writer) that got ENOSPC
    enospc_paths: list[str] | Unset = UNSET
    backing_dir: str | Unset = UNSET
    problems: list[str] | Unset = UNSET


class DiskFullFault(HookFault, FuseFault):
    """The checkpoint directory's disk is full from step ``after_step`` on."""

    kind: ClassVar[str] = "disk_full"
    expectations: ClassVar[tuple[Expectation, ...]] = (Expectation.FAIL_CLEAN, Expectation.RECOVER, Expectation.CONTINUE)
    defaults: ClassVar[FaultParams] = FaultParams({
        "mode": "auto",
        "size_mb": 256,  # accepted for job files written for the former tmpfs mode; unused
    })

    def __init__(self, params: FaultParams | None = None, **kwargs: Any) -> None:
        super().__init__(params, **kwargs)
        self.mode_ran: str | None = None
        self.fallback: str | None = None
        self.note: str | None = None
        self._ctx = None

    @classmethod
    def validate(cls, params: FaultParams) -> list[tuple[str, str]]:
        problems = super().validate(params)
        mode = params.raw("mode", "auto")
        if mode not in MODES:
            problems.append(("mode", f"got {mode!r}; expected one of {', '.join(MODES)}"))
        size = params.raw("size_mb", cls.defaults.raw("size_mb"))
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            problems.append(("size_mb", f"got {size!r}; expected a whole number of MB >= 1"))
        return problems

    # -- life cycle --------------------------------------------------------------------------

    def setup(self, ctx: FaultContext) -> None:
        self._prepare(ctx)
        mode = self.params.text("mode")
        if mode == "tmpfs":
            self.note = ("mode tmpfs (a filler racing the job for the space) is replaced by "
                         "fuse, which fails every write deterministically")
        if mode == "hook":
            self.mode_ran = "hook"
            return
        why = self.mount_over_checkpoints(ctx, "disk-full-fuse", policy="disk_full",
                                          unavailable=_fuse_unavailable())
        if why is None:
            self.mode_ran = "fuse"
            return
        if mode != "auto":
            raise FaultUnavailable(f"{why}; disk_full's mode: hook needs none of it",
                                       needs=SkipReason.NEEDS_ROOT)
        self.mode_ran, self.fallback = "hook", f"fuse mode unavailable: {why}"

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
        if self.layer is not None:
            self.layer.arm()
        else:
            pull_trigger(self.trigger)

    def clear(self) -> None:
        if self.layer is not None:
            self.layer.disarm()
        if self._ctx is not None:
            with contextlib.suppress(FileNotFoundError):
                self.trigger.unlink()

    # -- reporting ---------------------------------------------------------------------------

    def evidence(self) -> DiskFullEvidence:
        out = DiskFullEvidence(*self.struck(), mode=self.params.text("mode"), mode_ran=self.mode_ran,
                               fallback=self.fallback or UNSET, note=self.note or UNSET,
                               problems=list(self.problems) or UNSET)
        if self._ctx is not None:
            out.checkpoint_dir = str(self._ctx.checkpoint_dir)
        if self.layer is not None:
            events = [e for e in self.layer.read_events() if e.get("event") == "enospc"]
            out.enospc_calls = len(events)
            out.enospc_paths = sorted({f"{e.get('path')} ({e.get('op')})" for e in events})[:10]
            out.backing_dir = str(self.layer.backing)
        else:
            enospc = [e for e in self.hook_events() if e.get("event") == "enospc"]
            out.enospc_writes = len(enospc)
            out.enospc_paths = sorted({f"{e.get('path')} ({e.get('via')})" for e in enospc})[:10]
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
