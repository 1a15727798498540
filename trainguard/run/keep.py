"""Checkpoints kept from an uninterrupted run after a step: what a kill there would leave.

The checks that resume from a mid-run checkpoint (resume, reshard, smoke's resume stage) used to
launch one more run of the job and SIGKILL it after step k. The uninterrupted run of the same
request takes the same steps, so it serves instead: when it prints step k, every process of
every rank is stopped (:meth:`~trainguard.launch.Launcher.frozen`), its checkpoint directory is
copied, and the processes continue. The copy holds exactly what a SIGKILL at that moment would
have left on disk (a stopped process writes nothing more; what it wrote is in the page cache
either way), and the uninterrupted run goes on to be the reference it was launched as. The
stopped time is taken out of its clocks (stall, timeout, and the profile's step times).

A check registers what it needs before the runs start (:meth:`Keepers.register`, from the runs
its descriptor declares: :class:`~trainguard.config.registry.Run` with ``resumes``); the runner
attaches the keepers to the next uninterrupted launch of the request (:meth:`Keepers.attach`).
When no launch could keep one (the run failed before step k, printed it only at its end, or the
copy failed), :meth:`Keepers.kept` says why and the check kills a run of its own, as before.
"""

from __future__ import annotations

import contextlib
import dataclasses
import shutil
import threading
import time
from collections.abc import Callable
from concurrent import futures
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from trainguard._internal.readers import copy_tree
from trainguard.evidence import UNSET, Evidence, Unset
from trainguard.launch.metrics import LineMetric, MetricParser
from trainguard.run.request import RunRequest, share_key
from trainguard.unit.checkpoints import latest_complete_checkpoint
from trainguard.unit.checkpoints.files import is_temp_name, step_in_name

if TYPE_CHECKING:  # pragma: no cover
    from trainguard.launch import Launcher, MetricPoint, RunResult

__all__ = ["MAX_KEEP_BYTES", "Keepers", "KeptCheckpoint", "KeptEvidence"]

#: the largest checkpoint directory copied while a run is stopped: at ~1 GB/s a stop of seconds,
#: far inside the collectives' timeouts (a stopped rank's watchdog counts the stop when it wakes)
MAX_KEEP_BYTES = 4 * 2**30


@dataclass(frozen=True)
class KeptCheckpoint:
    """The checkpoint directory of an uninterrupted run, copied while its processes were
    stopped right after it printed step ``step`` (>= the ``after_step`` asked for)."""

    #: the request of the run it was kept from (its reference key)
    request: RunRequest
    after_step: int
    #: the step line read when the run was stopped (a kill would have landed there)
    step: int
    #: the copy (never written to: each resume gets its own copy, :meth:`copy_for`)
    directory: Path
    #: the run it was kept from (its sample records stand for the steps before the resume)
    run_dir: Path
    label: str
    pause_s: float
    #: what the copy left out: {relative path: why} (a FIFO, a socket, a device: never opened)
    left_out: dict[str, str] = field(default_factory=dict)

    def copy_for(self, label: str) -> Path:
        """A fresh copy of the kept checkpoint directory for one resumed run to load and write
        into (the kept one stays as it was)."""
        # <run>/kept/after-step-K/checkpoints is the kept one, <run>/kept/after-step-K/<label>/
        # checkpoints each copy: always named `checkpoints` (a directory named for a step would
        # read as a checkpoint itself)
        base, n = self.directory.parent / label, 1
        while base.exists():
            n += 1
            base = self.directory.parent / f"{label}-{n}"
        copy_tree(self.directory, base / "checkpoints")  # the kept copy holds no FIFO or device
        return base / "checkpoints"

    def as_evidence(self) -> KeptEvidence:
        return KeptEvidence(str(self.run_dir), self.label, self.after_step, self.step, str(self.directory),
                            round(self.pause_s, 4), dict(self.left_out) if self.left_out else UNSET)


@dataclass
class KeptEvidence(Evidence):
    """A kept checkpoint in the report (:meth:`KeptCheckpoint.as_evidence`)."""

    kept_from: str
    label: str
    after_step: int
    stopped_after_step: int
    copy: str
    pause_s: float
    #: {relative path: why} the copy left out
    left_out: dict[str, str] | Unset = UNSET


#: how long :meth:`Keepers.kept` waits for the launch that carries a keeper when its request
#: has no timeout of its own
_CARRIED_WAIT_S = 3600.0


@dataclass
class _Keeper:
    key: RunRequest
    after_step: int
    metric: str
    kept: KeptCheckpoint | None = None
    #: why the last run that carried it kept nothing
    why_not: str = "no uninterrupted run of this request was launched after the check asked for it"
    #: a launch carries it now
    carried: bool = False


