"""The ``network`` fault through the base.py contract, on a real job run by the Launcher.

The job (written to tmp) makes one HTTP request per step to the service the fault proxies, and
prints how long it took; the fault is injected from the launcher's monitor thread after a step
and cleared a few steps later, as a drill does. The MLflow target starts a real ``mlflow server``
(slow to start here: ``slow``) and must leave no process behind.
"""

from __future__ import annotations

import re
import socket
import statistics
import sys
import textwrap
import urllib.request
from pathlib import Path
from typing import Any

import psutil
import pytest

from trainguard.config.fault_params import FaultParams
from trainguard.errors import UsageError
from trainguard.faults.base import FaultContext
from trainguard.faults.network import NetworkFault
from trainguard.launch import Launcher, LaunchSpec, MetricPoint, RunResult

JOB = textwrap.dedent('''
    """Each step: one HTTP request to the proxied service (mode get:PATH), or one metric logged to
    MLflow's REST API (mode mlflow:retry retries until it is stored, mlflow:drop gives up after
    one try of 1 s -- the defect: a metric lost when the tracking server is slow)."""
    import json, os, sys, time, urllib.request

    steps, pause, env_name, mode = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3], sys.argv[4]
    url = os.environ.get("MLFLOW_TRACKING_URI") or "http://" + os.environ[env_name]

    def post(endpoint, body, timeout):
        req = urllib.request.Request(url + "/api/2.0/mlflow/" + endpoint,
                                     data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.loads(resp.read())

    if mode.startswith("mlflow"):
        run_id = post("runs/create", {"experiment_id": "0"}, 30)["run"]["info"]["run_id"]
    for step in range(1, steps + 1):
        started = time.monotonic()
        ok = 0
        while not ok:
            try:
                if mode.startswith("get:"):
                    with urllib.request.urlopen(url + mode[4:], timeout=5) as resp:
                        resp.read()
                else:
                    post("runs/log-metric", {"run_id": run_id, "key": "loss", "value": 1 / step,
                                             "timestamp": int(time.time() * 1000), "step": step},
                         10 if mode == "mlflow:retry" else 1)
                ok = 1
            except OSError as exc:
                print(f"step {step}: request failed: {exc}", file=sys.stderr, flush=True)
                if mode != "mlflow:retry":
                    break
                time.sleep(0.2)
        ms = (time.monotonic() - started) * 1000
        print(f"step {step} loss {1 / step:.4f} req_ms {ms:.1f} ok {ok}", flush=True)
        time.sleep(pause)
''')

REGEXES = {
    "loss": r"step (?P<step>\d+) loss (?P<value>\S+)",
    "req_ms": r"step (?P<step>\d+) .*req_ms (?P<value>\S+)",
    "ok": r"step (?P<step>\d+) .* ok (?P<value>\d)",
}


@pytest.fixture
def service(http_service: str) -> str:
    """The job's upstream: a real HTTP service on loopback (tests/conftest.py)."""
    return http_service


def run_with_fault(fault: NetworkFault, tmp_path: Path, *, steps: int, clear_after: int,
                   pause: float = 0.05, mode: str = "get:/", regexes: dict[str, str] = REGEXES,
                   verify: list[list[str]] | None = None) -> tuple[RunResult, dict[int, float]]:
    """Run the job with ``fault`` set up, injected after ``fault.after_step``, cleared after step
    ``clear_after``, verified, torn down in finally -- the drill's sequence."""
    job = tmp_path / "job.py"
    job.write_text(JOB)
    ctx = FaultContext(work_dir=tmp_path / "fault", checkpoint_dir=tmp_path / "ckpt", world_size=1)
    fault.setup(ctx)
    try:
        spec = LaunchSpec(
            argv=[sys.executable, str(job), str(steps), str(pause), fault.params.text("env"), mode],
            run_dir=tmp_path / "run", env=fault.launch_env(ctx), metric_regexes=regexes,
            timeout=120, stall_timeout=60,
        )
        launcher = Launcher(spec)

        def on_metric(point: MetricPoint, launcher: Launcher) -> None:
            if point.name != "loss" or point.rank != fault.rank:
                return
            if point.step == fault.after_step:
                fault.inject(launcher)
            elif point.step == clear_after:
                fault.clear()

        launcher.on_metric.append(on_metric)
        result = launcher.run()
        fault.clear()
        if verify is not None:  # as a `continue` drill: after clear, before teardown
            verify.append(fault.verify_continue(result))
    finally:
        fault.clear()
        fault.teardown()
    return result, result.trajectory("req_ms")


