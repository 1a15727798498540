"""What a check's ``run`` receives: :class:`CheckContext`, one per check and session.

The context holds what every check used to work out from the runner itself -- its spec, the
request of its spec, the metric its runs' progress is followed by, the tolerance it compares
with -- and the runs it declared (:attr:`trainguard.config.registry.Check.runs`, made requests
once per session by :meth:`trainguard.run.pool.RunPool.declared`). The check gets its runs by
naming a declared run (``ctx.reference()``, ``ctx.run(run)``, ``ctx.interrupt(run)``); a run it
did not declare is refused (:class:`~trainguard.run.pool.UndeclaredRun`), so what ``trainguard
validate`` prints is what runs. Launching, sharing and keeping are the pool's
(:class:`~trainguard.run.pool.RunPool`); what the session is doing is its
:class:`~trainguard.run.pool.SessionState` (``ctx.state``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Generic, TypeVar

from trainguard.checks.calibration import ToleranceUsed, tolerance_for
from trainguard.checks.interruption import Interruption
from trainguard.config.registry import Run
from trainguard.launch import RunResult
from trainguard.run.declared import DeclaredRun, progress_metric_of
from trainguard.run.observer import MetricCallback
from trainguard.run.pool import RunPool, SessionState, UndeclaredRun
from trainguard.run.request import RunRequest, share_key
from trainguard.run.runner import JobRunner
from trainguard.run.scheduling import PendingRun

__all__ = ["CheckContext", "context_for"]

S = TypeVar("S")
R = TypeVar("R")

#: a declared run, by itself or by its label
Which = Run | str


@dataclass(frozen=True)
class CheckContext(Generic[S]):
    """One check's view of the session: its spec, its request, its declared runs, and the runs."""

    #: the check's name in reports (``resume``, ``drill:<name>``)
    name: str
    spec: S
    #: the request its spec asks for at the job's world size (:meth:`JobRunner.request_for`)
    request: RunRequest
    #: the metric the runs' progress is followed by (:func:`~trainguard.run.declared.progress_metric_of`)
    metric: str
    #: the runs it declared, each with its request, in declaration order
    runs: tuple[DeclaredRun, ...]
    pool: RunPool = field(repr=False)

    @cached_property
    def tolerance(self) -> ToleranceUsed:
        """The spec's rtol/atol widened by this machine's calibration of :attr:`request`."""
        return tolerance_for(self.job_file, self.spec, self.request, self.name)

    @property
    def job_file(self) -> Any:
        return self.pool.job_file

    @property
    def settings(self) -> Any:
        return self.pool.settings

    @property
    def state(self) -> SessionState:
        """What the session is doing (a timed check running, untimed rests left for later)."""
        return self.pool.state

    @property
    def checkpoints_known(self) -> bool:
        """Whether the job is told where to checkpoint (``{checkpoint_dir}``)."""
        return self.pool.checkpoints_known

    @property
    def resumes_from_latest(self) -> bool:
        """Whether ``job.resume_args`` names ``{latest_checkpoint}``."""
        return self.pool.resumes_from_latest

    @property
    def note(self) -> str:
        """The one line its declaration says it judges."""
        return self.pool.note(self.name)

    def declared(self, which: Which | None = None) -> DeclaredRun:
        """The declared run ``which`` (the Run or its label; None: the first uninterrupted one),
        or :class:`UndeclaredRun`."""
        for run in self.runs:
            if (run.run.reference if which is None else which in (run.run, run.run.label)):
                return run
        named = "an uninterrupted (reference) run" if which is None else repr(getattr(which, "label", which))
        raise UndeclaredRun(f"the {self.name} check asked for {named}, which it did not declare; it declared: "
                            + ("; ".join(d.run.label for d in self.runs) or "nothing")
                            + ". Declare it in the check's `runs` (trainguard validate prints what runs)")

    # -- its runs ------------------------------------------------------------------------------

    def reference(self, which: Which | None = None) -> RunResult:
        """The uninterrupted run of a declared reference run, launched once and shared."""
        return self.pool.scheduling.reference(self.declared(which).request)

    def kept_reference(self, which: Which | None = None) -> RunResult | None:
        """The uninterrupted run of a declared reference run when one is kept already (launched
        by an earlier check), else None: a check that makes an uninterrupted run of its own
        anyway may compare with that one instead of launching this."""
        return self.pool.scheduling.kept_reference(self.declared(which).request)

    def recorded(self, run: RunResult) -> RunResult:
        """``run`` with the run agent's step records, for the diagnosis of a failed comparison:
        a shared reference launched without them (the profile's timed run) is launched again
        with them (:meth:`~trainguard.run.scheduling.RunScheduler.recorded`); any other run as
        it is."""
        return self.pool.scheduling.recorded(run)

    def run(self, which: Which, *, label: str, on_metric: MetricCallback | None = None, resume: bool = False,
            checkpoint_dir: Path | None = None, keep: bool = True) -> RunResult:
        """Launch the declared run ``which`` now, in a new run directory."""
        return self.pool.run(self.declared(which).request, label=label, on_metric=on_metric, resume=resume,
                             checkpoint_dir=checkpoint_dir, keep=keep)

    def run_as_reference(self, request: RunRequest, *, label: str,
                         on_metric: MetricCallback | None = None) -> tuple[RunResult, bool]:
        """``request``, a declared reference run's under limits of its own (``timeout``,
        ``max_rss_mb``), as the uninterrupted run of its request: the one kept when it ran
        already (True: its limits are judged after the fact), else the one the lane started
        ahead for this check, else launched now; completed, it is the reference of its request
        for the checks after (:meth:`RunPool.run_as_reference`)."""
        wanted = share_key(request)
        if not any(run.run.reference and share_key(run.request) == wanted for run in self.runs):
            raise UndeclaredRun(f"the {self.name} check asked for {label!r} ({request.world_size} rank(s), "
                                f"{request.steps} steps, seed {request.seed}) as the reference of its request, "
                                "but declared no reference run of it; it declared: "
                                + ("; ".join(d.run.label for d in self.runs) or "nothing")
                                + ". Declare it in the check's `runs` (trainguard validate prints what runs)")
        return self.pool.run_as_reference(self.name, request, label=label, on_metric=on_metric)

    def run_for(self, which: Which) -> PendingRun:
        """The declared run ``which`` as the lane started it ahead, else as a shared reference
        (started in the background now); ``.result()`` waits for it."""
        return self.pool.scheduling.run_for(self.declared(which).request, self.name)

    def prefetch(self, which: Which | None = None) -> None:
        """Start the declared reference run ``which`` in the background."""
        self.pool.scheduling.prefetch(self.declared(which).request)

    def take_ahead(self, which: Which) -> RunResult | None:
        """The declared run ``which`` the lane started ahead for this check, else None."""
        return self.pool.scheduling.take_ahead(self.name, self.declared(which).request)

    def stop_background(self, reason: str) -> None:
        """Stop the runs started in the background (the check was interrupted)."""
        self.pool.scheduling.stop_background(reason)

    def resume(self, cut: Interruption, which: Which | None = None, *, label: str,
               on_metric: MetricCallback | None = None) -> RunResult:
        """The declared run ``which`` (None: the first ``resumes`` run) resumed from ``cut`` in
        new processes (``resume_args``); from a kept checkpoint: the shared resumed run
        (:meth:`RunPool.resume_kept`), else in the checkpoint directory the killed run left,
        followed by ``on_metric`` (a chain's next kill)."""
        request = self.resuming(which).request
        if cut.kept is None:
            return self.pool.run(request, label=label, resume=True, checkpoint_dir=cut.checkpoint_dir,
                                 on_metric=on_metric)
        if on_metric is not None:
            raise ValueError("a resume from a kept checkpoint is shared: it cannot be followed (killed) by one check")
        same = request.world_size == cut.kept.request.world_size
        return self.pool.resume_kept(cut.kept, request, label=f"resumed-after-step-{cut.kept.after_step}"
                                     if same else label)

    def resuming(self, which: Which | None = None) -> DeclaredRun:
        """The declared run ``which`` that resumes from a kept checkpoint (None: the first one;
        :func:`~trainguard.checks.interruption.interrupt` gets where it starts)."""
        if which is not None:
            return self.declared(which)
        found = next((run for run in self.runs if run.run.resumes is not None), None)
        if found is None:
            raise UndeclaredRun(f"the {self.name} check resumes a run, but declared none that resumes "
                                "(Run.resumes)")
        return found

    def drive(self, driver: Callable[[JobRunner, S], R]) -> R:
        """``driver(runner, spec)`` on the runner of the pool: a library driver that launches
        through the runner itself (``run_drill(runner, spec)``, ``profile_job(runner, spec)``,
        both public); its launches are still admitted against this check's declared runs."""
        return self.pool.drive(driver, self.spec)

    def command_line(self, request: RunRequest | None = None, *, resume: bool = False,
                     latest_checkpoint: Path | str | None = None) -> str:
        """The job's command for ``request`` (default: the check's) as a person would type it."""
        return self.pool.command_line(request or self.request, resume=resume, latest_checkpoint=latest_checkpoint)


def context_for(pool: RunPool, name: str, spec: Any, request: RunRequest) -> CheckContext[Any]:
    """The context of check ``name`` in ``pool``'s session: its declared runs made once, and the
    checkpoints its ``resumes`` runs start from registered to be kept."""
    runs = pool.declared(name, spec)
    metric = progress_metric_of(pool.job_file)
    for run in runs:
        if run.source is not None and run.run.resumes is not None:
            pool.keep(run.source, run.run.resumes.after_step, metric)
    return CheckContext(name, spec, request, metric, runs, pool)
