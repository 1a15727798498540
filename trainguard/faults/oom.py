"""The ``oom`` fault: a rank runs out of memory for real, and the report says how it ended.

Modes (``mode`` parameter; ``auto``, the default, runs ``cgroup`` where memory cgroups are usable
and ``rlimit`` elsewhere; :meth:`OomFault.evidence` says which ran and why):

* ``cgroup`` (root): every rank is put in its own memory cgroup before it execs; after step k
  the target's limit is set just above its usage and the start-up hook's ballast allocates past
  it, so the kernel's OOM killer SIGKILLs the rank. Evidence: the cgroup's failcnt / oom_kill.
* ``rlimit``: after step k the target's RLIMIT_AS is set (prlimit) to its address space plus
  ``headroom_mb`` and the hook's ballast takes all but ``slack_mb`` of it: the job's next
  sizeable allocation fails in the job's own code (torch: ``RuntimeError: DefaultCPUAllocator:
  can't allocate memory``; Python: ``MemoryError``). Not set at exec: the job could not start.
* ``raise``: the hook raises ``torch.OutOfMemoryError`` in the rank's main thread after step k,
  to test the job's own OOM handling.
* ``gpu``: after step k the hook empties the rank's CUDA cache (its next step must allocate
  anew) and takes the device's memory: with ``gpu_limit: fraction`` (the default) it caps the
  caching allocator with ``torch.cuda.set_per_process_memory_fraction`` at ``headroom_mb`` above
  what the rank holds and fills the rest, which leaves the GPU's other processes alone; with
  ``gpu_limit: device`` it fills the device itself until ``cudaMalloc`` fails, as a real
  neighbour or a leak would. The job's next allocation raises ``torch.OutOfMemoryError: CUDA
  out of memory``.

See docs/faults-memory-and-disk.md.
"""

from __future__ import annotations

import contextlib
import os
import resource
import shutil
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from trainguard.config.fault_params import FaultParams
from trainguard.config.faults import Expectation
from trainguard.evidence import UNSET, Unset
from trainguard.faults.base import FaultContext, FaultEvidence, FaultUnavailable
from trainguard.faults.cgroups import CgroupCounters, MemoryCgroups
from trainguard.faults.hook import HookFault, pull_trigger, rank_stderr
from trainguard.launch.hook import hook_env
from trainguard.report import SkipReason

if TYPE_CHECKING:  # pragma: no cover
    from trainguard.launch import Launcher, RunResult

__all__ = ["OomEvidence", "OomFault"]

MODES = ("auto", "cgroup", "rlimit", "raise", "gpu")
GPU_LIMITS = ("fraction", "device")
_HOOK_MODE = {"cgroup": "ballast", "rlimit": "rlimit", "raise": "raise", "gpu": "gpu"}


@dataclass
class OomEvidence(FaultEvidence):
    """What an ``oom`` fault ran (the mode asked for, the one that ran, why another), the limit
    it set and what the kernel's counters and the start-up hook said."""

    mode: str
    mode_ran: str | None
    hook_armed: bool
    hook_fired: bool
    #: the hook's last 10 events, as it wrote them (its argv left out)
    hook_events: list[dict[str, Any]]
    fallback: str | Unset = UNSET
    limit_mb: float | Unset = UNSET
    cgroup: str | Unset = UNSET
    cgroup_version: int | Unset = UNSET
    cgroup_counters: dict[str, int | None] | Unset = UNSET
    problems: list[str] | Unset = UNSET