def phases(times: dict[int, float], inject: int, clear: int) -> tuple[list[float], list[float], list[float]]:
    before = [v for s, v in times.items() if s <= inject]
    during = [v for s, v in times.items() if inject + 1 < s <= clear]  # the step in flight may miss it
    after = [v for s, v in times.items() if s > clear + 1]
    return before, during, after


def test_latency_slows_the_job_and_clearing_restores_it(service: str, tmp_path: Path) -> None:
    fault = NetworkFault(FaultParams({"toxic": "latency", "attributes": {"latency": 300}, "upstream": service}),
                         after_step=3)
    result, times = run_with_fault(fault, tmp_path, steps=14, clear_after=8)
    assert result.ok, result.reason
    before, during, after = phases(times, 3, 8)
    print(f"request ms before {before}, during {during}, after {after}")
    assert statistics.median(during) >= 290
    assert statistics.median(before) < 150 and statistics.median(after) < 150
    evidence = fault.evidence().to_dict()
    assert evidence["toxic"] == "latency" and evidence["attributes"] == {"latency": 300}
    assert evidence["toxiproxy"] == "embedded (trainguard)" and evidence["errors"] == []
    assert evidence["injected_at_s"] is not None and evidence["cleared_at_s"] > evidence["injected_at_s"]
    assert evidence["toxic_applied"]["attributes"] == {"latency": 300, "jitter": 0}
    assert evidence["proxy"] != service and evidence["upstream"] == service


def test_proxy_down_fails_requests_until_cleared(service: str, tmp_path: Path) -> None:
    fault = NetworkFault(FaultParams({"down": True, "upstream": service, "env": "MY_SERVICE"}), after_step=2)
    result, _ = run_with_fault(fault, tmp_path, steps=10, clear_after=5, pause=0.1)
    assert result.ok, result.reason
    ok = result.trajectory("ok")
    assert all(ok[s] == 1 for s in (1, 2)) and all(ok[s] == 1 for s in (8, 9, 10)), ok
    assert all(ok[s] == 0 for s in (4, 5)), ok
    assert "request failed" in result.log_path(0).read_text()
    assert fault.evidence().down is True


def test_launch_env_and_placeholders(service: str, tmp_path: Path) -> None:
    fault = NetworkFault(FaultParams({"toxic": "timeout", "attributes": {"timeout": 0}, "upstream": service,
                          "env": "REDIS_ADDR"}))
    ctx = FaultContext(work_dir=tmp_path, checkpoint_dir=tmp_path, world_size=1)
    fault.setup(ctx)
    try:
        env = fault.launch_env(ctx)
        assert list(env) == ["REDIS_ADDR"] and env["REDIS_ADDR"] == fault.placeholders()["proxy_addr"]
        with urllib.request.urlopen(f"http://{env['REDIS_ADDR']}/", timeout=5) as resp:
            assert resp.read() == b"hello"  # the proxy passes traffic before the fault
    finally:
        fault.teardown()
        fault.teardown()  # idempotent
    assert fault.evidence().errors == []


