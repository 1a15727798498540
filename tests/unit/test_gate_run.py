"""``trainguard gate`` and ``trainguard submit`` end to end on the toy job (real processes).

The gate promotes the clean job and blocks a planted defect (an unseeded RNG fails the required
determinism check), writes JSON/Markdown/HTML atomically, and ``submit`` refuses a blocked report
and a stale one (the job file changed after the gate) and submits a fresh promoted one (Slurm:
sbatch is a clearly named stand-in script here, which records its arguments; a real local Slurm
cluster runs the submitted job in tests/slurm/test_slurm_submit.py).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from trainguard.cli import main

pytestmark = pytest.mark.timeout(240)

# the ranks end each step in a barrier (--sync-dir), as a DDP job's all-reduce makes them: without
# it a loaded machine let rank 0 lag two steps behind rank 1, so the kill after rank 1's step 6
# came before rank 0's first checkpoint and its restart rightly began at step 1

JOBS = Path(__file__).resolve().parents[1] / "data" / "jobs"

JOB = """
job:
  name: toy-gate
  command: "python toy_train.py --steps {steps} --seed {seed} --ckpt-dir {checkpoint_dir} --sleep 0.02 --sync-dir {run_dir}/sync"
  resume_args: "--resume"
  world_size: 2
  metrics:
    loss: 'step (?P<step>\\d+) loss (?P<value>\\S+)'
  timeout: 60
  stall_timeout: 20
checks:
  smoke: {steps: 5}
  determinism: {steps: 8}
  drills:
    - {name: kill, fault: kill_rank, rank: 1, steps: 24, after_step: 6}
gate:
  require: [smoke, determinism, drills]
  queue: slurm
target: {steps: 1000, startup_minutes: 5}
"""


@pytest.fixture
def job(tmp_path: Path) -> Path:
    shutil.copy(JOBS / "toy_train.py", tmp_path / "toy_train.py")
    path = tmp_path / "trainguard.yaml"
    path.write_text(JOB)
    return path


def fake_sbatch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """fake-sbatch: a stand-in for Slurm's sbatch (impossible here) that records its arguments."""
    bin_dir = tmp_path / "fake-sbatch-bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text(f'#!/bin/bash\nprintf "%s\\n" "$@" > {tmp_path}/sbatch-args.txt\necho 4242\n')
    (bin_dir / "sbatch").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{__import__('os').environ['PATH']}")
    return tmp_path / "sbatch-args.txt"


def test_the_gate_promotes_the_clean_job_and_submit_checks_freshness(
    job: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert main(["gate", str(job), "-q"]) == 0
    out = capsys.readouterr().out
    assert "PROMOTE: toy-gate" in out and "report: " in out
    # the cost, said before anything ran: the plan's launches; the target's start-up projected
    assert out.splitlines()[0].startswith("cost: 6 launch(es) (rank-seconds unknown until a gate has run here)")
    # 6 launches of 2 ranks, 5 minutes each to the first step: 12 x 5 / 60 GPU-hours
    assert "on the target (5 min to a launch's first step): unknown, 1.00 of them starting up" in out.splitlines()[0]
    gate_dir = tmp_path / ".trainguard" / "gate"
    data = json.loads((gate_dir / "latest.json").read_text())
    # and measured: every launch the runner made (determinism's reference, which smoke judged too,
    # and its repeat, smoke's resume from a copy of the reference's checkpoint, the drill's
    # reference, its fault run and the restart): what the plan said
    cost = data["cost"]
    assert cost["measured"] and cost["launches"] == len(cost["records"]) == 6, cost["records"]
    assert cost["rank_seconds"] > 0 and 0 < cost["startup_share"] < 1 and cost["startup_s_per_launch"] > 0
    ranks = sum(r["world_size"] for r in cost["records"])
    assert cost["projection"]["gpu_hours"] > cost["projection"]["startup_gpu_hours"] == round(ranks * 5 / 60, 3)
    assert "cost: 6 launch(es)" in (gate_dir / "latest.md").read_text()
    # validate estimates the next gate from these launches
    assert main(["validate", str(job)]) == 0
    planned = capsys.readouterr().out
    assert "cost: 6 launch(es), about " in planned and "estimated from the launches of" in planned
    assert data["verdict"] == "promote" and data["decision"]["reasons"] == []
    # and the invariants, added by the gate on determinism's run: skipped, as toy_train.py steps no torch optimizer
    assert [c["name"] for c in data["checks"]] == ["smoke", "determinism", "drill:kill", "invariants"]
    assert data["checks"][-1]["status"] == "skipped" and "recorded no training step" in data["checks"][-1]["summary"]
    assert set(cost["reads"]) == {"invariants"}
    assert data["provenance"]["job_file_sha256"]
    assert "PROMOTE" in (gate_dir / "latest.html").read_text()
    assert "# trainguard gate: PROMOTE" in (gate_dir / "latest.md").read_text()

    args_file = fake_sbatch(tmp_path, monkeypatch)
    assert main(["submit", str(gate_dir / "latest.json"), "--wait", "0"]) == 0
    assert "job id: 4242" in capsys.readouterr().out
    script = Path(args_file.read_text().split()[-1]).read_text()
    assert "--requeue" in script and "toy_train.py" in script

    job.write_text(job.read_text().replace("--sleep 0.02", "--sleep 0.03"))  # the job changed
    assert main(["submit", str(gate_dir / "latest.json")]) == 1
    err = capsys.readouterr().err
    assert "is stale" in err and "job file" in err


def test_the_gate_blocks_a_failed_required_check_and_submit_refuses_it(
    job: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    job.write_text(job.read_text().replace("--sleep 0.02", "--sleep 0.02 --nondet"))  # planted
    assert main(["gate", str(job), "-q", "--submit"]) == 1
    out = capsys.readouterr().out
    assert "BLOCK: toy-gate" in out and "determinism failed" in out
    data = json.loads((tmp_path / ".trainguard" / "gate" / "latest.json").read_text())
    assert data["verdict"] == "block"
    assert data["submission"]["status"] == "not_submitted"
    assert main(["submit", str(tmp_path / ".trainguard" / "gate" / "latest.json")]) == 1
    assert "the gate blocked this job" in capsys.readouterr().err


def test_gate_policy_errors_name_the_key(job: Path, capsys: pytest.CaptureFixture[str]) -> None:
    job.write_text(job.read_text().replace("require: [smoke, determinism, drills]", "require: [smoke, determinsm]"))
    assert main(["gate", str(job)]) == 2
    assert "gate.require" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.ray
def test_gate_submit_to_an_embedded_ray_head(job: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("ray.job_submission", reason="needs ray[default]")
    from trainguard.raytrain.local_ray import running_ray_processes

    before = {p.pid for p in running_ray_processes()}
    job.write_text(job.read_text().replace("queue: slurm", "queue: ray"))
    assert main(["gate", str(job), "-q", "--submit"]) == 0
    data = json.loads((tmp_path / ".trainguard" / "gate" / "latest.json").read_text())
    submission = data["submission"]
    assert submission["backend"] == "ray" and submission["job_id"], submission
    assert submission["status"] in ("SUCCEEDED", "RUNNING", "succeeded", "running", "submitted"), submission
    assert "embedded local Ray head" in submission["note"]
    assert not {p.pid for p in running_ray_processes()} - before, "Ray processes left behind"
