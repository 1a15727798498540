"""Drills on a three-node Ray cluster on one machine, reaching the workers only through Ray's API.

:class:`~trainguard.raytrain.cluster.LocalRayCluster` starts a head (0 CPUs: no Train worker
there) and worker nodes ``a`` and ``b`` (2 CPUs each), each its own ``ray start``; the module
points trainguard at it the way a site does (``RAY_ADDRESS`` and the cluster's token in the
environment), so trainguard runs as it would on a real cluster's head: the drill finds the Train
worker of world rank r in Ray Train's state and acts on it through an actor pinned to its node.
The pid path is off (``RAY_ADDRESS`` set; ``TRAINGUARD_RAY_SIGNALS=api`` makes it explicit): a
fault that tried a local pid would raise, and every test asserts the evidence says
``via: ray_api``. As root the worker nodes also run in pid namespaces of their own, like nodes on
other machines: the pids Ray reports for their workers name no Ray worker here, so nothing but
Ray's API could have reached them (the tests assert that too).

The job is tests/data/jobs/toy_ray.py (2 workers x 1 CPU, a gloo all-reduce per step, a checkpoint
every 3 steps): both workers fit on one worker node, so losing one node leaves room for exactly
the 2 workers. With 2 CPUs per worker (``resources_per_worker: {CPU: 2}``) they spread over both
nodes and losing one leaves no room. A lost node is started again before the next test (the
node_loss fault does it when it clears, for a cluster trainguard started; the fixture checks).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest

from tests.helpers import report_evidence
from trainguard.config import load_config
from trainguard.drills import run_drill
from trainguard.raytrain.cluster import LocalRayCluster, NodeSpec, pid_namespaces_available
from trainguard.raytrain.local_ray import running_ray_processes
from trainguard.report import CheckResult
from trainguard.run.runner import JobRunner

pytestmark = [pytest.mark.ray, pytest.mark.timeout(900)]
pytest.importorskip("ray.train", reason="needs ray[train] (pip install trainguard[ray])")

JOBS = Path(__file__).resolve().parents[1] / "data" / "jobs"
STEPS = 40
#: the default kill drill: 80 steps of 0.25 s; with 40 (8.5 s after step 6) Ray's state had not
#: shown the run live before it finished, once, beside a load of 8
KILL_STEPS = 80
JOB = """
job:
  name: toy-ray-cluster
  kind: ray_train
  train_func: "toy_ray:train_func"
  config: {{steps: "{{steps}}", seed: "{{seed}}", ckpt_every: 3, sleep: 0.25{extra}}}
  scaling: {{num_workers: 2, resources_per_worker: {{CPU: {cpus}{resources}}}}}
  cwd: {cwd}
  env: {{OMP_NUM_THREADS: "1"}}
  metrics: [loss]
  max_restarts: {max_restarts}
  timeout: 300
  stall_timeout: 120
checks:
  drills:
    - {drill}
"""

Drill = Callable[..., CheckResult]
#: worker nodes in pid namespaces of their own (root); else why not
NO_PID_NAMESPACES = pid_namespaces_available()


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalRayCluster]:
    """The three-node cluster, used as trainguard would use a site's (``RAY_ADDRESS``)."""
    isolated = NO_PID_NAMESPACES is None
    nodes = LocalRayCluster([NodeSpec("a", pid_namespace=isolated), NodeSpec("b", pid_namespace=isolated)])
    with pytest.MonkeyPatch.context() as mp:
        try:
            nodes.start()
            print(f"\ncluster of 3 nodes started in {nodes.start_s:.1f} s; worker nodes in pid "
                  f"namespaces: {NO_PID_NAMESPACES or 'yes'}")
            for key, value in nodes.client_env().items():
                mp.setenv(key, value)
            # what trainguard's own head sets (a RAY_ADDRESS cluster gets nothing from trainguard)
            mp.setenv("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.25")
            mp.setenv("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")
            mp.setenv("TRAINGUARD_RAY_SIGNALS", "api")
            yield nodes
        finally:
            dirs = [n.cluster.temp_dir for n in [nodes.head, *nodes.nodes.values()]
                    if n.cluster is not None and n.cluster.temp_dir is not None]
            nodes.stop()
            print(f"\ncluster stopped in {nodes.stop_s:.1f} s; restarts {nodes.restarts}")
            assert not nodes.leftover, f"Ray processes left behind: {nodes.leftover}"
            left = [p.pid for d in dirs for p in running_ray_processes(d)]
            assert not left, f"Ray processes left behind: {left}"


