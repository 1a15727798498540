"""The runs of a session: launched, shared and kept by one :class:`RunPool`.

A runner's pool owns the reference cache, the background prefetch and the lane
(:class:`~trainguard.run.scheduling.RunScheduler`) and the checkpoints kept from uninterrupted
runs (:class:`~trainguard.run.keep.Keepers`); the runner only launches. What the session is doing
(the check in the foreground, a timed check running, whether a check may leave its untimed rest
for later) is a :class:`SessionState` the orchestrator (:func:`trainguard.session.run_in_order`)
installs, not flags on the runner.

Every launch made while a check runs is admitted against the runs that check declared
(:attr:`trainguard.config.registry.Check.runs`, made requests by
:func:`~trainguard.run.declared.declared_runs` once per session): a launch of a request no
declared run has raises :class:`UndeclaredRun`, so what ``trainguard validate`` prints is what
runs.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from trainguard.run.declared import DeclaredRun, declared_runs
from trainguard.run.keep import Keepers, KeptCheckpoint
from trainguard.run.request import RunRequest, share_key
from trainguard.run.scheduling import AheadRun, RunScheduler

if TYPE_CHECKING:  # pragma: no cover
    from trainguard.launch import RunResult
    from trainguard.launch.backend import JobBackend
    from trainguard.run.observer import MetricCallback

__all__ = ["PoolHost", "RunPool", "SessionState", "UndeclaredRun"]

T = TypeVar("T")
R = TypeVar("R")


class UndeclaredRun(RuntimeError):
    """A check launched a run it did not declare (``Check.runs``): ``trainguard validate`` would
    not have shown it."""


@dataclass
class SessionState:
    """What the session is doing, set by the orchestrator and read by the checks through their
    context (:class:`trainguard.checks.context.CheckContext`)."""

    #: the checks of the session (name, spec), in run order (a check may fold into another's runs)
    checks: tuple[tuple[str, Any], ...] = ()
    #: the check running in the foreground; a lane run records it as what it ran beside
    current_check: str | None = None
    #: a check that times its runs is running: nothing else starts in this process meanwhile
    timing: bool = False
    #: called by a timed check once its timed runs are done (the untimed runs start then)
    on_timed_done: Callable[[], None] | None = field(default=None, repr=False)
    #: a check may leave its untimed rest for after the timed checks (a ``Later``)
    untimed_later: bool = False
    #: the runs each check declared for its spec, made requests once per session (by check
    #: name: the spec, its runs, the one line on what it judges)
    declared: dict[str, tuple[Any, tuple[DeclaredRun, ...], str]] = field(default_factory=dict, repr=False)

    def timed_runs_done(self) -> None:
        """A timed check says its timed runs are over (see :attr:`on_timed_done`)."""
        self.timing = False
        callback, self.on_timed_done = self.on_timed_done, None
        if callback is not None:
            callback()


class PoolHost(Protocol):
    """What the pool launches through: :class:`~trainguard.run.runner.JobRunner`."""

    job_file: Any
    settings: Any
    observer: Any
    backend: JobBackend

    @property
    def checkpoints_known(self) -> bool:
        """Whether the job is told where to checkpoint."""

    @property
    def resumes_from_latest(self) -> bool:
        """Whether ``job.resume_args`` names ``{latest_checkpoint}``."""

    def command_line(self, request: RunRequest, *, resume: bool = False, run_dir: Path | None = None,
                     checkpoint_dir: Path | None = None, latest_checkpoint: Path | str | None = None) -> str:
        """The job's command as a person would type it (a 'reproduce:' line)."""

    def sibling(self, job_file: Any) -> Any:
        """A runner of a variant of this job file sharing this one's settings."""

    def run(self, request: RunRequest, *, label: str, resume: bool = False, checkpoint_dir: Path | None = None,
            on_metric: MetricCallback | None = None, ahead: AheadRun | None = None, keep: bool = True) -> RunResult:
        """Launch ``request`` in a new run directory."""


