"""The Ray Jobs backend and the embedded head, against a real local Ray head (one per session).

Times are printed (run with ``-s``) and asserted with wide margins: this machine is shared.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.helpers import report_evidence
from trainguard._internal.signals import restore_default_signals
from trainguard.queue.base import SubmissionError, SubmissionSpec
from trainguard.raytrain.local_ray import LocalRay, RayCluster, RayStartError, running_ray_processes
from trainguard.raytrain.ray_jobs import ClusterResources, RayJobsBackend


def _workdir(tmp_path: Path, body: str) -> Path:
    work = tmp_path / "job"
    work.mkdir()
    (work / "job.py").write_text(body)
    return work


# ------------------------------------------------------------------------------------------
# without a head: RAY_ADDRESS and the absence of any cluster


def test_ray_address_means_attach_not_start(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RAY_ADDRESS", "http://10.255.0.1:8265")
    monkeypatch.delenv("RAY_API_SERVER_ADDRESS", raising=False)
    head = LocalRay()
    with head as cluster:
        assert not cluster.owned and cluster.temp_dir is None
        assert cluster.address == cluster.jobs_address == "http://10.255.0.1:8265"
        assert cluster.auth_headers() == {}  # Ray's own RAY_AUTH_* env applies
    assert head.start_s is None and head.stop_s is None  # nothing was started or stopped
    backend = RayJobsBackend()  # picks RAY_ADDRESS up; does not connect yet
    assert backend.jobs_address == "http://10.255.0.1:8265"


def test_no_cluster_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.delenv("RAY_API_SERVER_ADDRESS", raising=False)
    with pytest.raises(SubmissionError, match=r"set RAY_ADDRESS .* or start an embedded head"):
        RayJobsBackend()


def test_entrypoint_resources_per_launcher(tmp_path: Path) -> None:
    """torchrun holds every rank's resources on one node; a direct driver holds at most 1 CPU
    and its workers' GPUs are checked against the whole cluster."""
    backend = RayJobsBackend(RayCluster("127.0.0.1:1", "http://127.0.0.1:1", owned=False))
    spec = SubmissionSpec(
        entrypoint=["python", "t.py"], job_name="j", working_dir=tmp_path, num_gpus=1,
        num_cpus=2, world_size=4, resume_args=["--resume"], resume=True,
    )  # fmt: skip
    command, cpus, gpus = backend.entrypoint(spec)
    assert command == "torchrun --nproc-per-node=4 --standalone t.py --resume"
    assert (cpus, gpus) == (8, 4)
    spec.launcher = "direct"
    assert backend.entrypoint(spec) == ("python t.py --resume", 1.0, 0.0)
    two_nodes = ClusterResources([{"CPU": 8, "GPU": 2}, {"CPU": 8, "GPU": 2}])
    assert backend._infeasible(spec, 1.0, 0.0, two_nodes) is None  # 4 GPUs in all
    spec.world_size = 8
    assert "8 worker(s) x 1 GPU = 8 GPU, but the cluster has 4 GPU" in str(
        backend._infeasible(spec, 1.0, 0.0, two_nodes)
    )
    spec.launcher, spec.nodes = "torchrun", 2
    with pytest.raises(SubmissionError, match="torchrun job on 2 nodes cannot be one Ray Jobs"):
        backend.entrypoint(spec)


# ------------------------------------------------------------------------------------------
# the embedded head


@pytest.mark.ray
@pytest.mark.slow
def test_head_is_isolated_and_token_protected(ray_head: LocalRay) -> None:
    cluster = ray_head.cluster
    assert cluster is not None and cluster.owned and cluster.jobs_address
    assert cluster.temp_dir is not None and str(cluster.temp_dir).startswith("/tmp/tg-ray-")
    assert len(str(cluster.temp_dir)) < 30  # Unix socket paths below it stay short
    assert (cluster.temp_dir / "session_latest").exists()  # never /tmp/ray
    url = f"{cluster.jobs_address}/api/jobs/"
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(url, timeout=10)
    assert info.value.code == 401  # no token: refused
    request = urllib.request.Request(url, headers=cluster.auth_headers())
    with urllib.request.urlopen(request, timeout=10) as response:
        assert response.status == 200
    env = cluster.client_env()
    assert env["RAY_AUTH_MODE"] == "token" and env["RAY_AUTH_TOKEN"] == cluster.auth_token
    assert env["RAY_ADDRESS"] == cluster.address and cluster.address.startswith("127.0.0.1:")
    assert len(running_ray_processes(cluster.temp_dir)) >= 4  # gcs, raylet, dashboard, agents


@pytest.mark.ray
@pytest.mark.slow
def test_driver_connects_with_the_client_env(ray_head: LocalRay) -> None:
    """What a Ray Train driver does: ray.init() from RAY_ADDRESS plus the token env."""
    assert ray_head.cluster is not None
    code = "import ray; ray.init(); print('answer', ray.get(ray.remote(lambda: 6 * 7).remote()))"
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(ray_head.cluster.client_env())
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=180
    )
    print(f"\ndriver connect + one task: {time.monotonic() - t0:.1f} s")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "answer 42" in proc.stdout


# ------------------------------------------------------------------------------------------
# submission