@pytest.fixture(scope="module")
def drill(cluster: LocalRayCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Drill]:
    """``drill(spec, max_restarts=1, extra="", cpus=1, resources="")`` runs one drill of the toy
    job on the cluster (``resources``: more of ``resources_per_worker``, e.g. ``", tg_node_a: 0.5"``);
    runners with the same worker shape share the uninterrupted reference run."""
    runners: dict[tuple[int, str], JobRunner] = {}

    def run(spec: str, *, max_restarts: int = 1, extra: str = "", cpus: int = 1, resources: str = "") -> CheckResult:
        assert not cluster.lost(), f"a node is still lost: {cluster.lost()}"
        folder = tmp_path_factory.mktemp("job")
        path = folder / "trainguard.yaml"
        path.write_text(JOB.format(cwd=JOBS, max_restarts=max_restarts, drill=spec, cpus=cpus, resources=resources,
                                   extra=f", {extra}" if extra else ""))
        job = load_config(path)
        drill_spec = job.checks.drills[0]
        first = runners.get((cpus, resources))
        if first is not None:
            runner = first.sibling(job)
            request = runner.request_for(drill_spec, world_size=job.job.world_size)
            runner.scheduling.offer_reference(request, first.scheduling.reference(request))
        else:
            runner = runners[cpus, resources] = JobRunner(job)
        t0 = time.monotonic()
        try:
            return run_drill(runner, drill_spec)
        finally:
            print(f"drill wall time {time.monotonic() - t0:.1f} s")
            # the node_loss fault starts its lost node again when it clears; never leave one down
            cluster.restart_lost()

    try:
        yield run
    finally:
        for runner in runners.values():
            runner.close()


def show(result: CheckResult) -> None:
    """The verdict and the measured times (shown with pytest -rA)."""
    ev = report_evidence(result)
    print(result.status, result.summary)
    keys = ("detected_after_s", "lost_steps", "restarts", "fault_to_first_step_after_restart_s",
            "exit_after_s", "resumed_from_step", "ray_api")
    print({k: ev[k] for k in keys if k in ev}, f"duration {result.duration_s:.1f} s")
    fault = ev.get("fault_evidence", {})
    print({k: fault.get(k) for k in ("via", "pid", "node_id", "raylet_pid", "ranks_on_node", "lookup",
                                     "stop_took_s", "node_restarted", "node_restart_s")},
          {k: fault.get("ray_api", {}).get(k) for k in ("lookup", "lookup_s", "took_s")})


def assert_through_ray(result: CheckResult, rank: int) -> dict[str, object]:
    """The fault reached the worker of ``rank`` through Ray: its evidence says so."""
    fault = report_evidence(result)["fault_evidence"]
    assert fault["via"] == "ray_api", fault
    assert report_evidence(result)["ray_api"]["pid_path"] is False
    workers = report_evidence(result).get("ray", {}).get("workers_at_fault")
    if workers is not None:  # the judge of Ray Train's recovery read the workers' lines
        assert fault["pid"] == workers[rank], fault
    assert isinstance(fault["pid"], int)
    if NO_PID_NAMESPACES is None:  # the worker's pid is its node's: no Ray worker here has it
        with contextlib.suppress(psutil.Error):
            assert "RayTrainWorker" not in " ".join(psutil.Process(fault["pid"]).cmdline())
    return fault  # type: ignore[no-any-return]


def test_the_cluster_has_a_head_and_two_worker_nodes(cluster: LocalRayCluster) -> None:
    from trainguard.raytrain.agent import RayAgent

    with RayAgent(cluster.client_env()) as agent:
        nodes = agent.request("nodes")
    alive = [n for n in nodes if n["alive"]]
    assert len(alive) == 3 and sum(n["head"] for n in alive) == 1
    assert sorted(n["resources"].get("CPU", 0) for n in alive) == [0, 2, 2]
    assert {k for n in alive for k in n["resources"] if k.startswith("tg_node_")} == {"tg_node_a", "tg_node_b"}
    assert os.environ["RAY_ADDRESS"] == cluster.client_env()["RAY_ADDRESS"]