@pytest.mark.parametrize(("params", "key"), [
    ({"upstream": "127.0.0.1:1"}, "toxic"),
    ({"toxic": "latency"}, "service"),
    ({"toxic": "latency", "service": "mlflow", "upstream": "127.0.0.1:1"}, "service"),
    ({"toxic": "gremlin", "upstream": "127.0.0.1:1"}, "toxic"),
    ({"toxic": "latency", "attributes": {"latncy": 5}, "upstream": "127.0.0.1:1"}, "attributes.latncy"),
    ({"toxic": "latency", "attributes": {"latency": "5ms"}, "upstream": "127.0.0.1:1"}, "attributes.latency"),
    ({"toxic": "latency", "stream": "both", "upstream": "127.0.0.1:1"}, "stream"),
    ({"toxic": "latency", "toxicity": 2, "upstream": "127.0.0.1:1"}, "toxicity"),
    ({"toxic": "latency", "upstream": "nohost"}, "upstream"),
    ({"toxic": "latency", "service": "redis"}, "service"),
    ({"toxic": "latency", "down": True, "upstream": "127.0.0.1:1"}, "toxic"),
    ({"toxic": "latency", "upstream": "127.0.0.1:1", "env": "NOT A NAME"}, "env"),
    ({"toxic": "latency", "upstream": "127.0.0.1:1", "bogus": 1}, "bogus"),
    # wrong types and huge numbers: a problem naming the key, never a TypeError or OverflowError
    ({"toxic": ["latency"], "upstream": "127.0.0.1:1"}, "toxic"),
    ({"toxic": "latency", "toxicity": 10**400, "upstream": "127.0.0.1:1"}, "toxicity"),
    ({"toxic": "latency", "attributes": {"latency": 10**400}, "upstream": "127.0.0.1:1"}, "attributes.latency"),
    ({"toxic": "latency", "upstream": "127.0.0.1:1", "listen": 8080}, "listen"),
    ({"toxic": "latency", "upstream": "127.0.0.1:1", "listen": "0.0.0.0"}, "listen"),
])
def test_validate_names_the_key_and_the_fix(params: dict[str, Any], key: str) -> None:
    problems = NetworkFault.validate(FaultParams(params))
    assert key in [k for k, _ in problems], problems
    assert all(message and len(message) < 400 for _, message in problems)  # a huge value is cut


def test_setup_refuses_invalid_params(tmp_path: Path) -> None:
    fault = NetworkFault(FaultParams({"toxic": "latency", "attributes": {"latency": -5}, "upstream": "127.0.0.1:1"}))
    with pytest.raises(UsageError, match=r"attributes\.latency: expected an integer from 0 to"):
        fault.setup(FaultContext(tmp_path, tmp_path, 1))


def test_valid_params_have_no_problems() -> None:
    assert NetworkFault.validate(FaultParams({"toxic": "bandwidth", "attributes": {"rate": 10},
                                  "stream": "upstream", "toxicity": 0.5, "service": "mlflow"})) == []
    assert NetworkFault.validate(FaultParams({"down": True, "upstream": "[::1]:5000"})) == []
    assert NetworkFault.validate(FaultParams({"down": True, "upstream": "[::1]:5000", "listen": "10.0.0.5:0"})) == []


def _lan_address() -> str | None:
    """An address of this machine that is not loopback, or None."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))  # UDP: nothing is sent
        except OSError:
            return None
        address = str(probe.getsockname()[0])
    return None if address.startswith("127.") else address


def test_listen_param_puts_the_proxy_on_a_lan_address(service: str, tmp_path: Path) -> None:
    """`listen` is the drill's explicit opt-in to a non-loopback proxy (the embedded server
    refuses one otherwise): ranks on other hosts get an address they can reach."""
    lan = _lan_address()
    if lan is None:
        pytest.skip("this machine has no non-loopback IPv4 address")
    fault = NetworkFault(FaultParams({"toxic": "latency", "attributes": {"latency": 1}, "upstream": service,
                          "listen": f"{lan}:0"}))
    ctx = FaultContext(work_dir=tmp_path, checkpoint_dir=tmp_path, world_size=1)
    fault.setup(ctx)
    try:
        address = fault.launch_env(ctx)["TRAINGUARD_PROXY_ADDR"]
        assert address.startswith(f"{lan}:") and address == fault.evidence().proxy
        with urllib.request.urlopen(f"http://{address}/", timeout=5) as resp:
            assert resp.read() == b"hello"
    finally:
        fault.teardown()


def _descendants() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def step_seconds(result: RunResult) -> dict[int, float]:
    """Step -> seconds since the previous step's line (rank 0)."""
    t = {p.step: p.t for p in result.points if p.name == "loss" and p.rank == 0}
    return {s: t[s] - t[s - 1] for s in sorted(t) if s - 1 in t}


