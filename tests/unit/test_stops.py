"""The launcher's stop conditions on constructed snapshots, no process started: each fires when
its condition holds, with the outcome, reason and evidence the run records, and stays quiet
when it does not; the order in which the monitor asks them decides between two that hold at
once. The same conditions on real ranks: tests/unit/test_launcher.py."""

from __future__ import annotations

from typing import Any

import pytest

from tests.helpers import report_evidence
from trainguard.launch import MetricPoint
from trainguard.launch.hang_evidence import EARLY_EXIT_CAUSES
from trainguard.launch.stops import (
    AllRanksExited,
    Deadline,
    MemoryLimit,
    Progress,
    RankFailed,
    Snapshot,
    Stall,
    Stop,
    StopRequested,
    first_stop,
    stop_conditions,
)

RUNNING = {0: None, 1: None}


def seen(exit_codes: dict[int, int | None] | None = None, **fields: Any) -> Snapshot:
    """A monitor pass at ``now`` (1 s in), both ranks running unless told otherwise."""
    fields.setdefault("now", 1.0)
    fields.setdefault("job_time", fields["now"])
    return Snapshot(exit_codes=RUNNING if exit_codes is None else exit_codes, **fields)


def monitor(state: Snapshot, **limits: Any) -> Stop | None:
    """What the monitor's whole list of conditions, in its order, makes of ``state``."""
    limits.setdefault("timeout", 600.0)
    limits.setdefault("stall_timeout", 60.0)
    return first_stop(stop_conditions(**limits), state)


def points(*steps: tuple[int, int, float]) -> list[MetricPoint]:
    return [MetricPoint("loss", step, 1.0, rank, t) for rank, step, t in steps]


# -- the order ---------------------------------------------------------------------------------


def test_the_conditions_are_asked_in_the_monitors_order() -> None:
    names = [type(c).__name__ for c in stop_conditions(timeout=10.0, stall_timeout=5.0)]
    assert names == ["StopRequested", "MemoryLimit", "RankFailed", "AllRanksExited", "Deadline", "Stall"]


def test_a_quiet_pass_stops_nothing() -> None:
    state = seen(now=3.0, last_progress=2.5, first_metric=0.5, memory_mb={0: 10.0, 1: 10.0})
    assert monitor(state, max_rss_mb=100.0, timeout=10.0, stall_timeout=1.0) is None


# -- a stop requested from outside (Launcher.stop) ----------------------------------------------


def test_a_requested_stop_ends_the_run_as_stopped_with_its_reason() -> None:
    reason = "resume drill: killed after step 4"
    assert StopRequested().check(seen(stop_requested=reason)) == Stop("stopped", reason)
    assert StopRequested().check(seen()) is None
    # the ranks it killed have all exited, by trainguard's SIGKILL: still "stopped", blaming no rank
    killed = seen({0: -9, 1: -9}, stop_requested=reason, killed=frozenset({0, 1}), exit_seen_at={0: 1.0, 1: 1.0})
    assert monitor(killed) == Stop("stopped", reason)
    assert monitor(seen({0: -9, 1: -9}, killed=frozenset({0, 1}), exit_seen_at={0: 1.0, 1: 1.0})) == Stop("ok")


# -- a rank's process tree over the memory limit -------------------------------------------------


def test_a_rank_over_the_memory_limit_fails_the_run() -> None:
    state = seen(memory_mb={0: 120.0, 1: 300.44})
    stop = MemoryLimit(256.0).check(state)
    assert stop == Stop(
        "failed",
        "rank 1's processes used 300 MB of memory (RSS), 44 MB over the limit of 256 MB",
        failed_rank=1,
        evidence={"memory_limit": {"rank": 1, "rss_mb": 300.4, "limit_mb": 256.0}},
    )
    assert monitor(state, max_rss_mb=256.0) == stop
    # two ranks over: the first in rank order
    assert MemoryLimit(100.0).check(state) == Stop(
        "failed", "rank 0's processes used 120 MB of memory (RSS), 20 MB over the limit of 100 MB", failed_rank=0,
        evidence={"memory_limit": {"rank": 0, "rss_mb": 120.0, "limit_mb": 100.0}})


@pytest.mark.parametrize(
    ("limit", "memory"),
    [(256.0, {0: 120.0, 1: 255.9}), (256.0, {0: 256.0}), (256.0, {}), (None, {0: 9999.0})],
    ids=["under", "at-the-limit", "not-sampled-this-pass", "no-limit"],
)
def test_memory_at_or_under_the_limit_or_unsampled_stops_nothing(limit: float | None, memory: dict[int, float]) -> None:
    state = seen(memory_mb=memory)
    assert MemoryLimit(limit).check(state) is None
    assert monitor(state, max_rss_mb=limit) is None