@pytest.mark.slow
def test_kill_rank_through_rays_api_recovers(drill: Drill) -> None:
    """The kill drill across the cluster's nodes (80 steps: ~80 s with its reference). Slow since
    issue 44 paid for the step records with it: the default run keeps the cluster's own test above
    and a kill through Ray's API on one node (tests/ray/test_digits_ray.py).

    Steps of 0.25 s: finding the worker through Ray's state (and starting the node's actor) took
    4.6 s beside other tests; with 20 steps the run had finished before the signal, and with 40
    once under a load of 8 (Ray's state had not shown the run live in the 8.5 s after step 6)."""
    result = drill(f"{{name: kill, fault: kill_rank, rank: 1, steps: {KILL_STEPS}, after_step: 6, max_lost_steps: 5}}")
    show(result)
    assert result.status == "passed", result.summary
    fault = assert_through_ray(result, 1)
    api = fault["ray_api"]
    assert isinstance(api, dict) and api["sent"] and api["signal"] == "SIGKILL"
    assert api["target"]["world_rank"] == 1 and api["target"]["actor_id"]
    ray = report_evidence(result)["ray"]
    assert ray["restarts"] == 1 and fault["pid"] not in ray["workers_after"].values()


@pytest.mark.slow
def test_kill_rank_through_rays_api_without_a_failure_budget_fails(drill: Drill) -> None:
    defect = drill(f"{{name: kill, fault: kill_rank, rank: 1, steps: {STEPS}, after_step: 8}}",
                   max_restarts=0)
    show(defect)
    assert defect.status == "failed" and "FailureConfig(max_failures=0)" in defect.summary
    assert_through_ray(defect, 1)


@pytest.mark.slow
def test_node_loss_with_room_left_recovers_on_the_other_node(drill: Drill) -> None:
    spec = (f"{{name: node, fault: node_loss, rank: 1, steps: {STEPS}, after_step: 8, "
            "max_lost_steps: 5}")
    result = drill(spec)
    show(result)
    assert result.status == "passed", result.summary
    fault = assert_through_ray(result, 1)
    assert fault["ranks_on_node"] == [0, 1]  # both workers packed on the lost node
    assert fault["node_restarted"], fault
    assert report_evidence(result)["ray"]["restarts"] == 1 and 0 <= report_evidence(result)["lost_steps"] <= 5
    # planted defect: a function that ignores its checkpoint after the restart
    defect = drill(spec, extra="ignore_checkpoint: true")
    show(defect)
    assert defect.status == "failed" and "all progress lost" in defect.summary
    # planted defect: no failure budget
    defect = drill(spec, max_restarts=0)
    show(defect)
    assert defect.status == "failed" and "FailureConfig(max_failures=0)" in defect.summary


@pytest.mark.slow
def test_node_loss_with_no_room_left_must_fail_clean(drill: Drill) -> None:
    """2 CPUs per worker: one worker per node, and the node left has no room for a new group.
    Clean: ``max_restarts: 0``, the fit fails at once. Planted: ``max_restarts: 1`` -- Ray Train
    (2.60) retries starting the group forever (a start that times out is a controller failure,
    ``FailureConfig(controller_failure_limit=-1)``), so the job hangs past the deadline."""
    spec = (f"{{name: node-full, fault: node_loss, rank: 1, steps: {STEPS}, after_step: 8, "
            "expect: fail_clean, deadline: 30}")
    result = drill(spec, cpus=2, max_restarts=0)
    show(result)
    assert result.status == "passed", result.summary
    fault = assert_through_ray(result, 1)
    assert fault["ranks_on_node"] == [1]  # one worker per node
    assert report_evidence(result)["checkpoint"]["intact"] and report_evidence(result)["exit_after_s"] <= 30
    defect = drill(spec, cpus=2, max_restarts=1)
    show(defect)
    assert defect.status == "failed" and "the job hung" in defect.summary


@pytest.mark.slow
def test_a_hung_worker_on_another_node_is_found_by_the_stall_rule_and_ended_through_ray(drill: Drill) -> None:
    spec = (f"{{name: hang, fault: hang, rank: 1, steps: {STEPS}, after_step: 8, stall_timeout: 15, "
            "max_lost_steps: 5}")
    result = drill(spec)
    show(result)
    assert result.status == "passed", result.summary
    fault = report_evidence(result)["fault_evidence"]
    assert fault["via"] == "ray_api" and fault["state_after_stop"] == "stopped", fault
    assert fault["ray_api"]["continued"]["via"] == "ray_api"  # SIGCONT through Ray at the end
    assert report_evidence(result)["attempts"][0]["outcome"] == "hung" and report_evidence(result)["restarts"] == 1
    # planted defect: the resumed fit ignores its checkpoint
    defect = drill(spec, extra="ignore_checkpoint: true")
    show(defect)
    assert defect.status == "failed" and "all progress lost" in defect.summary