@dataclass
class Keepers:
    """The keepers of one runner (shared with its siblings' requests by key)."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    _keepers: dict[tuple[RunRequest, int], _Keeper] = field(default_factory=dict)
    _resumed: dict[tuple[RunRequest, int, RunRequest], Future[RunResult]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        #: notified when a launch that carried keepers ended (their copies settled, or why not)
        self._ended = threading.Condition(self.lock)

    def register(self, request: RunRequest, after_step: int, metric: str) -> None:
        """Keep the checkpoint of the next uninterrupted run of ``request`` after ``after_step``
        (idempotent; requests are keyed by :func:`~trainguard.run.request.share_key`)."""
        key = share_key(request)
        with self.lock:
            self._keepers.setdefault((key, after_step), _Keeper(key, after_step, metric))

    def attach(
        self, request: RunRequest, *, label: str, run_dir: Path, checkpoint_dir: Path
    ) -> tuple[Callable[[MetricPoint, Launcher], None] | None, Callable[[RunResult | None], None]]:
        """The metric callback that keeps every checkpoint still wanted of ``request`` during one
        launch (None: nothing wanted), and what to call with the launch's result when it ended
        (a copy counts only then: see :meth:`_settle`)."""
        key = share_key(request)
        with self.lock:
            wanted = [k for (r, _), k in self._keepers.items() if r == key and k.kept is None and not k.carried]
            for keeper in wanted:
                keeper.carried = True
        if not wanted:
            return None, lambda result: None
        pending = sorted(wanted, key=lambda k: k.after_step)
        copies: dict[int, tuple[KeptCheckpoint, float, int | None]] = {}

        def keep(point: MetricPoint, launcher: Launcher) -> None:
            while pending and point.name == pending[0].metric and point.step >= pending[0].after_step:
                keeper = pending.pop(0)
                copies.update(self._keep(keeper, point.step, launcher, label, run_dir, checkpoint_dir))

        def ended(result: RunResult | None) -> None:
            with self.lock:
                for keeper in wanted:
                    keeper.carried = False
                    if id(keeper) in copies and result is not None:
                        self._settle(keeper, *copies[id(keeper)], result, label)
                    elif keeper in pending:
                        keeper.why_not = (f"its run {label} ended before trainguard read step "
                                          f"{keeper.after_step} of `{keeper.metric}`")
                self._ended.notify_all()

        return keep, ended

    def _keep(self, keeper: _Keeper, step: int, launcher: Launcher, label: str, run_dir: Path,
              checkpoint_dir: Path) -> dict[int, tuple[KeptCheckpoint, float, int | None]]:
        """Copy ``checkpoint_dir`` with the run stopped; {id(keeper): (the copy, the launch-clock
        time the run went on)}, or {} with ``keeper.why_not`` said."""
        if step >= keeper.key.steps:
            keeper.why_not = (f"its run {label} had printed its last step ({step}) when trainguard read step "
                              f"{keeper.after_step}: nothing left to resume")
            return {}
        target = run_dir / "kept" / f"after-step-{keeper.after_step}" / "checkpoints"
        try:
            with launcher.frozen():  # first: a kill lands at once, and so must the stop
                size = _size(checkpoint_dir)
                if size > MAX_KEEP_BYTES:  # a long stop outlasts a collective's watchdog (NCCL's heartbeat)
                    keeper.why_not = (f"{checkpoint_dir} holds {size / 2**30:.1f} GiB, more than trainguard "
                                      f"copies while the run is stopped ({MAX_KEEP_BYTES / 2**30:.0f} GiB)")
                    return {}
                left_out: dict[str, str] = {}
                if checkpoint_dir.is_dir():
                    left_out = copy_tree(checkpoint_dir, target)
                else:
                    target.mkdir(parents=True)
        except OSError as exc:
            shutil.rmtree(target, ignore_errors=True)
            keeper.why_not = f"copying {checkpoint_dir} failed: {exc}"
            return {}
        start, end = launcher.pauses[-1]
        return {id(keeper): (KeptCheckpoint(keeper.key, keeper.after_step, step, target, run_dir, label,
                                            end - start, left_out), end, _unterminated_step(launcher, keeper.metric))}

    @staticmethod
    def _settle(keeper: _Keeper, copy: KeptCheckpoint, went_on: float, unterminated: int | None, result: RunResult,
                label: str) -> None:
        """The copy stands for a kill only when the run had not printed its last step before it
        was stopped (every line read before it went on was printed before the stop): a job that
        prints its lines in a burst at exit shows step ``after_step`` only when it is done, and its
        checkpoint is then the final one (what the kill-after-step check calls too late). A line
        whose end had not come when the run was stopped (``print`` writes its text, then the end)
        was printed too: ``unterminated`` is its step."""
        read = [p.step for p in result.points if p.name == keeper.metric and p.t <= went_on]
        reached = max([*read, *([unterminated] if unterminated is not None else [])], default=None)
        if reached is not None and reached >= keeper.key.steps:
            keeper.why_not = (f"its run {label} had printed its last step ({reached} of {keeper.key.steps}) when "
                              f"trainguard stopped it after reading step {copy.step}: the copy is the final state, "
                              "not a mid-run one")
            return
        keeper.kept = copy

    def kept(self, request: RunRequest, after_step: int) -> tuple[KeptCheckpoint | None, str]:
        """The checkpoint kept of ``request`` after ``after_step``, or None and why not. While a
        launch carries its keeper (two uninterrupted runs of the request started side by side,
        and the other one ended first), it waits for that launch to end, within its timeout: a
        copy counts only then."""
        deadline = time.monotonic() + (request.timeout or _CARRIED_WAIT_S)
        with self.lock:
            keeper = self._keepers.get((share_key(request), after_step))
            if keeper is None:
                return None, "no check asked to keep it"
            while keeper.kept is None and keeper.carried and (left := deadline - time.monotonic()) > 0:
                self._ended.wait(left)
            return keeper.kept, "" if keeper.kept is not None else keeper.why_not

    def prefix(self, request: RunRequest, references: dict[RunRequest, RunResult]) -> RunResult | None:
        """The uninterrupted run of ``request`` (steps N) as the first N steps of a longer completed
        run of the same request among ``references``, when that run's checkpoint directory kept
        after step N + 1 ends on a checkpoint of exactly step N (what the N-step run would end with);
        else None. Only for a job whose first steps do not depend on the total
        (``job.steps_independent``)."""
        key = share_key(request)
        for other, result in sorted(references.items(), key=lambda kv: kv[0].steps):
            if other.steps <= key.steps or dataclasses.replace(other, steps=key.steps) != key or not result.ok:
                continue
            # kept once step N + 1 was printed: a job that saves step N after printing it has by then
            snapshot, _ = self.kept(other, key.steps + 1)
            if snapshot is None or _newest_step(snapshot.directory) != key.steps:
                continue
            return dataclasses.replace(
                result, points=[p for p in result.points if p.step <= key.steps], checkpoint_dir=snapshot.directory,
                evidence={**result.evidence, "prefix_of": {
                    "run_dir": str(result.run_dir), "steps": other.steps,
                    "note": f"the first {key.steps} steps of the {other.steps}-step run (job.steps_independent), "
                            f"its checkpoint of step {key.steps} kept"}})
        return None

    def resumed(self, kept: KeptCheckpoint, request: RunRequest, launch: Callable[[], RunResult]) -> RunResult:
        """The run resumed from ``kept`` with ``request`` (launched by ``launch`` once, shared by
        every check that asks: smoke's resume stage is the resume check's resumed run); one
        started by :meth:`start_resumed` is waited for."""
        key = (kept.request, kept.after_step, share_key(request))
        with self.lock:
            future = self._resumed.get(key)
            mine = future is None
            if future is None:
                future = self._resumed[key] = Future()
        if mine:
            try:
                future.set_result(launch())
            except BaseException as exc:
                future.set_exception(exc)
                with self.lock:
                    self._resumed.pop(key, None)
                raise
        return future.result()

    def start_resumed(self, kept: KeptCheckpoint, request: RunRequest, launch: Callable[[], RunResult]) -> None:
        """Launch the run resumed from ``kept`` in the background (not yet launched nor started):
        independent resumed runs start up side by side (the reshard pairs)."""
        with self.lock:
            if (kept.request, kept.after_step, share_key(request)) in self._resumed:
                return
        def work() -> None:
            with contextlib.suppress(BaseException):  # its error reaches whoever waits for it
                self.resumed(kept, request, launch)

        threading.Thread(target=work, name="trainguard-resumed", daemon=True).start()

    def join(self, stop: Callable[[], None], timeout: float = 30.0) -> None:
        """Stop (``stop``) and wait for the resumed runs still running in the background, at most
        ``timeout`` s (the runner's close: their threads are daemons)."""
        with self.lock:
            running = [f for f in self._resumed.values() if not f.done()]
        if running:
            stop()
            futures.wait(running, timeout=timeout)



def _size(directory: Path) -> float:
    """Bytes under ``directory`` (symlinks not followed); 0 when it does not exist."""
    total = 0
    for path in directory.rglob("*") if directory.is_dir() else ():
        with contextlib.suppress(OSError):
            if not path.is_symlink() and path.is_file():
                total += path.stat().st_size
    return total


def _newest_step(directory: Path) -> int | None:
    """The step of the newest checkpoint in ``directory``: the newest complete one's, else the
    highest step any entry's name holds (per-rank files of a format trainguard does not load)."""
    latest = latest_complete_checkpoint(directory)
    if latest is not None:
        return step_in_name(latest.name)
    steps = [s for p in directory.iterdir() if not is_temp_name(p.name)
             if (s := step_in_name(p.name)) is not None] if directory.is_dir() else []
    return max(steps, default=None)


def _unterminated_step(launcher: Launcher, metric: str) -> int | None:
    """The step of ``metric`` on a line the stopped run had printed but not yet ended
    (:attr:`~trainguard.launch.Launcher.partial_at_stop`); None without one, or for a metric
    whose steps are counted (the count is the launch's own parser's)."""
    regex = launcher.spec.metric_regexes.get(metric)
    if regex is None or (isinstance(regex, LineMetric) and regex.step == "count"):
        return None
    parser = MetricParser({metric: regex})
    steps = [p.step for rank, text in launcher.partial_at_stop for p in parser.parse(text, rank=rank, t=0.0)]
    return max(steps, default=None)