# -- a rank that exited with an error --------------------------------------------------------------


@pytest.mark.parametrize(
    ("code", "reason"),
    [(3, "rank 1 exited with code 3"), (-9, "rank 1 killed by SIGKILL"), (-15, "rank 1 killed by SIGTERM")],
)
def test_a_rank_that_exits_non_zero_or_by_a_signal_fails_the_run(code: int, reason: str) -> None:
    state = seen({0: None, 1: code}, exit_seen_at={1: 0.9})
    assert RankFailed().check(state) == Stop("failed", reason, failed_rank=1)
    assert monitor(state) == Stop("failed", reason, failed_rank=1)


def test_an_exit_0_or_a_kill_trainguard_sent_is_no_rank_failure() -> None:
    assert RankFailed().check(seen({0: None, 1: 0}, exit_seen_at={1: 0.9})) is None
    assert RankFailed().check(seen({0: None, 1: -9}, exit_seen_at={1: 0.9}, killed=frozenset({1}))) is None
    assert RankFailed().check(seen()) is None


def test_the_rank_seen_failing_first_is_blamed_and_a_failure_beats_all_exited() -> None:
    state = seen({0: 1, 1: 2}, exit_seen_at={0: 0.8, 1: 0.4})
    assert RankFailed().check(state) == Stop("failed", "rank 1 exited with code 2", failed_rank=1)
    assert monitor(state) == Stop("failed", "rank 1 exited with code 2", failed_rank=1)


def test_a_failed_rank_names_the_peer_that_had_exited_0_before_it() -> None:
    # rank 0 left after its step 2; rank 1 went on to wait for it, and its collective timed out
    state = seen({0: 0, 1: 1}, exit_seen_at={0: 1.25, 1: 4.0}, points=points((0, 2, 1.0), (1, 2, 1.0)))
    stop = RankFailed().check(state)
    assert stop is not None and stop.failed_rank == 1
    assert stop.reason == ("rank 1 exited with code 1 after rank 0 had exited 0 (after its step 2): "
                           "it waited for it in a collective")
    assert report_evidence(stop)["early_exit"]["rank"] == 0 and report_evidence(stop)["early_exit"]["exited_at_s"] == 1.25
    # the peer exited 0 after the failure was seen: it is not what the failed rank waited for
    later = seen({0: 0, 1: 1}, exit_seen_at={0: 4.5, 1: 4.0}, points=points((0, 2, 1.0), (1, 2, 1.0)))
    assert RankFailed().check(later) == Stop("failed", "rank 1 exited with code 1", failed_rank=1)


# -- every rank done ---------------------------------------------------------------------------------


def test_every_rank_exited_is_ok_and_one_running_is_not() -> None:
    done = seen({0: 0, 1: 0}, exit_seen_at={0: 0.9, 1: 0.9})
    assert AllRanksExited().check(done) == Stop("ok")
    assert monitor(done) == Stop("ok")
    assert AllRanksExited().check(seen({0: 0, 1: None}, exit_seen_at={0: 0.9})) is None
    # every rank ended before the deadline was seen passed: ok, not a timeout
    assert monitor(seen({0: 0, 1: 0}, exit_seen_at={0: 0.9, 1: 0.9}, now=20.0), timeout=10.0) == Stop("ok")


# -- the deadline -------------------------------------------------------------------------------------


def test_the_jobs_own_time_past_the_timeout_is_a_timeout_with_rank_dumps() -> None:
    stop = Stop("timeout", "the run exceeded its timeout of 1.5 s", dump_ranks=True)
    assert Deadline(1.5).check(seen(now=1.6)) == stop
    assert monitor(seen(now=1.6), timeout=1.5, stall_timeout=None) == stop
    assert Deadline(1.5).check(seen(now=1.5)) is None
    # 2 s of it stopped by frozen(): the job itself ran 1.2 s
    assert Deadline(1.5).check(seen(now=3.2, job_time=1.2)) is None
    # past the timeout and silent past the stall limit: the timeout is named
    quiet = seen(now=20.0, first_metric=1.0, last_progress=1.0)
    assert monitor(quiet, timeout=10.0, stall_timeout=5.0) == Stop(
        "timeout", "the run exceeded its timeout of 10 s", dump_ranks=True)


# -- a hang: no new metric line ---------------------------------------------------------------------


