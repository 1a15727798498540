"""How a job's ranks run is its kind's backend (trainguard/launch/backend.py, docs/backends.md).

A third backend is one module and one registration: tests/backends/wrapped.py, registered here
and named by the job file's ``kind``, runs the smoke check end to end through its own launcher
shim. The two built-in backends answer what the callers ask instead of a ``ray_train`` flag."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.backends.wrapped import SHIM, WrappedBackend
from tests.helpers import TOY
from trainguard.config import load_config
from trainguard.config.backends import backend_for, register_backend, unregister_backend
from trainguard.errors import ConfigError
from trainguard.faults.kill_worker import KillWorkerFault
from trainguard.faults.node_loss import NodeLossFault
from trainguard.faults.soak import SoakFault
from trainguard.launch import LaunchSpec
from trainguard.launch.backend import CommandBackend
from trainguard.launch.launcher import Launcher, RunResult
from trainguard.launch.reach import ChildRanks, NoWatch, Restarts, WorkerSighting
from trainguard.raytrain.backend import RayTrainBackend
from trainguard.run.runner import JobRunner
from trainguard.session import check


def _job(where: Path, kind: str, log: Path) -> Path:
    path = where / "trainguard.yaml"
    path.write_text(
        "job:\n"
        f"  name: {kind}-toy\n"
        f"  kind: {kind}\n"
        f'  command: "python {TOY} --steps {{steps}} --seed {{seed}} --ckpt-dir {{checkpoint_dir}}"\n'
        '  resume_args: "--resume"\n'
        "  world_size: 2\n"
        f'  env: {{OMP_NUM_THREADS: "1", WRAPPED_LOG: "{log}"}}\n'
        "  metrics:\n"
        "    loss: 'step (?P<step>\\d+) loss (?P<value>\\S+)'\n"
        "  timeout: 60\n"
        "  stall_timeout: 20\n"
        "checks:\n"
        "  smoke: {steps: 5}\n"
    )
    return path


@pytest.fixture
def wrapped() -> Iterator[str]:
    """The test backend registered as ``kind: wrapped``, taken out afterwards."""
    register_backend("wrapped", WrappedBackend)
    try:
        yield "wrapped"
    finally:
        unregister_backend("wrapped")


def test_a_registered_backend_runs_the_smoke_check_its_own_way(tmp_path: Path, wrapped: str) -> None:
    log = tmp_path / "wrapped.jsonl"
    report = check(str(_job(tmp_path, wrapped, log)), only=["smoke"])
    (result,) = report.checks
    assert result.status == "passed", result.summary
    # every rank of every launch went through the backend's shim, which became the rank
    started = [json.loads(line) for line in log.read_text().splitlines()]
    assert started and len(started) % 2 == 0, started
    assert sorted({s["rank"] for s in started}) == ["0", "1"]
    assert all(s["argv"][1] == str(TOY) for s in started)
    assert result.reproduce is not None and str(SHIM) in result.reproduce


def test_a_kind_without_a_backend_is_refused_with_the_known_ones(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="unknown job kind 'wrapped'; expected one of command, ray_train"):
        load_config(_job(tmp_path, "wrapped", tmp_path / "log"))


def test_a_built_in_kind_cannot_be_replaced() -> None:
    with pytest.raises(ValueError, match="trainguard's own"):
        register_backend("command", WrappedBackend)
    assert isinstance(backend_for("command"), CommandBackend)


def test_the_runner_holds_its_kinds_backend_and_a_sibling_shares_it(tmp_path: Path, wrapped: str) -> None:
    job_file = load_config(_job(tmp_path, wrapped, tmp_path / "log"))
    runner = JobRunner(job_file)
    assert isinstance(runner.backend, WrappedBackend)
    assert runner.sibling(job_file).backend is runner.backend


def test_the_built_in_backends_answer_what_the_callers_ask(tmp_path: Path) -> None:
    command, ray = CommandBackend(), RayTrainBackend()
    spec = LaunchSpec(argv=["python", "train.py"], run_dir=tmp_path, world_size=4)
    assert command.launch_spec(spec).world_size == 4 and ray.launch_spec(spec).world_size == 1
    assert command.reproduce_argv(["python", "t.py"], 2) == ["torchrun", "--nproc-per-node=2", "t.py"]
    assert ray.reproduce_argv(["python", "t.py"], 2) == ["python", "t.py"]
    assert command.concurrent_runs() and not ray.concurrent_runs()
    assert command.ranks_are_children() and not ray.ranks_are_children()
    assert command.launch_env() == {} and ray.head is None  # nothing starts until a launch
    # each fault asks the backend what it needs
    assert KillWorkerFault.unavailable_for(command) is None
    assert "Ray actors" in str(KillWorkerFault.unavailable_for(ray))
    assert NodeLossFault.unavailable_for(ray) is None
    assert "not `kind: ray_train`" in str(NodeLossFault.unavailable_for(command))
    assert SoakFault.unavailable_for(command) is None and SoakFault.unavailable_for(ray) is not None


def test_a_command_jobs_fault_reaches_the_launchers_own_children(tmp_path: Path) -> None:
    """The drill driver asks the backend how its fault reaches the ranks: for a command job the
    fault gets the launcher itself, its preexec runs in the ranks, and nothing starts behind the
    launcher (no sightings, nothing to clear when the attempt ends)."""
    reach = CommandBackend().fault_reach("kill_rank", job_name="toy", world_size=2)
    assert isinstance(reach, ChildRanks)
    launcher = Launcher(LaunchSpec(argv=["python", "t.py"], run_dir=tmp_path, world_size=2))
    assert reach.open() is None and reach.launch_env() == {}
    hook = print
    assert reach.preexec(hook) is hook
    assert reach.target(launcher) is launcher
    watch = reach.watch(launcher)
    assert watch.poll() == [] and watch.pids() == {} and watch.started_after(0.0) == []
    assert watch.restart_notice_after(0.0) is None and not reach.outlives_attempt()
    reach.close()


def test_who_restarts_a_failed_attempt_is_the_backends_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    """trainguard relaunches a command job's group (the drill's budget); Ray Train restarts a
    dead worker inside the fit itself, so trainguard relaunches nothing after those faults and
    the recover verdict reads the restart from the watch."""
    command, ray = CommandBackend(), RayTrainBackend()
    assert command.drill_restarts("kill_rank", "recover", 3) == Restarts(relaunches=3, in_launch=False)
    assert ray.drill_restarts("kill_rank", "recover", 3) == Restarts(relaunches=0, in_launch=True)
    assert ray.drill_restarts("node_loss", "recover", 2) == Restarts(relaunches=0, in_launch=True)
    assert ray.drill_restarts("hang", "recover", 3) == Restarts(relaunches=3, in_launch=False)  # unseen by Ray
    assert ray.drill_restarts("kill_rank", "fail_clean", 1) == Restarts(relaunches=1, in_launch=False)
    assert command.restart_note(2) == "" and ray.restart_note(0) == ""
    assert "FailureConfig(max_failures=2)" in ray.restart_note(2)
    # a ray_train job's fault reaches its workers as Ray's signal path says (no Ray started here)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("TRAINGUARD_RAY_SIGNALS", "pid")
    reach = ray.fault_reach("kill_rank", job_name="toy", world_size=2)
    assert reach.preexec(print) is None and reach.outlives_attempt() and reach.open() is None
    assert reach.launch_env() == {} and ray.head is None
    monkeypatch.setenv("TRAINGUARD_RAY_SIGNALS", "bogus")
    with pytest.raises(ValueError, match="TRAINGUARD_RAY_SIGNALS"):
        ray.fault_reach("kill_rank", job_name="toy", world_size=2)


def test_the_ranks_own_metrics_writer_is_read_where_the_backend_keeps_it(tmp_path: Path) -> None:
    result = RunResult("ok", ["python"], tmp_path, 1, 0, [], [], 1.0, None)
    assert CommandBackend().writer_record(result)[0] is None
    summary, where = RayTrainBackend().writer_record(result)
    assert summary is None and "ray_tracking.json" in where and str(tmp_path) in where


class _Sightings(NoWatch):
    """A watch of ranks that run behind the launcher, fed by the test."""

    def __init__(self) -> None:
        self.seen: list[WorkerSighting] = []

    def pids(self) -> dict[int, int]:
        return {s.rank: s.pid for s in self.seen}

    def started_after(self, t: float, rank: int | None = None) -> list[WorkerSighting]:
        return [s for s in self.seen if s.t > t and rank in (None, s.rank)]


class _Elsewhere(ChildRanks):
    """The reach of a backend whose ranks run elsewhere: not a line of drills/ or faults/ knows it."""

    def __init__(self, view: object) -> None:
        super().__init__()
        self.sightings, self.view, self.ready_for = _Sightings(), view, []

    def preexec(self, hook: object) -> None:
        return None

    def watch(self, launcher: object) -> _Sightings:  # type: ignore[override]
        return self.sightings

    def ready(self, launcher: object, rank: int) -> None:
        self.ready_for.append(rank)

    def target(self, launcher: object) -> object:  # type: ignore[override]
        return self.view


def test_the_drill_driver_reaches_the_ranks_only_through_the_backends_reach(tmp_path: Path) -> None:
    """A third backend's ranks, reached its own way: the fault strikes the reach's target, the
    pids at the fault are the watch's, and a process the watch sees start after the fault is the
    backend's own restart (the first step after it is noted), with no edit of the driver."""
    from types import SimpleNamespace

    from trainguard.config import parse_config
    from trainguard.drills.driver import Driver
    from trainguard.faults.base import Fault
    from trainguard.launch import MetricPoint

    struck: list[object] = []

    class _Struck(Fault):
        kind = "struck-test"

        def inject(self, launcher: object) -> None:
            struck.append(launcher)
            self.injected_at = 1.0

    text = ("job:\n  name: toy\n  command: \"python t.py --steps {steps} --ckpt-dir {checkpoint_dir}\"\n"
            "  resume_args: \"--resume\"\n  metrics: {loss: 'step (?P<step>\\d+) loss (?P<value>\\S+)'}\n"
            "checks:\n  drills:\n    - {name: f, fault: kill_rank, rank: 0, after_step: 2}\n")
    spec = parse_config(text, path=tmp_path / "t.yaml").checks.drills[0]
    ranks = [SimpleNamespace(rank=0, popen=SimpleNamespace(poll=lambda: None), stderr_log=tmp_path / "r0")]
    launcher = SimpleNamespace(spec=SimpleNamespace(restart_count=0, run_dir=tmp_path), ranks=ranks,
                               elapsed=lambda: 1.0, exit_seen_at={})
    view = SimpleNamespace(ranks=ranks)
    reach = _Elsewhere(view)
    reach.sightings.seen.append(WorkerSighting(0, 100, None, 0.5))
    driver = Driver(_Struck({}, rank=0, after_step=2), spec, "loss", 0, reach)
    try:
        for step in (1, 2):
            driver.on_metric(MetricPoint("loss", step, 1.0, rank=0, t=float(step)), launcher)  # type: ignore[arg-type]
        assert struck == [view] and driver.info.ray_workers_at_injection == {0: 100}
        assert reach.ready_for and driver.info.tracker is reach.sightings
        driver.on_metric(MetricPoint("loss", 3, 1.0, rank=0, t=3.0), launcher)  # type: ignore[arg-type]
        assert driver.info.ray_first_step_after_restart_t is None  # no new process yet
        reach.sightings.seen.append(WorkerSighting(0, 200, None, 3.5))
        driver.on_metric(MetricPoint("loss", 3, 1.0, rank=0, t=4.0), launcher)  # type: ignore[arg-type]
        assert driver.info.ray_first_step_after_restart_t == 4.0
    finally:
        driver.finish()
