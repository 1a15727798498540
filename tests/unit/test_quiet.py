"""Quiet windows (trainguard._internal.quiet): while a run whose line times are measured is in
flight, this process's background work waits, and the window waits for work under way first.

The cause, measured: beside two CPU hogs, a drill's toy job printed a line every ~30 ms and
trainguard read them 5-22 at a time, 0.1-0.8 s apart, while the tracking writer imported mlflow
and created runs in the same process (the step rate before the fault came out None); with the
writer held, every line was read on its own. The directions asserted here (a window never opens
while work is under way; nothing but run creations is written while one is open) do not depend
on how busy the machine is.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from trainguard._internal import quiet


def _in_thread(target: Callable[[], None]) -> threading.Thread:
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread


def test_a_window_waits_for_work_under_way_and_holds_what_comes_next() -> None:
    release, opened, close = threading.Event(), threading.Event(), threading.Event()
    seen: list[list[str]] = []

    def work() -> None:
        with quiet.busy("importing something"):
            release.wait(30)

    def timed_run() -> None:
        with quiet.measured(settle_s=30) as still:
            seen.append(still)
            opened.set()
            close.wait(30)

    worker = _in_thread(work)
    time.sleep(0.05)  # the work is under way before the window is asked for
    run = _in_thread(timed_run)
    assert not opened.wait(0.5)  # held by the work under way, however long we look
    release.set()
    assert opened.wait(30) and seen == [[]]  # it ended: nothing was still running
    assert quiet.measuring()
    assert not quiet.wait_while_measured(0.2)  # the next piece of work waits...
    close.set()
    run.join(30)
    worker.join(30)
    assert quiet.wait_while_measured(5) and not quiet.measuring()  # ...until the window closes


def test_a_window_opens_after_its_bound_and_names_what_still_runs() -> None:
    token = quiet.begin("a stuck import")
    try:
        with quiet.measured(settle_s=0.2) as still:
            assert still == ["a stuck import"]
    finally:
        quiet.end(token)
    quiet.end(token)  # twice: nothing
    with quiet.measured(settle_s=5) as still:
        assert still == []


def test_the_tracking_writer_writes_only_run_creations_during_a_window(
    tmp_path: Path, new_mlflow_store: Callable[[Path], Path]
) -> None:
    pytest.importorskip("mlflow")
    from mlflow import MlflowClient

    from trainguard.tracking import Tracker

    uri = f"sqlite:///{new_mlflow_store(tmp_path / 'mlflow.db')}"
    tracker = Tracker(uri, metric_interval=0.05, sample_interval=3600)
    with quiet.measured(settle_s=60) as still:  # the writer's import and connection first
        assert still == []
        run = tracker.start_run("launch")
        assert run.created.wait(60)  # a launch waits for its run: creations go through
        tracker.log_metrics(run, [("loss", 1.0, 1, 0), ("loss", 0.5, 2, 0)])
        tracker.set_tags(run, {"phase": "timed"})
        time.sleep(1.0)  # 20 metric intervals
        client = MlflowClient(uri)
        assert client.get_metric_history(run.run_id, "loss") == []
        assert "phase" not in client.get_run(run.run_id).data.tags
    result = tracker.close()
    assert result.complete, result
    assert [m.value for m in client.get_metric_history(run.run_id, "loss")] == [1.0, 0.5]
    assert client.get_run(run.run_id).data.tags["phase"] == "timed"


def test_a_window_waits_for_the_run_creations_queued_before_it(
    tmp_path: Path, new_mlflow_store: Callable[[Path], Path]
) -> None:
    """A window lets run creations through, so it waits for those already queued instead of
    having them written beside the timed run (0.5-2.8 s each on a loaded machine)."""
    pytest.importorskip("mlflow")
    from trainguard.tracking import Tracker

    uri = f"sqlite:///{new_mlflow_store(tmp_path / 'mlflow.db')}"
    tracker = Tracker(uri, sample_interval=3600)
    runs = [tracker.start_run(f"run-{i}") for i in range(3)]
    with quiet.measured(settle_s=60) as still:
        assert still == []
        assert all(r.created.is_set() and r.run_id for r in runs)
    assert tracker.close().complete


def test_a_store_that_is_down_does_not_hold_a_window(tmp_path: Path) -> None:
    """Creations queued for a store that refuses connections are retried for as long as the
    tracker lives: a window must not wait on them (it would wait its whole bound, 30 s here, at
    every drill attempt, and yield what it waited for)."""
    import socket

    pytest.importorskip("mlflow")
    from trainguard.tracking import Tracker

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens once closed
    tracker = Tracker(f"http://127.0.0.1:{port}", sample_interval=3600, flush_timeout=1)
    try:
        runs = [tracker.start_run(f"run-{i}") for i in range(2)]
        with quiet.measured(settle_s=30) as still:
            assert still == []
        assert not any(r.created.is_set() for r in runs)  # still queued, still retried
    finally:
        tracker.close(timeout=1)


def test_a_closed_runner_leaves_no_torch_import_running(monkeypatch: pytest.MonkeyPatch) -> None:
    """The background torch import never outlives the runner that started it: not begun (a
    timed run held it back), it is given up and a later runner starts it again; under way, the
    close waits for it. One left running when pytest ended its session overlapped pytest's
    parsing of a module it rewrites and crashed that session in ``ast.parse``."""
    from trainguard.run import runner

    monkeypatch.setattr(runner, "_warm", runner._WarmImport())
    with quiet.measured(settle_s=1):  # a timed run: the import waits for it
        runner._warm_torch_import()
        held = runner._warm.thread
        assert held is not None and held.is_alive() and not runner._warm.started
        runner._end_warm_import()
        assert runner._warm.thread is None  # given up
    held.join(10)
    assert not held.is_alive() and not runner._warm.started  # it woke, saw it was given up, imported nothing
    runner._warm_torch_import()  # the next runner starts it again, and its close waits for it
    again = runner._warm.thread
    assert again is not None and again is not held
    deadline = time.monotonic() + 30
    while not runner._warm.started and time.monotonic() < deadline:  # the import began
        time.sleep(0.01)
    runner._end_warm_import()
    assert not again.is_alive() and runner._warm.started
