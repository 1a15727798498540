"""Finding a Ray Train job's workers from the driver's stderr log (no Ray needed: the log is
written here as the driver writes it, the processes are real)."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from trainguard.config.fault_params import FaultParams
from trainguard.launch.reach import WorkerNotHere
from trainguard.raytrain.workers import (
    SIGNAL_PATH_ENV,
    RayWorkerLauncher,
    RayWorkerTracker,
    ensure_local,
    signal_path,
)

LINES = """\
(TrainController pid=10) Attempting to start training worker group of size 2 with the following resources
(RayTrainWorker pid=21) trainguard-worker rank=0 pid=21 node=127.0.0.1
(RayTrainWorker pid=21) trainguard-worker rank=0 pid=21 node=127.0.0.1
(RayTrainWorker pid=22) trainguard-worker rank=1 pid=22 node=127.0.0.1
"""


def test_tracker_reads_worker_lines_once_with_the_time_it_read_them(tmp_path: Path) -> None:
    log = tmp_path / "rank0.stderr.log"
    now = [1.0]
    tracker = RayWorkerTracker(log, clock=lambda: now[0])
    assert tracker.poll() == []  # no log yet
    log.write_text(LINES + "(RayTrainWorker pid=31) trainguard-worker rank=0 pi")  # a partial line
    seen = tracker.poll()
    assert [(s.rank, s.pid, s.node, s.t) for s in seen] == [(0, 21, "127.0.0.1", 1.0), (1, 22, "127.0.0.1", 1.0)]
    assert tracker.controller_after(0.5) is not None and tracker.restart_notice_after(0.5) is not None
    now[0] = 2.0
    with open(log, "a") as f:  # the rest of the line: a restarted worker group
        f.write("d=31 node=127.0.0.1\n(TrainController pid=10) Attempting to start training worker group\n"
                "(RayTrainWorker pid=32) trainguard-worker rank=1 pid=32\n")
    assert tracker.pids() == {0: 31, 1: 32}
    assert [s.pid for s in tracker.started_after(1.5)] == [31, 32]
    latest = tracker.latest(1)
    assert latest is not None and latest.node is None  # a line without node= (an older driver)
    restart = tracker.restart_notice_after(1.5)
    assert restart is not None and restart[0] == 2.0


def test_the_fault_sees_the_workers_as_ranks_and_signals_the_latest_pid(tmp_path: Path) -> None:
    sleep = [sys.executable, "-c", "import time; time.sleep(60)"]
    other = subprocess.Popen(sleep)  # not a Ray worker
    worker = subprocess.Popen([*sleep, "ray::RayTrainWorker"])  # named as Ray names its workers
    try:
        log = tmp_path / "rank0.stderr.log"
        log.write_text(f"trainguard-worker rank=0 pid={other.pid} node=127.0.0.1\n")
        view = RayWorkerLauncher(_FakeDriver(log), RayWorkerTracker(log), world_size=2)  # type: ignore[arg-type]
        with pytest.raises(WorkerNotHere, match="rank=1"):
            view.ranks  # noqa: B018 -- rank 1 never printed its line
        log.write_text(log.read_text() + f"trainguard-worker rank=1 pid={worker.pid} node=127.0.0.1\n")
        assert view.ranks[1].pid == worker.pid and view.ranks[1].popen.poll() is None
        # a pid that is not a Ray worker process here (another node's pid, reused): refused
        with pytest.raises(WorkerNotHere, match="not a Ray worker process"):
            view.kill_rank(0, signal.SIGKILL)
        assert other.poll() is None
        view.kill_rank(1, signal.SIGKILL)
        assert worker.wait(timeout=10) == -signal.SIGKILL
        assert view.ranks[1].popen.poll() == -signal.SIGKILL
    finally:
        for proc in (other, worker):
            proc.kill()
            proc.wait()


def test_a_worker_on_another_node_is_refused() -> None:
    with pytest.raises(WorkerNotHere, match="runs on another node"):
        ensure_local(1, "203.0.113.9", rank=1)


class _FakeDriver:
    """The two things RayWorkerLauncher takes from the real launcher."""

    def __init__(self, log: Path) -> None:
        self.ranks = [type("Rank", (), {"stderr_log": log})()]

    def elapsed(self) -> float:
        return 0.0


def test_the_signal_path_is_api_for_a_cluster_at_ray_address_and_can_be_chosen() -> None:
    assert signal_path({}) == "pid"  # trainguard's own one-node head
    assert signal_path({"RAY_ADDRESS": "local"}) == "pid"
    assert signal_path({"RAY_ADDRESS": "10.0.0.1:6379"}) == "api"
    assert signal_path({"RAY_ADDRESS": "10.0.0.1:6379", SIGNAL_PATH_ENV: "pid"}) == "pid"
    assert signal_path({SIGNAL_PATH_ENV: "API"}) == "api"
    with pytest.raises(ValueError, match=f"{SIGNAL_PATH_ENV}='ssh'.*unset it for auto"):
        signal_path({SIGNAL_PATH_ENV: "ssh"})


def test_with_the_pid_path_off_no_local_pid_is_signalled(tmp_path: Path) -> None:
    """`api` mode without a Ray agent: the fault gets WorkerNotHere, the local process lives."""
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "ray::RayTrainWorker"])
    try:
        log = tmp_path / "rank0.stderr.log"
        log.write_text(f"trainguard-worker rank=0 pid={worker.pid} node=127.0.0.1\n")
        view = RayWorkerLauncher(_FakeDriver(log), RayWorkerTracker(log), world_size=1,  # type: ignore[arg-type]
                                 via_api=True)
        assert not view.via_api  # no agent: nothing can go through Ray
        with pytest.raises(WorkerNotHere, match="no Ray agent"):
            view.find(0)
        view.via_api = True  # the pid path off, as with an agent
        with pytest.raises(WorkerNotHere, match="pid path is off"):
            view.ranks[0].pid  # noqa: B018
        with pytest.raises(WorkerNotHere, match="no Ray agent"):
            view.kill_rank(0, signal.SIGKILL)
        assert worker.poll() is None
    finally:
        worker.kill()
        worker.wait()


def test_node_loss_is_for_ray_train_jobs_and_takes_kill_or_term() -> None:
    from trainguard.faults.base import FaultContext, FaultUnavailable
    from trainguard.faults.node_loss import NodeLossFault

    assert NodeLossFault.validate(FaultParams({"signal": "SIGTERM"})) == []
    assert "expected one of SIGKILL, SIGTERM" in NodeLossFault.validate(FaultParams({"signal": "SIGSTOP"}))[0][1]
    with pytest.raises(FaultUnavailable, match="not `kind: ray_train`"):
        NodeLossFault().setup(FaultContext(Path("/tmp"), Path("/tmp"), world_size=2))


class _Clock:
    """A clock the lookups advance: each sleep moves it on (no real waiting in a unit test)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_a_fault_waits_for_rays_state_to_record_the_worker_group() -> None:
    """The race a loaded cluster showed: the worker printed its step, the fault asked Ray Train's
    state, and the attempt was not RUNNING yet. The lookup is asked again until it is."""
    from trainguard.raytrain.agent import StateNotYet, wait_for_state

    clock, answers = _Clock(), ["not yet", "not yet", "not yet"]

    def lookup() -> dict[str, int]:
        if answers:
            answers.pop()
            raise StateNotYet("the Train run 'r' (RUNNING) has no running worker group now")
        return {"attempt": 1}

    assert wait_for_state(lookup, 30.0, clock=clock, sleep=clock.sleep) == {"attempt": 1}
    assert clock.now == pytest.approx(0.75)  # three answers of "not yet", 0.25 s apart


def test_a_real_absence_is_still_an_error_after_the_wait() -> None:
    from trainguard.raytrain.agent import StateNotYet, wait_for_state

    clock = _Clock()

    def never() -> None:
        raise StateNotYet("no live Train run named 'r' (runs: [])")

    with pytest.raises(LookupError, match=r"no live Train run named 'r' .*asked 121 times over 30 s") as info:
        wait_for_state(never, 30.0, clock=clock, sleep=clock.sleep)
    assert not isinstance(info.value, StateNotYet)  # the agent reports it as an absence
    assert clock.now == pytest.approx(30.0)


def test_a_state_that_cannot_answer_is_not_waited_for() -> None:
    from trainguard.raytrain.agent import wait_for_state

    clock, asked = _Clock(), []

    def no_tracking() -> None:
        asked.append(1)
        raise LookupError("Ray Train's state actor does not exist")

    with pytest.raises(LookupError, match="state actor"):
        wait_for_state(no_tracking, 30.0, clock=clock, sleep=clock.sleep)
    assert asked == [1] and clock.now == 0.0
