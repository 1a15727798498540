"""Which run a check gets: shared reference runs, background prefetch and the lane.

A :class:`RunScheduler` sits beside a :class:`~trainguard.run.runner.JobRunner` and decides when
runs start and which are shared:

* **references** -- the uninterrupted run of a request, launched once and shared between checks
  (determinism's first run, resume's reference; the canary offers its own run);
* **prefetch** -- a reference started in a background thread while the check launches its own
  run (two start-ups overlap on a machine with spare cores);
* **the lane** -- runs of later checks (:class:`AheadRun`) launched one after the other in one
  background thread while the checks before them run, taken by the check that needs them.

:meth:`RunScheduler.run_for` puts the three behind one call: "the run this check needs for this
request". A ``ray_train`` job gets no background runs: its fits would queue for the same Ray CPUs.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent import futures
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from trainguard.run.observer import MetricCallback
from trainguard.run.request import RunRequest, share_key

if TYPE_CHECKING:  # pragma: no cover
    from trainguard.launch import Launcher, RunResult

__all__ = ["AheadRun", "PendingRun", "RunScheduler", "SchedulerHost"]


@dataclass
class AheadRun:
    """A run a later check will need, started early in the runner's background lane (see
    :meth:`JobRunner.start_lane`): ``check`` takes it with :meth:`JobRunner.take_ahead`."""

    check: str
    request: RunRequest
    label: str
    on_metric: MetricCallback | None = None
    #: its result; None when the lane was closed before it started
    future: Future[RunResult | None] = field(default_factory=Future, repr=False)
    #: the observer's token of its launch (re-nested under the check that takes it)
    tracked: object = field(default=None, repr=False)
    #: the check running in the foreground when this run started (the report says so)
    beside: str | None = None
    #: queued -> running -> done; "claimed": its check came first and runs it itself
    state: str = "queued"
    #: it is the uninterrupted run of its request: not launched when one is kept already
    reference: bool = False


class SchedulerHost(Protocol):
    """What the scheduler asks of the pool it belongs to (:class:`~trainguard.run.pool.RunPool`)."""

    def launch(
        self, request: RunRequest, *, label: str, on_metric: MetricCallback | None = None,
        ahead: AheadRun | None = None,
    ) -> RunResult:
        """Launch ``request`` in a new run directory and return its result."""

    def background(self) -> bool:
        """Whether runs may start in the background (prefetch, the lane)."""

    def current_check(self) -> str | None:
        """The check running in the foreground (a lane run records it as what it ran beside)."""

    def adopt(self, tracked: object) -> None:
        """A lane run's check took it: its tracked launch is re-nested under that check."""

    def prefix(self, request: RunRequest, kept: dict[RunRequest, RunResult]) -> RunResult | None:
        """The uninterrupted run of ``request`` served by a longer kept one, or None."""


class PendingRun:
    """The run :meth:`RunScheduler.run_for` is getting; :meth:`result` waits for it."""

    def __init__(self, get: Callable[[], RunResult]) -> None:
        self._get = get

    def result(self) -> RunResult:
        """The run (waiting for it to end; launching it now when nothing started it)."""
        return self._get()


