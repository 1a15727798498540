"""Independent boundaries of a save explored side by side (``checks.crash_points``, issue 49;
docs/crash-points.md, "Boundaries side by side").

The exploration (:func:`~trainguard.drills.crash_infer.explore_inferred`, or every boundary run
with ``infer: false``) is replayed with the runs made so far. The runs it asks for that are not
made yet are ones it makes whatever those find (a boundary whose outcome depends on a run not
made yet is left waiting), so they do not depend on each other: they are made at once, one per
lane, each lane a FUSE layer of its own over a checkpoint directory of its own (the check's own
layer is the first lane; the others are mounted under ``lane-<n>`` of the work directory when
first needed). When a run ends, the replay says which come next. The replay once every run is
made is the exploration one boundary after the other on the same runs: the same rows, so the
same outcomes, the same first unsafe boundary and the same verdict; only the order in which the
runs are made differs.

How many lanes (:func:`lane_count`): ``lanes`` of the check, else as many as the machine's cores
hold the job's ranks (``cores // world_size``, at most :data:`MOST_LANES`); one where the job's
backend runs nothing beside another run (a ``ray_train`` job's fits would queue for the same Ray
CPUs: the gate starts no background lane for it either). One lane is the exploration as it was:
each run made in the check's own thread, in order.

A lane that fails (its run raised) or Ctrl-C while the lanes run: every run still under way is
stopped (the runner's launchers off the main thread) until each lane's thread has ended, then the
exception goes on; the caller unmounts the layers (:meth:`LaneLayers.close`, in its ``finally``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Hashable
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from trainguard.drills.crash_infer import Agree, Inference, explore_inferred
from trainguard.drills.crash_records import Boundary, CrashRow
from trainguard.faults.fusefs import FuseLayer
from trainguard.faults.fusemount import FuseMount

__all__ = ["MOST_LANES", "LaneLayers", "every_boundary", "explore_in_lanes", "explore_side_by_side", "inferred",
           "lane_count"]

#: lanes at most, however many cores: each is a FUSE daemon and a copy of the checkpoint directory
MOST_LANES = 8
#: how long a failed exploration waits for its lanes' runs to stop before it goes on
_STOP_WAIT_S = 60.0

#: a run of one boundary on one lane: its row and how many launches it took
LaneRun = Callable[[int, FuseLayer], tuple[CrashRow, int]]
#: the exploration replayed on the runs made so far (None: not made yet)
Decide = Callable[[Callable[[int], CrashRow | None]], Inference]


def lane_count(wanted: int | None, world_size: int, background: bool, cores: int | None = None) -> int:
    """How many boundaries run side by side (the module's docstring): ``wanted`` (the check's
    ``lanes``), else ``cores // world_size`` (the cores this process may use), at most
    :data:`MOST_LANES`; 1 when the backend runs nothing beside another run (``background``
    False)."""
    if not background:
        return 1
    if wanted is not None:
        return wanted
    cores = len(os.sched_getaffinity(0)) if cores is None else cores
    return max(1, min(MOST_LANES, cores // max(1, world_size)))


class LaneLayers:
    """The FUSE layers of the lanes: ``first`` (the check's own) and up to ``count - 1`` more,
    each mounted under ``work/lane-<n>`` when first needed (from the check's thread). A layer
    that cannot be mounted leaves the lanes there are (``problems`` says why)."""

    def __init__(self, first: FuseLayer, work: Path, count: int) -> None:
        self.work, self.count = work, count
        self.free: list[FuseLayer] = [first]
        self.mounts: list[FuseMount] = []
        self.problems: list[str] = []
        #: the lanes the exploration had: the first and those mounted (closed ones too)
        self.used = 1

    def take(self) -> FuseLayer | None:
        """A free lane's layer (mounting another when there is room), else None."""
        if not self.free and self.used < self.count:
            lane = self.work / f"lane-{self.used}"
            mount = FuseMount(self.problems)
            self.mounts.append(mount)  # before the mount: close() reaches a mount a signal interrupted
            try:
                why = mount.mount(lane / "backing", lane / "mnt", policy="rules", state_dir=lane)
            except OSError as exc:  # its folders could not be made: the lanes there are
                why = str(exc)
            if why is not None:
                self.mounts.pop().unmount()
                self.problems.append(f"lane {self.used + 1}: {why}")
                self.count = self.used  # no more lanes than there are
            else:
                assert mount.layer is not None  # mounted
                self.used += 1
                return mount.layer
        return self.free.pop(0) if self.free else None

    def give(self, layer: FuseLayer) -> None:
        """``layer``'s run ended: its lane is free again."""
        self.free.append(layer)

    def close(self) -> None:
        """Unmount every lane's layer but the first (the check's own, its owner's); idempotent."""
        while self.mounts:
            self.mounts.pop().unmount()


def every_boundary(count: int) -> Decide:
    """``infer: false``: every boundary run (the exploration :func:`explore_side_by_side` replays)."""
    def decide(run: Callable[[int], CrashRow | None]) -> Inference:
        done = Inference()
        for i in range(count):
            row = run(i)
            if row is None:
                done.waiting.add(i)
            else:
                done.rows[i] = row
        return done

    return decide


def inferred(chosen: list[Boundary], states: list[Hashable | None] | None, agree: Agree | None = None,
             folders: bool = False) -> Decide:
    """The exploration with outcomes inferred (:func:`explore_inferred`), to replay; ``states``
    None: :func:`every_boundary`."""
    if states is None:
        return every_boundary(len(chosen))
    return lambda run: explore_inferred(chosen, states, run, agree, folders)


def explore_side_by_side(decide: Decide, run: LaneRun, lanes: LaneLayers,
                         stop: Callable[[str], None]) -> tuple[Inference, int]:
    """The rows of the exploration ``decide`` and the launches they took, its runs made by
    ``run`` on ``lanes`` side by side (the module's docstring); ``stop`` stops every run under
    way off the check's thread (the runner's background launchers)."""
    made: dict[int, CrashRow] = {}
    launched = 0
    if lanes.count <= 1:  # one after the other, in the check's own thread: the exploration as it was
        first = lanes.take()
        assert first is not None  # the check's own layer

        def inline(i: int) -> CrashRow:
            nonlocal launched
            row, n = run(i, first)
            launched += n
            return row

        return decide(inline), launched
    running: dict[Future[tuple[CrashRow, int]], tuple[int, FuseLayer]] = {}
    needed: list[int] = []  # the runs the last replay asked for that are not made yet

    def known(i: int) -> CrashRow | None:
        if i not in made:
            needed.append(i)
        return made.get(i)

    executor = ThreadPoolExecutor(max_workers=lanes.count, thread_name_prefix="trainguard-crash-lane")
    try:
        while True:
            needed.clear()
            decided = decide(known)
            busy = {i for i, _ in running.values()}
            for i in (i for i in needed if i not in busy):
                layer = lanes.take()
                if layer is None:
                    break
                running[executor.submit(run, i, layer)] = (i, layer)
            if not running:
                assert not needed and not decided.waiting, (needed, decided.waiting)
                return decided, launched
            ended, _ = futures.wait(running, return_when=futures.FIRST_COMPLETED)
            for future in ended:
                i, layer = running.pop(future)
                lanes.give(layer)
                made[i], n = future.result()  # a lane's exception goes on from here
                launched += n
    except BaseException:
        _stop_lanes(running, stop)
        raise
    finally:
        executor.shutdown(wait=False, cancel_futures=True)


def _stop_lanes(running: dict[Future[tuple[CrashRow, int]], tuple[int, FuseLayer]],
                stop: Callable[[str], None]) -> None:
    """Stop the runs under way until every lane's thread has ended (a lane between two launches
    of its boundary starts the next one: it is stopped on a later pass), at most
    :data:`_STOP_WAIT_S`."""
    deadline = time.monotonic() + _STOP_WAIT_S
    pending = [f for f in running if not f.cancel()]
    while pending and time.monotonic() < deadline:
        stop("another crash_points lane ended with an exception")
        futures.wait(pending, timeout=0.2)
        pending = [f for f in pending if not f.done()]


def explore_in_lanes(decide: Decide, run: LaneRun, first: FuseLayer, count: int,
                     stop: Callable[[str], None]) -> tuple[Inference, int, LaneLayers]:
    """The exploration ``decide`` (:func:`every_boundary`, or :func:`inferred`: outcomes inferred
    where they can be) made by :func:`explore_side_by_side` on ``count`` lanes, ``first`` the
    check's own layer, the others mounted under its work directory and unmounted before this
    returns (or raises)."""
    lanes = LaneLayers(first, first.trigger.parent, count)
    try:
        decided, launched = explore_side_by_side(decide, run, lanes, stop)
    finally:
        lanes.close()
    return decided, launched, lanes