class OomFault(HookFault):
    """Real memory exhaustion of rank ``rank`` after step ``after_step``."""

    kind: ClassVar[str] = "oom"
    expectations: ClassVar[tuple[Expectation, ...]] = (Expectation.FAIL_CLEAN, Expectation.RECOVER, Expectation.CONTINUE)
    defaults: ClassVar[FaultParams] = FaultParams({
        "mode": "auto",
        "headroom_mb": 32,  # the limit is set this far above the rank's usage at injection
        "chunk_mb": 8,  # ballast allocation size
        "max_ballast_mb": 2048,  # safety net: the ballast never holds more than this
        "slack_mb": 4,  # rlimit: address space the ballast leaves for the job to trip over
        "gpu_limit": "fraction",  # gpu: cap the rank's allocator (fraction) or fill the device
    })

    def __init__(self, params: FaultParams | None = None, **kwargs: Any) -> None:
        super().__init__(params, **kwargs)
        self.mode_ran: str | None = None
        self.fallback: str | None = None
        self.cgroups: MemoryCgroups | None = None
        self.limit_bytes: int | None = None
        self.problems: list[str] = []
        self._ctx = None
        self._elapsed: Callable[[], float] | None = None
        self._thread: threading.Thread | None = None
        self._target_pid: int | None = None
        self._rlimit_before: tuple[int, int] | None = None
        self._ranks_are_children = True

    @classmethod
    def validate(cls, params: FaultParams) -> list[tuple[str, str]]:
        problems = super().validate(params)
        mode = params.raw("mode", "auto")
        if mode not in MODES:
            problems.append(("mode", f"got {mode!r}; expected one of {', '.join(MODES)}"))
        limit = params.raw("gpu_limit", "fraction")
        if limit not in GPU_LIMITS:
            problems.append(("gpu_limit", f"got {limit!r}; expected one of {', '.join(GPU_LIMITS)}"))
        for key in ("headroom_mb", "chunk_mb", "max_ballast_mb", "slack_mb"):
            value = params.raw(key, cls.defaults.raw(key))
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                problems.append((key, f"got {value!r}; expected a positive number of MB"))
        return problems

    # -- life cycle --------------------------------------------------------------------------

    def setup(self, ctx: FaultContext) -> None:
        self._prepare(ctx)
        self._ranks_are_children = ctx.backend.ranks_are_children()
        mode = self.params.text("mode")
        if mode in ("auto", "cgroup"):
            try:
                cgroups = MemoryCgroups(ctx.world_size)
                cgroups.create()
                self.cgroups, self.mode_ran = cgroups, "cgroup"
            except FaultUnavailable as exc:
                if mode == "cgroup":
                    raise
                self.mode_ran, self.fallback = "rlimit", f"cgroup mode unavailable: {exc}"
        elif mode == "gpu":
            if not (Path("/dev/nvidia0").exists() or shutil.which("nvidia-smi")):
                raise FaultUnavailable(
                    "oom mode gpu needs an NVIDIA GPU (no /dev/nvidia0, no nvidia-smi); use "
                    "mode: cgroup or rlimit on CPU machines", needs=SkipReason.NEEDS_GPU,
                )
            self.mode_ran = "gpu"
        else:
            self.mode_ran = mode

    def launch_env(self, ctx: FaultContext) -> dict[str, str]:
        assert self.mode_ran is not None, "setup() first"
        spec = {
            "fault": "oom",
            "mode": _HOOK_MODE[self.mode_ran],
            # a Ray worker has no RANK when the hook starts: every worker arms, and the trigger
            # names the target's pid (a restarted worker group is never hit)
            "rank": self.rank if ctx.backend.rank_at_start() else None,
            "trigger": str(self.trigger),
            "events": str(self.events_path),
            "step": self.after_step,
            "chunk_mb": self.params.number("chunk_mb"),
            "max_mb": self.params.number("headroom_mb") + self.params.number("max_ballast_mb"),
            "slack_mb": self.params.number("slack_mb"),
            "headroom_mb": self.params.number("headroom_mb"),
            "gpu_limit": self.params.text("gpu_limit"),
        }
        return hook_env(spec, ctx.env)

    def preexec(self, rank: int) -> None:
        if self.cgroups is not None and self._ranks_are_children:
            # a failure cannot be reported from here; inject() checks the rank is inside
            with contextlib.suppress(OSError):
                self.cgroups.join(rank)

    def inject(self, launcher: Launcher) -> None:
        self.injected_at = launcher.elapsed()
        self._elapsed = launcher.elapsed
        self._target_pid = launcher.ranks[self.rank].pid
        self._thread = threading.Thread(
            target=self._inject, args=(self._target_pid,), name="trainguard-oom", daemon=True
        )
        self._thread.start()

    def _inject(self, pid: int) -> None:
        headroom = int(self.params.number("headroom_mb") * 2**20)
        try:
            if self.mode_ran == "cgroup":
                assert self.cgroups is not None
                if not self._ranks_are_children:  # a Ray worker: not ours to join at exec, joins now
                    self.cgroups.move(self.rank, pid)
                if pid not in self.cgroups.pids(self.rank):
                    self.problems.append(
                        f"rank {self.rank} (pid {pid}) is not in its cgroup "
                        f"{self.cgroups.path(self.rank)}: the fault was not injected"
                    )
                    return
                self.limit_bytes = self.cgroups.set_limit_above_usage(self.rank, headroom)
            elif self.mode_ran == "rlimit":
                soft, hard = resource.prlimit(pid, resource.RLIMIT_AS)
                self._rlimit_before = (soft, hard)
                limit = _vm_size(pid) + headroom
                if hard != resource.RLIM_INFINITY:
                    limit = min(limit, hard)
                resource.prlimit(pid, resource.RLIMIT_AS, (limit, hard))
                self.limit_bytes = limit
            pull_trigger(self.trigger, pid)
        except (OSError, ValueError) as exc:  # the rank died meanwhile, or the kernel said no
            self.problems.append(f"injecting oom ({self.mode_ran}) failed: {exc}")

    def clear(self) -> None:
        if self.cleared_at is None and self.injected_at is not None and self._elapsed:
            self.cleared_at = self._elapsed()
        if self._thread is not None:
            self._thread.join(timeout=10)
        if self._ctx is not None:
            with contextlib.suppress(FileNotFoundError):
                self.trigger.unlink()
        if self.cgroups is not None:
            self.cgroups.lift_limit(self.rank)
            with contextlib.suppress(OSError):
                self.cgroups.counters(self.rank)
        if self._rlimit_before is not None and self._target_pid is not None:
            with contextlib.suppress(OSError):
                resource.prlimit(self._target_pid, resource.RLIMIT_AS, self._rlimit_before)
            self._rlimit_before = None

    def teardown(self) -> None:
        try:
            self.clear()
        finally:
            if self.cgroups is not None:
                self.problems.extend(self.cgroups.teardown())

    # -- reporting ---------------------------------------------------------------------------

    def evidence(self) -> OomEvidence:
        events = self.hook_events()
        names = [e.get("event") for e in events]
        out = OomEvidence(
            *self.struck(),
            mode=self.params.text("mode"),
            mode_ran=self.mode_ran,
            hook_armed="armed" in names,
            hook_fired="triggered" in names,
            hook_events=[{k: v for k, v in e.items() if k not in ("argv",)} for e in events][-10:],
            fallback=self.fallback or UNSET, problems=list(self.problems) or UNSET,
        )
        if self.limit_bytes is not None:
            out.limit_mb = round(self.limit_bytes / 2**20, 1)
        if self.cgroups is not None:
            out.cgroup = str(self.cgroups.path(self.rank))
            out.cgroup_version = self.cgroups.version
            counters = self._counters()
            if counters is not None:
                out.cgroup_counters = counters.as_dict()
        return out

    def _counters(self) -> CgroupCounters | None:
        if self.cgroups is None:
            return None
        with contextlib.suppress(OSError):
            self.cgroups.counters(self.rank)
        return self.cgroups.last_counters.get(self.rank)

    def classify(self, result: RunResult) -> str:
        if not self._ranks_are_children:  # a Ray worker: Ray's record says how it ended
            return self._classify_ray(result)
        exit_ = next((e for e in result.exits if e.rank == self.rank), None)
        stderr = rank_stderr(result, self.rank)
        counters = self._counters()
        fired = any(e.get("event") == "triggered" for e in self.hook_events())
        if exit_ is not None and exit_.signal == "SIGKILL" and not exit_.killed_by_trainguard:
            if counters is not None and (counters.oom_kill or 0) > 0:
                return (f"killed by the kernel OOM killer (SIGKILL; cgroup oom_kill="
                        f"{counters.oom_kill}, failcnt={counters.failcnt})")
            return "killed by SIGKILL, not counted as an OOM kill in its cgroup"
        if exit_ is not None and exit_.returncode == 0:
            if fired:
                return "handled by the job (it kept going and exited 0)"
            return "the fault never fired (the job ended before the trigger, or the hook was not loaded)"
        if "CUDA out of memory" in stderr:
            return "CUDA OOM (torch.OutOfMemoryError: CUDA out of memory)"
        if "DefaultCPUAllocator" in stderr or "can't allocate memory" in stderr:
            return "allocator error (RuntimeError DefaultCPUAllocator: can't allocate memory)"
        if "OutOfMemoryError" in stderr:
            return "torch.OutOfMemoryError raised (not handled by the job)"
        if "MemoryError" in stderr:
            return "Python MemoryError raised (not handled by the job)"
        if exit_ is not None and exit_.signal and not exit_.killed_by_trainguard:
            return f"killed by {exit_.signal}"
        return result.reason or result.outcome

    def _classify_ray(self, result: RunResult) -> str:
        """How a Ray Train job's driver ended after its worker ran out of memory."""
        counters = self._counters()
        if counters is not None and (counters.oom_kill or 0) > 0:
            how = (f"the Ray worker of rank {self.rank} was killed by the kernel OOM killer "
                   f"(cgroup oom_kill={counters.oom_kill}, failcnt={counters.failcnt})")
        else:
            stderr = rank_stderr(result, 0)
            how = next((f"the Ray worker of rank {self.rank} raised {name}" for name in
                        ("torch.OutOfMemoryError", "OutOfMemoryError", "MemoryError",
                         "DefaultCPUAllocator") if name in stderr),
                       f"the Ray worker of rank {self.rank} ran out of memory")
        if result.ok:
            return f"{how}; the fit completed"
        return f"{how}; the fit failed ({result.reason or result.outcome})"


def _vm_size(pid: int) -> int:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")