def test_no_new_line_for_longer_than_the_stall_limit_is_a_hang() -> None:
    state = seen(now=9.5, first_metric=1.0, last_progress=6.0)
    stop = Stall(3.0).check(state)
    assert stop == Stop("hung", "no new metric line for 3.5 s (limit 3 s)", detected_after_s=pytest.approx(0.5),
                        dump_ranks=True)
    assert monitor(state, stall_timeout=3.0) == stop
    assert Stall(3.0).check(seen(now=9.0, first_metric=1.0, last_progress=6.0)) is None  # at the limit
    assert Stall(4.0).check(state) is None
    assert Stall(None).check(seen(now=500.0, first_metric=1.0, last_progress=6.0)) is None


def test_the_stall_clock_starts_afresh_after_a_frozen_span() -> None:
    # the last line at 6 s, the ranks stopped from 6.5 s to 9 s: 0.5 s of silence since
    assert Stall(3.0).check(seen(now=9.5, first_metric=1.0, last_progress=6.0, resumed_at=9.0)) is None
    stop = Stall(3.0).check(seen(now=12.5, first_metric=1.0, last_progress=6.0, resumed_at=9.0))
    assert stop is not None and stop.reason == "no new metric line for 3.5 s (limit 3 s)"


def test_no_line_since_launch_is_a_hang_and_the_startup_limit_applies_then() -> None:
    stop = Stall(1.0).check(seen(now=1.25))
    assert stop is not None and stop.reason == "no new metric line since launch for 1.2 s (limit 1 s)"
    assert Stall(1.0, startup_timeout=30.0).check(seen(now=20.0)) is None
    stop = Stall(1.0, startup_timeout=30.0).check(seen(now=31.0))
    assert stop is not None and stop.reason == "no new metric line since launch for 31.0 s (limit 30 s)"
    # once a line arrived, the stall limit is back
    stop = Stall(1.0, startup_timeout=30.0).check(seen(now=20.0, first_metric=18.0, last_progress=18.0))
    assert stop is not None and stop.reason == "no new metric line for 2.0 s (limit 1 s)"


def test_after_the_final_step_the_shutdown_limit_applies() -> None:
    finished = {"first_metric": 1.0, "last_progress": 10.0, "finished": True}
    assert Stall(2.0, shutdown_timeout=30.0).check(seen(now=25.0, **finished)) is None
    stop = Stall(2.0, shutdown_timeout=30.0).check(seen(now=41.0, **finished))
    assert stop is not None and stop.reason == "no exit 31.0 s after the last step (limit 30 s)"
    # the longer of the two: a shutdown limit below the stall limit does not shorten it
    assert Stall(20.0, shutdown_timeout=5.0).check(seen(now=25.0, **finished)) is None
    # without a shutdown limit the stall limit holds; the reason says the run was past its last step
    stop = Stall(2.0).check(seen(now=13.0, **finished))
    assert stop is not None and stop.reason == "no exit 3.0 s after the last step (limit 2 s)"


def test_a_hang_after_a_rank_exited_0_names_that_rank_first() -> None:
    state = seen({0: None, 1: 0}, now=6.0, first_metric=0.5, last_progress=3.0, exit_seen_at={1: 2.5},
                 points=points((0, 3, 3.0), (1, 2, 2.0)))
    stop = Stall(2.0).check(state)
    assert stop is not None and stop.outcome == "hung"
    assert stop.reason == (
        "rank 1 exited 0 after its step 2 (2.5 s into the run) while rank(s) 0 went on: they wait for it in "
        f"a collective. Most likely {EARLY_EXIT_CAUSES[0]} (no new metric line for 3.0 s (limit 2 s))")
    assert report_evidence(stop)["early_exit"]["waiting_ranks"] == [0]


# -- what the stall clock reads ---------------------------------------------------------------------


def test_progress_keeps_the_first_and_the_latest_line_and_the_final_step() -> None:
    progress = Progress(final_step=3)
    assert (progress.first_metric, progress.last_progress, progress.finished) == (None, 0.0, False)
    for point in points((0, 1, 0.5), (1, 2, 1.5), (0, 2, 1.0)):
        progress.record(point)
    assert (progress.first_metric, progress.last_progress, progress.finished) == (0.5, 1.5, False)
    progress.record(points((1, 3, 2.0))[0])
    assert progress.finished and progress.last_progress == 2.0
    unbounded = Progress()
    unbounded.record(points((0, 10**6, 1.0))[0])
    assert not unbounded.finished