class RunScheduler:
    """The reference cache, the background prefetch and the lane of one runner's pool.

    ``host`` launches the runs and answers what the scheduler asks (the pool); ``lock`` and
    ``inflight`` are the runner's (the launchers of runs started off the main thread are
    registered there, so they can be stopped).
    """

    def __init__(self, host: SchedulerHost, *, lock: threading.Lock, inflight: set[Launcher]) -> None:
        self._host = host
        self._lock = lock
        self._inflight = inflight
        self._references: dict[RunRequest, RunResult] = {}
        #: references launched without the step records the job's other runs have (the
        #: profile's timed run): key -> the request it was launched for
        self._records_off: dict[RunRequest, RunRequest] = {}
        self._pending: dict[RunRequest, Future[RunResult]] = {}
        self._lane: list[AheadRun] = []
        self._lane_closed = threading.Event()
        self._lane_thread: threading.Thread | None = None

    @property
    def lane_thread(self) -> threading.Thread | None:
        """The lane's thread, once :meth:`start_lane` started one."""
        return self._lane_thread

    # -- the one call -------------------------------------------------------------------------

    def run_for(self, request: RunRequest, check: str) -> PendingRun:
        """Start getting the run ``check`` needs for ``request``; the caller does other work and
        then waits with ``.result()``. It is the run the lane started ahead for ``check`` (kept
        as the reference of ``request`` once taken), else the kept reference, else one launched
        now in the background (:meth:`prefetch`; a lane run still queued for ``check`` is
        claimed first, so it never starts), else (no background runs) one launched by
        ``.result()``."""
        if self.ahead_started(check, request):

            def taken() -> RunResult:
                result = self.take_ahead(check, request)
                if result is None:  # stopped before it could finish: run it now
                    return self.reference(request)
                self.offer_reference(request, result)
                return result

            return PendingRun(taken)
        self.take_ahead(check, request)  # not started yet: this check runs it itself
        self.prefetch(request)
        return PendingRun(lambda: self.reference(request))

    # -- references and prefetch --------------------------------------------------------------

    @staticmethod
    def reference_key(request: RunRequest) -> RunRequest:
        """The key under which ``request``'s reference is kept (:func:`share_key`)."""
        return share_key(request)

    def reference(self, request: RunRequest) -> RunResult:
        """An uninterrupted run for ``request``, launched once and shared between checks (one
        started by :meth:`prefetch` or offered by :meth:`offer_reference` counts)."""
        key = self.reference_key(request)
        with self._lock:
            if key in self._references:
                return self._references[key]
            pending = self._pending.get(key)
            kept = dict(self._references)
        if pending is None and (served := self._host.prefix(request, kept)) is not None:
            with self._lock:
                return self._references.setdefault(key, served)
        if pending is None and (taken := self._lane_reference(key)) is not None:
            return taken
        if pending is not None:
            try:
                return pending.result()
            except BaseException:
                self.stop_background("interrupted while waiting for a reference run")
                raise
        result = self._host.launch(request, label="reference")
        with self._lock:
            return self._references.setdefault(key, result)

    def kept_reference(self, request: RunRequest) -> RunResult | None:
        """The reference of ``request`` kept so far (launched by no one now), or None."""
        with self._lock:
            return self._references.get(self.reference_key(request))

    def offer_reference(self, request: RunRequest, result: RunResult, *, records_off: bool = False) -> None:
        """Keep ``result`` as the reference of ``request`` when it completed and none is kept
        yet (the canary's run is the uninterrupted run of its request). ``records_off``: it was
        launched without the step records the job's runs have (the profile's timed run): it is
        shared for comparing, and :meth:`recorded` launches a recorded one where a diagnosis
        needs its records."""
        if result.ok:
            key = self.reference_key(request)
            with self._lock:
                if key not in self._references:
                    self._references[key] = result
                    if records_off:
                        self._records_off[key] = request

    def recorded(self, run: RunResult) -> RunResult:
        """``run``, when the run agent recorded its steps; when it is a reference kept without
        them (:meth:`offer_reference`'s ``records_off``), the uninterrupted run of its request
        launched now with them, kept as the reference from then on. A check compares with the
        shared run as it is and asks for this only to diagnose a failed comparison (the causes
        come from both runs' step records), so a session that passes launches nothing more."""
        with self._lock:
            key = next((k for k, kept in self._references.items() if kept is run and k in self._records_off), None)
            request = None if key is None else self._records_off[key]
        if key is None or request is None:
            return run
        result = self._host.launch(request, label="reference-recorded")
        if not result.ok:
            return run
        with self._lock:
            if self._references.get(key) is run:
                self._references[key] = result
                self._records_off.pop(key, None)
        return result

    def prefetch(self, request: RunRequest) -> None:
        """Start the reference run of ``request`` in the background (when none is kept or
        running): the check launches its own run meanwhile, and :meth:`reference` waits for it.
        On a machine with spare cores two start-ups overlap; every check joins what it started
        (through :meth:`reference`) before it returns, so timing-sensitive checks run alone."""
        if not self._host.background():
            return
        key = self.reference_key(request)
        with self._lock:
            if key in self._references or key in self._pending:
                return
            kept = dict(self._references)
        if (served := self._host.prefix(request, kept)) is not None:
            with self._lock:
                self._references.setdefault(key, served)
            return
        with self._lock:
            if key in self._references or key in self._pending:
                return
            future: Future[RunResult] = Future()
            self._pending[key] = future

        def work() -> None:
            try:
                result = self._host.launch(request, label="reference")
            except BaseException as exc:  # handed to whoever waits in reference()
                future.set_exception(exc)
            else:
                if result.outcome != "stopped":  # stopped by stop_background: not a reference
                    with self._lock:
                        self._references.setdefault(key, result)
                future.set_result(result)
            finally:
                with self._lock:
                    self._pending.pop(key, None)

        threading.Thread(target=work, name=f"trainguard-reference-{request.world_size}", daemon=True).start()

    def join_background(self) -> None:
        """Wait for every background reference run (checks call this before they return)."""
        with self._lock:
            pending = list(self._pending.values())
        for future in pending:
            try:
                future.result()
            except BaseException:
                self.stop_background("interrupted while waiting for a reference run")
                raise

    def stop_background(self, reason: str) -> None:
        """Stop every run launched off the main thread (Ctrl-C, a failed check)."""
        with self._lock:
            running = list(self._inflight)
        for launcher in running:
            launcher.stop(reason)

    def stop_and_wait(self, reason: str, timeout: float = 30.0) -> None:
        """Stop every background reference run and wait (at most ``timeout`` s) until each has
        torn its ranks down. Their threads are daemons: one still in its run when the
        interpreter exits (Ctrl-C, SIGTERM) would never reach its teardown, and its ranks would
        outlive trainguard. A run between its start and its registration is stopped on a later
        pass."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                pending = list(self._pending.values())
            if not pending:
                return
            self.stop_background(reason)
            if time.monotonic() > deadline:
                return
            futures.wait(pending, timeout=0.1)

    # -- the lane -----------------------------------------------------------------------------

    def start_lane(self, runs: Sequence[AheadRun]) -> None:
        """Launch ``runs`` one after the other in one background thread while the checks before
        the ones that need them run in the foreground (on a 2-core machine two start-ups overlap
        well; a third would only queue). Each is taken by its check with :meth:`take_ahead`;
        :meth:`close_lane` stops what nobody took. Only for runs that are not timing-sensitive:
        the checks that measure speed (profile, drills) must not start before the lane is closed."""
        if not runs or not self._host.background():
            return
        if self._lane_thread is not None:
            raise RuntimeError("the runner's lane was already started")
        self._lane = list(runs)
        items = list(runs)

        def work() -> None:
            for item in items:
                with self._lock:
                    if self._lane_closed.is_set() or item.state == "claimed":
                        item.future.set_result(None)
                        continue
                    item.state = "running"
                item.beside = self._host.current_check()
                try:
                    result = self._host.launch(item.request, label=item.label, on_metric=item.on_metric, ahead=item)
                except BaseException as exc:  # handed to the check that takes it
                    item.future.set_exception(exc)
                else:
                    item.future.set_result(result)
                finally:
                    item.state = "done"

        self._lane_thread = threading.Thread(target=work, name="trainguard-lane", daemon=True)
        self._lane_thread.start()

    def _lane_reference(self, key: RunRequest) -> RunResult | None:
        """The lane's uninterrupted run of ``key`` (``AheadRun.reference``, another check's),
        taken as the reference when it started: one launch, not two (smoke folded into the
        canary's run). A queued one is claimed and None returned: the caller launches it."""
        with self._lock:
            item = next((i for i in self._lane if i.reference and self.reference_key(i.request) == key), None)
        if item is None:
            return None
        result = self.take_ahead(item.check, item.request)
        if result is None or not result.ok:
            return None
        with self._lock:
            return self._references.setdefault(key, result)

    def ahead_started(self, check: str, request: RunRequest) -> bool:
        """Whether the lane has started (or finished) a run for ``check`` with ``request``."""
        return any(i.check == check and i.request == request and i.state in ("running", "done")
                   for i in self._lane)

    def take_ahead(self, check: str, request: RunRequest) -> RunResult | None:
        """The run started ahead for ``check`` with exactly ``request`` (waiting for it to end),
        or None when there is none, the lane has not started it yet (it never will: the check
        runs it now) or it was stopped before it could finish."""
        with self._lock:
            item = next((i for i in self._lane if i.check == check and i.request == request), None)
            if item is None:
                return None
            self._lane.remove(item)
            if item.state == "queued":
                item.state = "claimed"
                return None
        try:
            result = item.future.result()
        except BaseException:
            self.close_lane()
            raise
        if result is None or (result.outcome == "stopped" and self._lane_closed.is_set()):
            return None
        self._host.adopt(item.tracked)
        result.evidence["started_ahead"] = {
            "beside": item.beside,
            "note": "launched in the background while the check before it ran",
        }
        return result

    def close_lane(self) -> None:
        """Stop the lane's runs that no check took and wait for its thread (idempotent)."""
        self._lane_closed.set()
        thread = self._lane_thread
        if thread is None or thread is threading.current_thread():
            return
        # a run between its start and its launcher's registration is caught on a later pass
        deadline = time.monotonic() + 60
        while thread.is_alive() and time.monotonic() < deadline:
            with self._lock:
                running = list(self._inflight)
            for launcher in running:
                launcher.stop("the checks that needed this run are not running")
            thread.join(timeout=0.2)