DIGITS_DRILLS = """
checks:
  drills:
    - {name: kill-worker1, fault: kill_rank, rank: 1, steps: 30, after_step: 6, max_lost_steps: 8}
    - {name: lose-node-of-worker1, fault: node_loss, rank: 1, steps: 30, after_step: 6, max_lost_steps: 8}
"""


@pytest.mark.slow
def test_the_digits_ray_example_across_three_nodes(cluster: LocalRayCluster, tmp_path: Path) -> None:
    """examples/digits_ray unchanged on the cluster: its kill drill and a node-loss drill pass."""
    from tests.helpers import copy_digits_ray_example
    from trainguard.session import check

    job = copy_digits_ray_example(tmp_path, DIGITS_DRILLS)
    t0 = time.monotonic()
    report = check(job)
    print(f"\ndigits_ray drills on 3 nodes: {time.monotonic() - t0:.1f} s")
    assert not cluster.lost(), cluster.lost()
    for result in report.checks:
        show(result)
    for result in report.checks:
        assert result.status == "passed", f"{result.name}: {result.summary}"
        assert report_evidence(result)["fault_evidence"]["via"] == "ray_api"
        assert report_evidence(result)["ray"]["restarts"] == 1
    assert report_evidence(report.checks[1])["fault_evidence"]["node_restarted"]


@pytest.mark.slow
def test_the_cluster_command_writes_its_environment_and_stops_on_sigterm(tmp_path: Path) -> None:
    """``python -m trainguard.raytrain.cluster``: the cluster a user rehearses node loss on."""
    import signal
    import subprocess
    import sys

    env_file = tmp_path / "cluster.env"
    proc = subprocess.Popen([sys.executable, "-m", "trainguard.raytrain.cluster", "--env-file",
                             str(env_file), "--nodes", "1"], stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not env_file.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.25)
        keys = dict(line.split("=", 1) for line in env_file.read_text().splitlines())
        assert keys["RAY_ADDRESS"].startswith("127.0.0.1:") and keys["RAY_AUTH_MODE"] == "token"
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    assert "cluster of 2 nodes up" in err and "left: nothing" in err


@pytest.mark.slow
def test_crash_loop_that_follows_a_node_names_a_policy_that_puts_the_rank_back(drill: Drill) -> None:
    """``fault: crash_loop`` with ``node: first``: rank 0's worker is killed (through Ray's API)
    whenever it runs on the node it ran on in attempt 0. Ray Train's FailureConfig has no
    quarantine: the verdict follows where Ray placed the rank in each generation -- put back on
    the failing node fails, naming it; moved off it, the job completes and passes."""
    result = drill(f"{{name: loop, fault: crash_loop, steps: {STEPS}, after_step: 6, "
                   "params: {node: first, max_attempts: 3}}", max_restarts=2)
    show(result)
    evidence = report_evidence(result)
    attempts = evidence["attempts"]
    print([(a["attempt"], a["struck_at_step"], a.get("node"), a["wait_before_s"]) for a in attempts])
    bad = attempts[0]["node"]
    assert bad is not None and attempts[0]["struck_at_step"] is not None
    back = [a["attempt"] for a in attempts[1:] if a.get("node") == bad]
    if back:
        assert result.status == "failed", result.summary
        assert f"attempt {back[0]} put the rank back on node {bad}, where it failed before" in result.summary
    else:
        assert result.status == "passed", result.summary


@pytest.mark.slow
def test_crash_loop_names_a_policy_that_pins_the_rank_to_the_failing_node(drill: Drill) -> None:
    """The planted defect of the node mode on a real run: every worker needs ``tg_node_a``, a
    resource only node ``a`` has (a placement constraint that outlives the failure, as a node
    selector or a reservation does), so Ray Train puts the restarted rank back on the node where it
    failed, in every generation; the drill fails, naming the node."""
    # KILL_STEPS: the kill through Ray's API must land before a generation's last step (at 40 steps
    # one run's kill came after the job completed)
    result = drill(f"{{name: loop-pinned, fault: crash_loop, steps: {KILL_STEPS}, after_step: 6, "
                   "params: {node: first, max_attempts: 3}}", max_restarts=2, resources=", tg_node_a: 0.5")
    show(result)
    attempts = report_evidence(result)["attempts"]
    print([(a["attempt"], a["struck_at_step"], a.get("node"), a["wait_before_s"]) for a in attempts])
    bad = attempts[0]["node"]
    assert bad is not None and len(attempts) >= 2 and all(a.get("node") == bad for a in attempts), attempts
    assert result.status == "failed", result.summary
    assert f"attempt 1 put the rank back on node {bad}, where it failed before" in result.summary
