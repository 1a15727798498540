"""Profile, gate and submit for a ``kind: ray_train`` job.

The production spec of a Ray Train job is checked without Ray (fast). The end-to-end test (slow:
3 fits and one submitted Ray Job) runs ``trainguard gate --submit`` on the Ray example with a
profile at 1 and 2 workers: the profile must measure the workers (not the driver), the gate must
promote and submit one Ray Job whose entrypoint is the driver at the recommended number of
workers, and that job's designated writer must log its steps into the production MLflow run.
"""

from __future__ import annotations

import json
import shlex
import shutil
from collections import Counter
from pathlib import Path

import pytest

from tests.helpers import make_sizing
from trainguard.config import load_config
from trainguard.gate.provenance import provenance_for
from trainguard.gate.run import SubmittableReport, _production_spec

pytestmark = pytest.mark.timeout(900)

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

GATED = """\
checks:
  profile: {steps: 12, warmup_steps: 3, world_sizes: [1, 2], scaling: strong, samples_per_step: 64}
target: {steps: 10, max_gpus: 2, price_per_gpu_hour: 2.5, mtbf_hours: 20000, max_lost_minutes: 10}
gate:
  require: [profile]
  on_missing: {gpu: skip, root: skip, ray: skip}
  queue: ray
"""


def copy_examples(tmp_path: Path, tail: str = GATED) -> Path:
    ignore = shutil.ignore_patterns(".trainguard", "__pycache__")
    shutil.copytree(EXAMPLES / "digits", tmp_path / "digits", ignore=ignore)
    shutil.copytree(EXAMPLES / "digits_ray", tmp_path / "digits_ray", ignore=ignore)
    job = tmp_path / "digits_ray" / "trainguard.yaml"
    text = job.read_text()
    job.write_text(text[: text.index("checks:")] + tail)
    return job


def test_the_production_run_of_a_ray_train_job_is_the_driver_at_the_sized_workers(tmp_path: Path) -> None:
    job = copy_examples(tmp_path)
    job.write_text(job.read_text().replace("use_gpu: false, resources_per_worker: {CPU: 1}",
                                           "use_gpu: true, resources_per_worker: {CPU: 2, GPU: 0.5}"))
    job_file = load_config(job)
    gate = SubmittableReport("promote", [], str(job), provenance_for(job), make_sizing(4, hours_with_failures=2.0),
                             gpus=0, mlflow_session_run_id="run-1")
    spec = _production_spec(job_file, gate, "/r/latest.json")
    argv = spec.rank_argv()
    assert argv[:3] == ["python", "-m", "trainguard.raytrain.driver"]
    assert argv[argv.index("--num-workers") + 1] == "4" and "--use-gpu" in argv
    assert argv[argv.index("--steps") + 1] == "10"  # target.steps
    assert spec.launcher == "direct" and spec.world_size == 4
    assert (spec.num_gpus, spec.num_cpus) == (0.5, 2.0)  # per worker, from job.scaling
    assert spec.env["PYTHONPATH"] == str((tmp_path / "digits").resolve())  # ../digits, absolute
    assert spec.env["RAY_OVERRIDE_JOB_RUNTIME_ENV"] == "1"  # the driver's ray.init adds env_vars
    assert spec.time_limit_s == 7200
    assert spec.labels() == {"trainguard.job": "digits-ray", "trainguard.gate_report": "/r/latest.json",
                             "trainguard.mlflow_run_id": "run-1", "trainguard.kind": "ray_train",
                             "trainguard.num_workers": "4"}
    from trainguard.raytrain.local_ray import RayCluster
    from trainguard.raytrain.ray_jobs import RayJobsBackend

    backend = RayJobsBackend(RayCluster("127.0.0.1:1", "http://127.0.0.1:1", owned=False))
    command, cpus, gpus = backend.entrypoint(spec)
    assert shlex.split(command) == argv and (cpus, gpus) == (1.0, 0.0)  # the driver only; not torchrun