@pytest.mark.ray
@pytest.mark.slow
def test_tiny_job_succeeds_with_metadata_and_logs(ray_head: LocalRay, tmp_path: Path) -> None:
    work = _workdir(
        tmp_path,
        "import os, sys\nprint('tg-hello', os.environ['TG_MARK'], sys.executable)\n",
    )
    spec = SubmissionSpec(
        entrypoint=["python", "job.py"],
        job_name="tiny",
        working_dir=work,
        env={"TG_MARK": "m-123"},
        num_cpus=1,
        gate_report=str(tmp_path / "gate.json"),
        mlflow_run_id="run-abc",
    )
    backend = RayJobsBackend(ray_head.cluster, pending_timeout=120)
    t0 = time.monotonic()
    submitted = backend.submit(spec)
    assert submitted.accepted and submitted.job_id, submitted.message
    final = backend.wait(submitted.job_id, timeout=180)
    elapsed = time.monotonic() - t0
    print(f"\nsubmit -> {final.status}: {elapsed:.1f} s")
    assert final.status == "succeeded", final.message
    assert report_evidence(final)["metadata"] == {
        "trainguard.job": "tiny",
        "trainguard.gate_report": str(tmp_path / "gate.json"),
        "trainguard.mlflow_run_id": "run-abc",
    }
    assert report_evidence(final)["driver_exit_code"] == 0
    logs = backend.logs(submitted.job_id)
    assert "tg-hello m-123" in logs
    assert sys.executable in logs  # the head runs entrypoints with this environment's python
    assert submitted.links["dashboard"].endswith(f"/#/jobs/{submitted.job_id}")


@pytest.mark.ray
@pytest.mark.slow
def test_failing_job_is_reported_failed(ray_head: LocalRay, tmp_path: Path) -> None:
    work = _workdir(tmp_path, "import sys\nprint('boom')\nsys.exit(3)\n")
    backend = RayJobsBackend(ray_head.cluster, pending_timeout=120)
    submitted = backend.submit(
        SubmissionSpec(entrypoint=["python", "job.py"], job_name="bad", working_dir=work)
    )
    assert submitted.job_id
    final = backend.wait(submitted.job_id, timeout=180)
    assert final.status == "failed", final.message
    assert report_evidence(final)["driver_exit_code"] == 3


@pytest.mark.ray
@pytest.mark.slow
def test_gpu_job_on_cpu_cluster_is_refused_before_submission(
    ray_head: LocalRay, tmp_path: Path
) -> None:
    work = _workdir(tmp_path, "print('never runs')\n")
    backend = RayJobsBackend(ray_head.cluster)
    spec = SubmissionSpec(
        entrypoint=["python", "job.py"], job_name="gpu", working_dir=work, num_gpus=1, world_size=2
    )
    t0 = time.monotonic()
    result = backend.submit(spec)
    elapsed = time.monotonic() - t0
    print(f"\nGPU request refused in {elapsed:.2f} s")
    assert result.status == "unschedulable" and result.job_id is None and not result.accepted
    assert "asks for 2 CPU and 2 GPU on one node" in result.message
    assert "1 alive node(s):" in result.message and "/0 GPU" in result.message
    assert elapsed < 10


@pytest.mark.ray
@pytest.mark.slow
def test_gpu_job_left_pending_is_detected_within_the_bound(
    ray_head: LocalRay, tmp_path: Path
) -> None:
    """An autoscaling cluster skips the pre-check; the PENDING watch must still end it."""
    work = _workdir(tmp_path, "print('never runs')\n")
    backend = RayJobsBackend(ray_head.cluster, check_resources=False, pending_timeout=3)
    spec = SubmissionSpec(
        entrypoint=["python", "job.py"], job_name="gpu-watch", working_dir=work, num_gpus=1
    )
    t0 = time.monotonic()
    result = backend.submit(spec)
    elapsed = time.monotonic() - t0
    print(f"\nPENDING GPU job reported {result.status} after {elapsed:.1f} s")
    assert result.status == "unschedulable" and result.job_id, result.message
    assert "still PENDING after 3 s" in result.message and "0 GPU" in result.message
    assert elapsed < 30
    # Ray itself still lists it PENDING: that is why trainguard never waits on it
    assert backend.status(result.job_id).status in ("pending", "stopped")


# ------------------------------------------------------------------------------------------
# a head that does not come up in time is torn down completely


@pytest.mark.ray
@pytest.mark.slow
def test_start_timeout_leaves_nothing_behind() -> None:
    pytest.importorskip("ray")
    head = LocalRay(num_gpus=0, dashboard=False, use_ray_address=False, start_timeout=8)
    t0 = time.monotonic()
    with pytest.raises(RayStartError, match=r"not ready within 8 s"):
        head.start()
    print(f"\nhalf-started head torn down; start+stop {time.monotonic() - t0:.1f} s")
    assert head.leftover == []
    assert head._seen, "the head had started processes before the deadline"
    assert all(not p.is_running() or p.status() == "zombie" for p in head._seen.values())


CTRL_C_DRIVER = """\
import sys, time
from trainguard.raytrain.local_ray import LocalRay
with LocalRay(num_gpus=0, dashboard=False, use_ray_address=False, start_timeout=180) as cluster:
    print("ready", cluster.temp_dir, flush=True)
    time.sleep(600)
"""


@pytest.mark.ray
@pytest.mark.slow
def test_ctrl_c_stops_the_head(tmp_path: Path) -> None:
    """Ctrl-C in the process that owns a head (the head is in its own session, so only the
    owner sees the SIGINT) stops every process of the head."""
    pytest.importorskip("ray")
    proc = subprocess.Popen(
        [sys.executable, "-c", CTRL_C_DRIVER], stdout=subprocess.PIPE, text=True,
        preexec_fn=restore_default_signals,  # Ctrl-C's own state, whatever pytest has
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # blocks until the head is up (or the driver died)
        assert line.startswith("ready "), line
        temp_dir = line.split()[1]
        assert len(running_ray_processes(temp_dir)) >= 3
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=60)
        print(f"\nCtrl-C -> head stopped and owner exited in {time.monotonic() - t0:.1f} s")
        assert code != 0  # KeyboardInterrupt
        assert running_ray_processes(temp_dir) == []
        assert not os.path.exists(temp_dir)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