class RunPool:
    """Launching, sharing and keeping the runs of one runner (:mod:`trainguard.run.pool`)."""

    def __init__(self, host: PoolHost, *, lock: threading.Lock, inflight: set[Any]) -> None:
        self._host = host
        self.state = SessionState()
        self.keepers = Keepers()
        self.scheduling = RunScheduler(self, lock=lock, inflight=inflight)
        #: the check this thread runs for (:meth:`checking`)
        self._thread = threading.local()

    # -- what the scheduler asks (run/scheduling.py's SchedulerHost) --------------------------

    def launch(self, request: RunRequest, *, label: str, on_metric: MetricCallback | None = None,
               ahead: AheadRun | None = None) -> RunResult:
        """Launch ``request`` (a shared reference, a prefetch, a lane run) through the runner."""
        return self._host.run(request, label=label, on_metric=on_metric, ahead=ahead)

    def background(self) -> bool:
        """Whether runs may start in the background."""
        # e.g. a ray_train job's fits would queue for the same Ray CPUs: one after the other
        return self._host.backend.concurrent_runs()

    def current_check(self) -> str | None:
        """The check running in the foreground."""
        return self.state.current_check

    def adopt(self, tracked: object) -> None:
        """A lane run its check took is re-nested under that check in the tracking store."""
        self._host.observer.launch_adopted(tracked)

    def prefix(self, request: RunRequest, kept: dict[RunRequest, RunResult]) -> RunResult | None:
        """With ``job.steps_independent``: the uninterrupted run of ``request`` served by the
        first steps of a longer one that ran already (:meth:`Keepers.prefix`); else None."""
        if not self._host.job_file.job.steps_independent:
            return None
        return self.keepers.prefix(request, kept)

    # -- kept checkpoints (see trainguard.run.keep) -------------------------------------------

    def keep(self, request: RunRequest, after_step: int, metric: str) -> None:
        """Keep the checkpoint of the next uninterrupted run of ``request`` after it prints step
        ``after_step`` of ``metric`` (see :mod:`trainguard.run.keep`)."""
        if self._host.checkpoints_known and self._host.backend.ranks_are_children():
            self.keepers.register(request, after_step, metric)

    def kept(self, request: RunRequest, after_step: int) -> tuple[KeptCheckpoint | None, str]:
        """The checkpoint kept of ``request`` after ``after_step``, or None and why not."""
        if not self._host.backend.ranks_are_children():  # e.g. Ray's processes, not the driver's children
            return None, (f"a {self._host.backend.title} job's ranks are not trainguard's processes: trainguard "
                          "cannot stop them while it copies")
        if not self._host.checkpoints_known:
            return None, "the job is not given {checkpoint_dir}, so trainguard cannot copy its checkpoints"
        return self.keepers.kept(request, after_step)

    def resume_kept(self, kept: KeptCheckpoint, request: RunRequest, *, label: str) -> RunResult:
        """``request`` resumed (``resume_args``) from a copy of ``kept``: launched once, shared by
        the checks that ask for the same one."""
        launch = functools.partial(self._resumed_run, kept, request, label)
        return self.keepers.resumed(kept, request, launch)

    def start_resume_kept(self, kept: KeptCheckpoint, request: RunRequest, *, label: str) -> None:
        """:meth:`resume_kept` started in the background (independent resumed runs start up side
        by side); :meth:`resume_kept` then waits for it."""
        launch = functools.partial(self._resumed_run, kept, request, label)
        self.keepers.start_resumed(kept, request, launch)

    def _resumed_run(self, kept: KeptCheckpoint, request: RunRequest, label: str) -> RunResult:
        return self._host.run(request, label=label, resume=True, checkpoint_dir=kept.copy_for(label))

    # -- the session ---------------------------------------------------------------------------

    @contextlib.contextmanager
    def session(self, state: SessionState) -> Iterator[SessionState]:
        """Run under ``state`` (the orchestrator's), the pool's own again afterwards."""
        before, self.state = self.state, state
        try:
            yield state
        finally:
            self.state = before

    def declared(self, name: str, spec: Any) -> tuple[DeclaredRun, ...]:
        """The runs check ``name`` declared for ``spec``, made requests once per session (again
        for another spec of the same name: a test's, a pytest item's)."""
        known = self.state.declared.get(name)
        if known is None or known[0] != spec:
            runs, note = declared_runs(self._host.job_file, name, spec, seed=self._host.settings.seed,
                                       soak_seed=self._host.settings.soak_seed, session=self.state.checks)
            known = self.state.declared[name] = (spec, tuple(runs), note)
        return known[1]

    def note(self, name: str) -> str:
        """What check ``name``'s declaration says it judges ("" before it declared)."""
        known = self.state.declared.get(name)
        return known[2] if known is not None else ""

    @contextlib.contextmanager
    def checking(self, name: str | None) -> Iterator[None]:
        """The launches of this thread are check ``name``'s (None: no check's) until the block ends."""
        before = getattr(self._thread, "check", None)
        self._thread.check = name
        try:
            yield
        finally:
            self._thread.check = before

    def admit(self, request: RunRequest, label: str, ahead: AheadRun | None = None) -> None:
        """Refuse a launch of ``request`` that the check it is for (a lane run's, else the one
        this thread runs for, :meth:`checking`) did not declare (:class:`UndeclaredRun`). Runs
        outside a check (a fixture's, a background reference a check asked for through its
        context) pass."""
        name = ahead.check if ahead is not None else getattr(self._thread, "check", None)
        if name is None or name not in self.state.declared:
            return
        runs = self.state.declared[name][1]
        wanted = share_key(request)
        if any(share_key(d.request) == wanted or (d.source is not None and share_key(d.source) == wanted)
               for d in runs):
            return
        listed = "; ".join(f"{d.run.label} ({d.request.world_size} rank(s), {d.request.steps} steps)" for d in runs)
        raise UndeclaredRun(
            f"the {name} check launched {label!r} ({request.world_size} rank(s), {request.steps} steps, "
            f"seed {request.seed}), a run it did not declare; it declared: {listed or 'nothing'}. Declare "
            f"it in the check's `runs` (trainguard validate prints what runs)")

    # -- what a check's context reads ---------------------------------------------------------

    @property
    def job_file(self) -> Any:
        """The job file the runs are of."""
        return self._host.job_file

    @property
    def settings(self) -> Any:
        """The session's settings."""
        return self._host.settings

    def command_line(self, request: RunRequest, *, resume: bool = False, run_dir: Path | None = None,
                     checkpoint_dir: Path | None = None, latest_checkpoint: Path | str | None = None) -> str:
        """The job's command for ``request`` as a person would type it (a 'reproduce:' line)."""
        return self._host.command_line(request, resume=resume, run_dir=run_dir, checkpoint_dir=checkpoint_dir,
                                       latest_checkpoint=latest_checkpoint)

    @property
    def checkpoints_known(self) -> bool:
        """Whether the job is told where to checkpoint (only then are checkpoints kept)."""
        return bool(self._host.checkpoints_known)

    def sibling(self, job_file: Any) -> RunPool:
        """The pool of a runner of a variant of this job file (base's checkout, another batch
        size) with the same settings, echo and tracker (:meth:`JobRunner.sibling`)."""
        pool: RunPool = self._host.sibling(job_file).pool
        return pool

    @property
    def resumes_from_latest(self) -> bool:
        """Whether ``job.resume_args`` names ``{latest_checkpoint}`` (a resume needs a complete
        checkpoint to name)."""
        return bool(self._host.resumes_from_latest)

    def drive(self, driver: Callable[[Any, T], R], spec: T) -> R:
        """``driver(runner, spec)``: a library driver that launches through the runner itself
        (:func:`trainguard.drills.driver.run_drill`'s supervised runs,
        :func:`trainguard.profiling.check.profile_job`'s sizes and siblings), run on the runner
        this pool launches for; its launches are still admitted against the check's declared
        runs (:meth:`admit`)."""
        return driver(self._host, spec)

    def run_as_reference(self, check: str, request: RunRequest, *, label: str,
                         on_metric: MetricCallback | None = None) -> tuple[RunResult, bool]:
        """The uninterrupted run of ``request`` (limits of its own aside) for ``check``, shared
        both ways: the reference of its request kept so far (True: it ran already, for another
        check, so its limits are judged after the fact), else the run the lane started ahead
        for ``check``, else launched now; a completed one becomes the reference of its request
        for the checks after it (the canary's run is the uninterrupted run of its request)."""
        kept = self.scheduling.kept_reference(request)
        result = kept or self.scheduling.take_ahead(check, request)
        if result is None:
            result = self.run(request, label=label, on_metric=on_metric)
        self.scheduling.offer_reference(request, result)
        return result, kept is not None

    def run(self, request: RunRequest, *, label: str, on_metric: MetricCallback | None = None, resume: bool = False,
            checkpoint_dir: Path | None = None, keep: bool = True) -> RunResult:
        """Launch ``request`` now, in a new run directory (checked against the check's declared runs)."""
        return self._host.run(request, label=label, on_metric=on_metric, resume=resume,
                              checkpoint_dir=checkpoint_dir, keep=keep)

    def stop_beside(self, reason: str) -> None:
        """Stop every run under way off the main thread: a check's own runs side by side
        (crash_points' lanes) when one of them failed or on Ctrl-C, before its error goes on."""
        self.scheduling.stop_background(reason)

    def stand_in(self, request: RunRequest, *, label: str, resume: bool = False,
                 checkpoint_dir: Path | None = None) -> RunResult:
        """Launch ``request`` in place of a declared run that could not be had (smoke's own
        resume when the checkpoint it would share was not kept): not admitted against the plan."""
        with self.checking(None):
            return self._host.run(request, label=label, resume=resume, checkpoint_dir=checkpoint_dir)