@pytest.mark.slow  # mlflow server takes 40-90 s to start on this 2-core machine
def test_mlflow_behind_the_proxy_every_metric_arrives_and_no_process_is_left(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # MLflow's job runner on: its huey consumers are what a partial stop leaves behind
    monkeypatch.setenv("MLFLOW_SERVER_ENABLE_JOB_EXECUTION", "true")
    before = _descendants()
    fault = NetworkFault(FaultParams({"toxic": "latency", "attributes": {"latency": 1500}, "service": "mlflow"}),
                         after_step=2)
    seen: set[int] = set()
    original_inject = fault.inject

    def inject_and_count(launcher: Launcher) -> None:
        seen.update(_descendants() - before)
        original_inject(launcher)

    fault.inject = inject_and_count  # type: ignore[method-assign]
    verify: list[list[str]] = []
    result, _ = run_with_fault(fault, tmp_path, steps=10, clear_after=6, mode="mlflow:retry",
                               regexes={"loss": REGEXES["loss"]}, verify=verify)
    assert result.ok, result.reason
    _, during, after = phases(step_seconds(result), 2, 6)
    # a logged metric takes 0.2-0.7 s on this loaded machine without the toxic
    assert min(during) >= 1.5 and statistics.median(after) < 1.3, step_seconds(result)
    assert verify == [[]]  # every metric reached the store through the slow proxy
    evidence = fault.evidence().to_dict()
    assert evidence["target"] == "the mlflow server" and evidence["mlflow_started_in_s"] > 0
    print(f"mlflow started in {evidence['mlflow_started_in_s']} s; {len(seen)} processes")
    assert len(seen) >= 3  # the job, the server and its workers (+ huey consumers)
    left = [pid for pid in _descendants() - before if psutil.pid_exists(pid)]
    assert left == [], [psutil.Process(p).cmdline() for p in left]
    # a zombie has ended: one re-parented to a PID 1 that reaps nothing (a container) stays one
    alive = [pid for pid in seen if _running(pid)]
    assert not alive, [psutil.Process(p).cmdline() for p in alive]


@pytest.mark.slow
def test_mlflow_metrics_dropped_under_a_timeout_toxic_are_caught(tmp_path: Path) -> None:
    """The planted defect: one try of 1 s per metric, no retry -- a hung tracking connection
    loses the metrics of the steps it covered, and verify_continue names them."""
    # upstream: the requests are held (downstream, MLflow would store them and only the answers
    # would be lost -- nothing to catch)
    fault = NetworkFault(FaultParams({"toxic": "timeout", "attributes": {"timeout": 0}, "stream": "upstream",
                          "service": "mlflow"}), after_step=2)
    verify: list[list[str]] = []
    result, _ = run_with_fault(fault, tmp_path, steps=8, clear_after=5, mode="mlflow:drop",
                               regexes={"loss": REGEXES["loss"]}, verify=verify)
    assert result.ok, result.reason
    [problems] = verify
    assert len(problems) == 1, problems
    match = re.search(r"of metric 'loss' printed by the job never reached the MLflow store "
                      r"\(steps ([\d, ]+)\)", problems[0])
    assert match, problems
    missing = {int(step) for step in match.group(1).split(", ")}
    assert {4, 5} <= missing <= {3, 4, 5, 6}, missing  # the steps while the connection hung
