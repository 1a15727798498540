"""The Slurm queue against a real local cluster (tests/slurm/cluster.py): ``gate --submit`` and
``trainguard submit REPORT`` sbatch the promoted toy job, follow it through scontrol to COMPLETED
and record it; the cluster itself leaves nothing behind, Ctrl-C and SIGKILL included."""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.slurm.cluster import SlurmCluster, missing_requirements, our_daemons
from trainguard.cli import main
from trainguard.queue.slurm import SlurmBackend

JOBS = Path(__file__).resolve().parents[1] / "data" / "jobs"
ROOT = Path(__file__).resolve().parents[2]

JOB = """
job:
  name: toy-slurm
  command: "python toy_train.py --steps {steps} --seed {seed} --ckpt-dir {checkpoint_dir} --sleep 0.02"
  resume_args: "--resume"
  world_size: 2
  env: {OMP_NUM_THREADS: "1"}
  metrics:
    loss: 'step (?P<step>\\d+) loss (?P<value>\\S+)'
  timeout: 60
  stall_timeout: 20
target: {steps: 20}
checks:
  smoke: {steps: 5}
gate:
  require: [smoke]
  queue: slurm
"""


@pytest.mark.timeout(400)
def test_gate_submit_runs_the_promoted_job_on_slurm_to_completed(
    slurm_env: SlurmCluster, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    shutil.copy(JOBS / "toy_train.py", tmp_path / "toy_train.py")
    job = tmp_path / "trainguard.yaml"
    job.write_text(JOB)
    t0 = time.monotonic()
    # --wait: the job may queue behind other tests' jobs on the 2-CPU node (it needs both CPUs)
    assert main(["gate", str(job), "--submit", "--wait", "150", "-q"]) == 0
    gate_s = time.monotonic() - t0
    out = capsys.readouterr().out
    assert "PROMOTE: toy-slurm" in out and "submission: succeeded: submitted toy-slurm to Slurm as job" in out, out
    report = json.loads((tmp_path / ".trainguard" / "gate" / "latest.json").read_text())
    sub = report["submission"]
    assert sub["status"] == "succeeded" and sub["evidence"]["state"] == "COMPLETED", sub
    assert sub["evidence"]["source"] == "scontrol" and sub["evidence"]["exit_code"] == "0:0"
    states = [s[1] for s in sub["evidence"]["states"]]
    assert states[-1] == "COMPLETED", states
    record = json.loads(Path(sub["links"]["record"]).read_text())
    assert record["job_id"] == sub["job_id"] and record["status"] == "succeeded"
    log = Path(sub["links"]["log"]).read_text()
    assert log.count("step 20 loss") == 2, log  # both ranks, through torchrun under srun
    assert "torchrun" in sub["script"] and "--requeue" in sub["script"]

    # the same promoted report, later: `trainguard submit` follows it too and prints the record
    t1 = time.monotonic()
    assert main(["submit", str(tmp_path / ".trainguard" / "gate" / "latest.json"), "--wait", "150"]) == 0
    submit_s = time.monotonic() - t1
    out = capsys.readouterr().out
    assert "submission: succeeded:" in out and "completed" in out and "record: " in out, out
    # a job the controller never had (or forgot, MinJobAge) and no accounting here: unknown, said so
    gone = SlurmBackend(tmp_path).status("999999")
    assert gone.status == "unknown" and "no record of job 999999" in gone.message
    print(f"\ngate --submit (smoke + sbatch + follow to COMPLETED): {gate_s:.1f} s; "
          f"submit REPORT -> COMPLETED: {submit_s:.1f} s; states {sub['evidence']['states']}")


def _die_with_parent() -> None:
    """In the child: SIGTERM when this test's process dies (an xdist worker killed on Ctrl-C),
    so the cluster it started stops too."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _start_by_hand(root: Path) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-m", "tests.slurm.cluster", "--dir", str(root)],
                            cwd=ROOT, stdout=subprocess.PIPE, text=True, preexec_fn=_die_with_parent)
    assert proc.stdout is not None
    first = proc.stdout.readline()
    assert "local Slurm cluster up" in first, first
    assert "SLURM_CONF" in proc.stdout.readline()
    assert len(our_daemons(root)) == 3
    # a job left running: its slurmstepd and its processes must go with the cluster
    env = {**os.environ, "SLURM_CONF": str(root / "slurm.conf")}
    job = subprocess.run(["sbatch", "--parsable", f"--output={root.parent}/%j.out", "--wrap",
                          f"sleep 300 # {root.name}-job"], env=env, capture_output=True, text=True,
                         timeout=30, check=True).stdout.strip()
    deadline = time.monotonic() + 30
    while len(our_daemons(root)) < 4:  # + the batch job's slurmstepd
        assert time.monotonic() < deadline, f"job {job} never started"
        time.sleep(0.2)
    return proc


def _job_processes(marker: str) -> list[int]:
    return [p.pid for p in psutil.process_iter(["cmdline"]) if marker in " ".join(p.info["cmdline"] or [])]


def _gone(root: Path, within: float) -> float:
    t0 = time.monotonic()
    while (our_daemons(root) or root.exists()) and time.monotonic() - t0 < within:
        time.sleep(0.1)
    assert not our_daemons(root), f"daemons left: {our_daemons(root)}"
    assert not root.exists(), f"{root} left"
    assert not _job_processes(f"{root.name}-job"), "the job's processes were left"
    return time.monotonic() - t0


@pytest.mark.timeout(120)
def test_a_cluster_started_by_hand_leaves_nothing_after_ctrl_c_or_sigkill(tmp_path: Path) -> None:
    why = missing_requirements()
    if why:
        pytest.skip(why)
    proc = _start_by_hand(tmp_path / "a")
    proc.send_signal(signal.SIGINT)  # Ctrl-C
    assert proc.wait(30) == 0
    ctrl_c_s = _gone(tmp_path / "a", 20)
    proc = _start_by_hand(tmp_path / "b")
    proc.kill()  # no chance to clean up: the supervisor sees its last user gone
    proc.wait(10)
    kill_s = _gone(tmp_path / "b", 20)
    print(f"\ncluster gone {ctrl_c_s:.1f} s after Ctrl-C, {kill_s:.1f} s after SIGKILL of its starter")
