"""The contract between a drill and the fault it injects.

A drill (:mod:`trainguard.drills`) runs a small supervised run of the user's job and drives one
:class:`Fault` through its life:

1. :meth:`Fault.setup` once, before the first attempt: mount a tmpfs, create cgroups, start a
   proxy. It may change where checkpoints go (:attr:`FaultContext.checkpoint_dir`) and raises
   :class:`FaultUnavailable` when this machine cannot host the real fault (not root, no cgroup
   controller, ...); the drill then runs the documented fallback or skips, saying why.
2. :meth:`Fault.launch_env` and :meth:`Fault.preexec` shape every rank's process of every attempt
   (e.g. the start-up hook on PYTHONPATH, joining a cgroup before exec).
3. :meth:`Fault.inject` once, on the launcher's monitor thread, as soon as the target rank has
   printed step ``after_step`` (first attempt only). It must return quickly (start a thread for
   anything slow).
4. :meth:`Fault.clear` when the fault should end: after ``duration`` seconds when one is set, and
   always before a verification run (e.g. the fail_clean resume run without the fault).
5. :meth:`Fault.teardown` always, in ``finally`` (Ctrl-C included): unmount, delete cgroups, stop
   servers. Idempotent.

:meth:`Fault.evidence` says what happened (mode that ran, counters read, fallbacks),
:meth:`Fault.classify` names how a failed attempt ended for the report, and
:meth:`Fault.verify_continue` adds the fault's own checks to an ``expect: continue`` drill.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from trainguard.config.fault_params import FaultParams
from trainguard.config.faults import Expectation
from trainguard.errors import TrainguardError
from trainguard.evidence import Evidence
from trainguard.launch.backend import CommandBackend, JobBackend
from trainguard.report import SkipReason

if TYPE_CHECKING:  # pragma: no cover
    from trainguard.config import DrillSpec
    from trainguard.config.registry import Run
    from trainguard.launch import Launcher, RunResult

__all__ = ["Fault", "FaultContext", "FaultEvidence", "FaultUnavailable"]


class FaultUnavailable(TrainguardError):
    """This machine cannot inject the real fault (the message says why and what would allow it);
    ``needs`` says what it lacks, as the gate decides on it (the drill is skipped with it)."""

    def __init__(self, message: str, *, needs: SkipReason = SkipReason.UNAVAILABLE) -> None:
        super().__init__(message)
        self.needs = needs


@dataclass
class FaultEvidence(Evidence):
    """What a fault did, for the drill's report (``fault_evidence``): where and when it struck.
    Each fault's record extends it with what it alone knows (mode that ran, counters,
    fallbacks), written after these keys."""

    fault: str
    rank: int
    after_step: int
    #: the launcher's elapsed seconds when it struck, and when it was cleared
    injected_at_s: float | None
    cleared_at_s: float | None


@dataclass
class FaultContext:
    """What a fault knows about the drill it serves."""

    #: a directory the fault owns for this drill (trigger files, logs, its own state)
    work_dir: Path
    #: the checkpoint directory every attempt of the drill uses; :meth:`Fault.setup` may replace it
    #: (disk_full puts it on a size-limited tmpfs)
    checkpoint_dir: Path
    world_size: int
    #: the job's environment for the ranks (after placeholders), for faults that wrap services
    env: dict[str, str] = field(default_factory=dict)
    #: how the job's ranks run (the runner's backend). Its :meth:`~trainguard.launch.backend.
    #: JobBackend.fault_reach` says how a fault reaches them: a ``kind: ray_train`` job's ranks are
    #: Ray Train workers, not children of the launched process (the driver): :meth:`Fault.inject`
    #: gets a launcher whose ``ranks`` are the workers (a :class:`~trainguard.launch.reach.
    #: RemoteRanks`), :meth:`Fault.preexec` is not used, and the start-up hook reaches the workers
    #: through the driver's ``runtime_env`` (without a ``RANK`` at start-up: target them by pid)
    backend: JobBackend = field(default_factory=CommandBackend)


class Fault:
    """Base class of every fault kind; subclasses set :attr:`kind` and override the hooks they need.

    ``params`` are the fault's own parameters from the drill spec (validated by the subclass's
    :meth:`validate`); ``rank``/``after_step``/``duration`` say where and when.
    """

    kind: ClassVar[str] = ""
    #: the fault acts on what every rank shares (the checkpoint directory), so it strikes once
    #: every rank that reports the metric has printed ``after_step``, not the watched rank
    #: alone: ranks without a barrier drift apart on a loaded machine, and a lagging rank's
    #: earlier save is not what the drill means to strike
    strikes_every_rank: ClassVar[bool] = False
    #: parameters this fault accepts, with their defaults (documented in docs/faults-memory-and-disk.md, docs/faults-network.md, docs/drills.md)
    defaults: ClassVar[FaultParams] = FaultParams()
    #: the expectations a drill of this fault may be judged by (docs/drills.md), the default
    #: (when the spec names none) first
    expectations: ClassVar[tuple[Expectation, ...]] = (
        Expectation.RECOVER, Expectation.FAIL_CLEAN, Expectation.CONTINUE)
    #: narrower lists for some values of ``params.kind`` (a slow disk is judged by continue only)
    kind_expectations: ClassVar[Mapping[str, tuple[Expectation, ...]]] = {}

    def __init__(
        self,
        params: FaultParams | None = None,
        *,
        rank: int = 0,
        after_step: int = 1,
        duration: float | None = None,
    ) -> None:
        self.params = (params or FaultParams()).over(self.defaults)
        self.rank = rank
        self.after_step = after_step
        self.duration = duration
        self.injected_at: float | None = None  # launcher elapsed seconds at injection
        self.cleared_at: float | None = None

    @classmethod
    def validate(cls, params: FaultParams) -> list[tuple[str, str]]:
        """Problems with ``params`` as ``(key, message with the fix)`` pairs; empty when valid."""
        unknown = sorted(set(params) - set(cls.defaults))
        return [(key, f"unknown parameter for fault {cls.kind!r}; expected one of "
                 f"{', '.join(sorted(cls.defaults)) or '(none)'}") for key in unknown]

    @classmethod
    def expectations_for(cls, params: FaultParams) -> tuple[Expectation, ...]:
        """The expectations a drill with these ``params`` may be judged by, its default first."""
        return cls.kind_expectations.get(str(params.raw("kind")), cls.expectations)

    #: a composite fault injects nothing itself: its drill is run by this ``"module:function"``
    #: (called with the job runner and the drill spec, returning the drill's CheckResult) instead
    #: of the one-fault driver; the soak's schedule of faults is one
    drill_runner: ClassVar[str | None] = None
    #: drill-spec keys that do not apply to this fault, and why (a soak strikes where its
    #: schedule says, so ``after_step`` and ``duration`` would mislead)
    spec_keys_not_applying: ClassVar[tuple[tuple[str, ...], str]] = ((), "")

    @classmethod
    def drill_runs(cls, spec: DrillSpec, world_size: int, seed: int | None) -> tuple[list[Run], str] | None:
        """The runs a drill of this fault makes, as ``trainguard validate`` lists them, and its
        words; None for the usual ones (a reference, the faulted run, a resumed run)."""
        return None

    @classmethod
    def drill_items(cls, spec: DrillSpec, seed: int | None) -> list[tuple[str, DrillSpec]]:
        """The pytest items of a drill (id suffix, spec each runs): one by default."""
        return [("", spec)]

    @classmethod
    def plan_problems(cls, params: FaultParams, steps: int, world_size: int) -> list[tuple[str, str]]:
        """Problems of ``params`` that need the drill's steps and world size (checked after
        :meth:`validate` found none); empty by default."""
        return []

    @classmethod
    def unavailable_for(cls, backend: JobBackend) -> str | None:
        """Why this fault cannot strike a job whose ranks run as ``backend`` says (its kind's,
        :mod:`trainguard.launch.backend`), with what to use instead; None when it can.
        ``trainguard validate`` refuses such a drill (it could only be skipped);
        :meth:`require_job_kind` raises the same words at :meth:`setup`."""
        return None

    def require_job_kind(self, ctx: FaultContext) -> None:
        """Raise :class:`FaultUnavailable` when :meth:`unavailable_for` refuses ``ctx``'s job."""
        why = self.unavailable_for(ctx.backend)
        if why is not None:
            raise FaultUnavailable(why, needs=SkipReason.JOB_KIND)

    def setup(self, ctx: FaultContext) -> None:
        """Prepare the real fault before the first attempt (may raise :class:`FaultUnavailable`)."""

    def launch_env(self, ctx: FaultContext) -> dict[str, str]:
        """Environment variables for every rank of every attempt."""
        return {}

    def preexec(self, rank: int) -> None:
        """Runs in each rank's child process before exec (keep it async-signal-safe-ish: no locks,
        no logging; write to files under /sys or /proc only)."""

    @property
    def needs_preexec(self) -> bool:
        return type(self).preexec is not Fault.preexec

    def inject(self, launcher: Launcher) -> None:
        """Inject the fault now (the target rank has just printed step ``after_step``)."""
        raise NotImplementedError

    def clear(self) -> None:
        """End the fault (idempotent)."""

    def teardown(self) -> None:
        """Release everything :meth:`setup`/:meth:`inject` created (idempotent, never raises)."""

    def evidence(self) -> FaultEvidence:
        """What happened, for the report (mode that ran, counters, fallbacks used)."""
        return FaultEvidence(*self.struck())

    def struck(self) -> tuple[str, int, int, float | None, float | None]:
        """The :class:`FaultEvidence` fields, in order: a fault's own record starts with them
        (``KillEvidence(*self.struck(), signal=...)``)."""
        return self.kind, self.rank, self.after_step, self.injected_at, self.cleared_at

    def classify(self, result: RunResult) -> str:
        """How a failed attempt ended, in words (e.g. 'killed by the kernel OOM killer')."""
        return result.reason or result.outcome

    def no_effect(self, first: RunResult, steps: int, metric: str) -> str:
        """Why the fault, injected into ``first`` (the first attempt of a ``steps``-step run),
        tested nothing: its target went on as if it had not struck. Empty when it struck, or
        when this fault cannot tell (default). A drill whose fault had no effect is an error,
        never a pass (docs/security.md, "What never passes")."""
        return ""

    def likely_causes(self, result: RunResult) -> list[str]:
        """Causes of a failed drill that this fault can read from ``result``, most likely first;
        the judges put them before their expectation's general ones. Default: none."""
        return []

    def verify_continue(self, result: RunResult) -> list[str]:
        """Extra checks of an ``expect: continue`` drill once the job has completed (after
        :meth:`clear`, before :meth:`teardown`): one sentence per problem, e.g. the network fault
        checks that every metric the job printed (``result.points``) reached the tracking
        store. Default: none."""
        return []