def test_ray_checkpoint_steps_come_from_rays_own_record(tmp_path: Path) -> None:
    """Ray 2.60's checkpoint_manager_snapshot.json (its shape, trimmed): which checkpoint
    directory came with which report."""
    from trainguard.raytrain.backend import checkpoint_writes

    assert checkpoint_writes(tmp_path) is None
    run = tmp_path / "digits-ray"
    results = []
    for step, name in ((5, "checkpoint_2026-11-22_09-13-31.930407"), (10, "checkpoint_2026-11-22_09-13-40.1")):
        (run / name).mkdir(parents=True)
        (run / name / "state.pt").write_bytes(b"x" * (100 * step))
        results.append({"version": 0, "checkpoint_dir_name": name, "metrics": {"step": step, "loss": 1.0}})
    results.append({"version": 0, "checkpoint_dir_name": "gone", "metrics": {"loss": 0.5}})  # no step key
    (run / "checkpoint_manager_snapshot.json").write_text(json.dumps({
        "ray_version": "2.60.0", "checkpoint_results": results, "checkpoint_report_indices": [4, 9, 11],
        "current_report_index": 12}))
    assert checkpoint_writes(tmp_path) == {5: 500, 10: 1000, 12: 0}


@pytest.mark.ray
@pytest.mark.slow
def test_gate_profiles_and_submits_a_ray_train_job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("ray.job_submission", reason="needs ray[default] (pip install trainguard[ray])")
    from mlflow import MlflowClient

    from trainguard.gate.run import run_gate
    from trainguard.raytrain.local_ray import running_ray_processes, stopped_head_processes

    monkeypatch.setenv("TRAINGUARD_TRACKING", "on")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    before = {p.pid for p in running_ray_processes()}
    job = copy_examples(tmp_path)
    gate = run_gate(job, submit=True, submit_wait_s=300)
    data = gate.to_dict()
    (profile,) = data["checks"]
    assert profile["status"] == "passed", profile["summary"]
    sizes = json.loads(Path(profile["evidence"]["report_json"]).read_text())["sizes"]
    for size in sizes:
        print(f"\nprofile n={size['world_size']}: startup {size['startup_s']} s, p50 step "
              f"{size['step']['p50_s']:.4f} s, worker RSS {size['peak_rss_mb']} MB, CPU {size['cpu_util_pct']} %, "
              f"checkpoint {size['checkpoint']}")
        assert size["outcome"] == "ok" and size["steps"] == 12
        workers = {str(r) for r in range(size["world_size"])}
        assert set(size["peak_rss_mb"]) == workers, size["peak_rss_mb"]  # the workers, by world rank
        assert all(100 < mb < 4000 for mb in size["peak_rss_mb"].values())
        assert set(size["cpu_util_pct"]) == workers
        assert size["checkpoint"]["steps"] == [5, 10, 12]  # ckpt_every 5 and the last step, from Ray's record
        assert size["checkpoint"]["bytes_per_write"] > 100_000
        assert size["startup_s"] > 1
    assert gate.promoted, data["decision"]
    recommended = data["sizing"]["recommended"]
    submission = data["submission"]
    print(f"\nsubmission: {submission['status']} {submission['message']}\n{submission['script']}")
    assert submission["backend"] == "ray" and submission["status"] == "succeeded", submission
    argv = shlex.split(submission["script"])
    assert argv[argv.index("--num-workers") + 1] == str(recommended)
    assert argv[:3] == ["python", "-m", "trainguard.raytrain.driver"]
    meta = submission["evidence"]["metadata"]  # the Ray Job links back to the gate's evidence
    assert meta["trainguard.gate_report"].endswith("gate/latest.json") and meta["trainguard.kind"] == "ray_train"
    assert meta["trainguard.mlflow_run_id"] == data["mlflow_session_run_id"]
    # the designated writer of the submitted job logged into the production run, once per step
    client = MlflowClient(data["tracking_uri"])
    exp = client.get_experiment_by_name("trainguard")
    assert exp is not None
    (production,) = [r for r in client.search_runs([exp.experiment_id])
                     if r.data.tags.get("trainguard.kind") == "production"]
    assert production.data.tags["mlflow.parentRunId"] == data["mlflow_session_run_id"]
    assert meta["trainguard.mlflow_production_run_id"] == production.info.run_id
    steps = Counter(m.step for m in client.get_metric_history(production.info.run_id, "loss"))
    assert steps == Counter(range(1, 11)), steps
    assert not stopped_head_processes(before), f"Ray processes left behind: {stopped_head_processes(before)}"
