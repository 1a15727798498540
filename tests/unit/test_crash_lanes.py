"""crash_points' boundaries side by side (trainguard/drills/crash_lanes.py): the runs the
exploration makes whatever the runs not made yet find, made at once, one per lane; the same runs
and rows as one after the other; every lane stopped and unmounted when one fails or on Ctrl-C."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import threading
import time
from collections.abc import Hashable
from pathlib import Path
from typing import Any

import pytest

from trainguard.drills.crash_infer import explore_inferred
from trainguard.drills.crash_lanes import (
    LaneLayers,
    explore_in_lanes,
    explore_side_by_side,
    inferred,
    lane_count,
)
from trainguard.drills.crash_records import Boundary, BoundaryNotReached, BoundaryOutcome, CrashRow
from trainguard.faults.fusefs import FuseLayer, fuse_unavailable


def _save(rng: random.Random) -> tuple[list[Boundary], list[Hashable | None]]:
    """A save of a few files: each a create, writes, maybe an fsync (the state of the write
    before it) and a rename; states repeat where a crash leaves the same directory."""
    chosen: list[Boundary] = []
    states: list[Hashable | None] = []
    for f in range(rng.randint(1, 3)):
        path = f"/f{f}"
        chosen.append(Boundary(0, path, "create", 1))
        states.append(("create", f))
        for w in range(rng.randint(0, 9)):
            chosen.append(Boundary(0, path, "write", w + 1))
            states.append(("write", f, w) if rng.random() < 0.8 else ("create", f))  # a write of nothing
        if rng.random() < 0.6:
            chosen.append(Boundary(0, path, "fsync", 1))
            states.append(states[-1])
        chosen.append(Boundary(0, path, "rename", 1, path + ".done"))
        states.append(None if rng.random() < 0.2 else ("rename", f))
    return chosen, states


def _outcomes(rng: random.Random, chosen: list[Boundary]) -> dict[int, CrashRow]:
    """What the run of each boundary finds: safe until a change point, then torn (resumed from
    another step), a few never reached."""
    change = rng.randint(0, len(chosen))
    rows: dict[int, CrashRow] = {}
    for i, b in enumerate(chosen):
        if rng.random() < 0.05:
            rows[i] = BoundaryNotReached(b.words(), b.op, b.path, b.rank, b.ordinal, "not reached", None, "")
        else:
            safe = i < change
            rows[i] = BoundaryOutcome(b.words(), b.op, b.path, b.rank, b.ordinal, 5 if safe else 10,
                                      "safe" if safe else "torn", "")
    return rows


class _Lanes(LaneLayers):
    """``count`` lanes whose layers are stand-ins (the runs here touch no directory): nothing
    is mounted."""

    def __init__(self, count: int, tmp_path: Path) -> None:
        super().__init__(None, tmp_path, count)  # type: ignore[arg-type]
        self.free = [f"lane {n}" for n in range(count)]  # type: ignore[list-item]

    def take(self) -> Any:
        return self.free.pop(0) if self.free else None


def _side_by_side_and_alone(seed: int, lanes: int, tmp_path: Path, observed: bool = False) -> None:
    rng = random.Random(seed)
    chosen, states = _save(rng)
    found = _outcomes(rng, chosen)
    order: list[int] = []
    # observed: whether the restart of j observed nothing that differs in i's state (crash_seen)
    alike = {(i, j) for i in range(len(chosen)) for j in range(i) if rng.random() < 0.3}
    agree = (lambda i, j: (i, j) in alike) if observed else None

    def alone(i: int) -> CrashRow:
        order.append(i)
        return found[i]

    sequential = explore_inferred(chosen, states, alone, agree)
    made: list[int] = []
    lock = threading.Lock()
    delays = [rng.random() * 0.003 for _ in chosen]

    def run(i: int, layer: Any) -> tuple[CrashRow, int]:
        time.sleep(delays[i])  # lanes end in another order than they began
        with lock:
            made.append(i)
        return found[i], 2

    decided, launched = explore_side_by_side(inferred(chosen, states, agree), run, _Lanes(lanes, tmp_path),
                                             lambda why: None)
    assert decided.rows == sequential.rows and decided.inferred == sequential.inferred, seed
    assert decided.observed == sequential.observed, seed
    assert not decided.waiting
    # the same runs, each once (one lane: in the same order too)
    assert sorted(made) == sorted(order) and launched == 2 * len(order), (seed, made, order)
    if lanes == 1:
        assert made == order


@pytest.mark.parametrize("observed", [False, True])
@pytest.mark.parametrize("lanes", [1, 2, 4])
def test_side_by_side_makes_the_runs_and_rows_of_the_exploration_one_after_the_other(
        lanes: int, observed: bool, tmp_path: Path) -> None:
    """With outcomes inferred from what restarts observed too (a random relation): the same."""
    for seed in range(12):
        _side_by_side_and_alone(seed, lanes, tmp_path, observed)


def test_independent_boundaries_run_at_the_same_time(tmp_path: Path) -> None:
    """Four boundaries that leave four states, no file written twice: all four are runs the
    exploration makes whatever the others find. Each run waits for another to be under way: one
    after the other, the barrier would break."""
    chosen = [Boundary(0, f"/f{n}", "create", 1) for n in range(4)]
    barrier = threading.Barrier(2, timeout=60)

    def run(i: int, layer: Any) -> tuple[CrashRow, int]:
        barrier.wait()
        b = chosen[i]
        return BoundaryOutcome(b.words(), b.op, b.path, b.rank, b.ordinal, 5, "safe", ""), 1

    decided, launched = explore_side_by_side(inferred(chosen, list(range(4))), run, _Lanes(2, tmp_path), lambda why: None)
    assert sorted(decided.rows) == [0, 1, 2, 3] and launched == 4


def test_the_lanes_are_what_the_cores_hold_of_the_job_s_ranks() -> None:
    assert lane_count(None, 1, True, cores=2) == 2
    assert lane_count(None, 2, True, cores=2) == 1
    assert lane_count(None, 4, True, cores=2) == 1
    assert lane_count(None, 1, True, cores=64) == 8  # MOST_LANES
    assert lane_count(3, 4, True, cores=2) == 3  # the check's lanes
    assert lane_count(None, 1, False, cores=16) == lane_count(4, 1, False) == 1  # e.g. ray_train: none beside


def _mounted(point: Path) -> bool:
    return any(line.split()[1] == str(point) for line in Path("/proc/mounts").read_text().splitlines())


@pytest.mark.skipif(fuse_unavailable() is not None, reason=f"no FUSE layer here: {fuse_unavailable()}")
@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["a lane raises", "Ctrl-C"])
def test_a_lane_that_fails_leaves_no_mount_and_no_process(layer: FuseLayer, tmp_path: Path, how: str) -> None:
    """Three lanes: two start a process (a stand-in for a run's ranks) and wait for it; the
    third fails once both are under way (an exception in its thread, or SIGINT to trainguard).
    The exception reaches the caller, the runs under way are stopped, every lane's process
    reaped, every lane but the check's own unmounted."""
    procs: list[subprocess.Popen[bytes]] = []
    lock = threading.Lock()
    both = threading.Barrier(3, timeout=60)
    chosen = [Boundary(0, f"/f{n}", "create", 1) for n in range(3)]
    seen: list[FuseLayer] = []
    stopped = threading.Event()

    def run(i: int, lane: FuseLayer) -> tuple[CrashRow, int]:
        seen.append(lane)
        if i == 2:
            both.wait()
            if how == "Ctrl-C":
                os.kill(os.getpid(), signal.SIGINT)
                stopped.wait(60)  # a run under way until it is stopped
            raise RuntimeError("the restart could not be launched")
        proc = subprocess.Popen(["sleep", "120"])
        with lock:
            procs.append(proc)
        both.wait()
        proc.wait()
        b = chosen[i]
        return BoundaryOutcome(b.words(), b.op, b.path, b.rank, b.ordinal, 5, "safe", ""), 1

    def stop(why: str) -> None:
        stopped.set()
        with lock:
            for proc in procs:
                proc.kill()

    expected = KeyboardInterrupt if how == "Ctrl-C" else RuntimeError
    with pytest.raises(expected):
        explore_in_lanes(inferred(chosen, [0, 1, 2]), run, layer, 3, stop)
    assert len(procs) == 2 and all(p.poll() is not None for p in procs)
    others = [lane for lane in seen if lane is not layer]
    assert len(others) == 2 and not any(_mounted(lane.point) for lane in others)
    assert all(lane.proc is None for lane in others)  # each lane's daemon stopped and reaped
    assert _mounted(layer.point)  # the check's own: its owner's to unmount
