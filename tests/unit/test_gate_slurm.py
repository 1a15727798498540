"""The Slurm backend and the submission spec: the sbatch script's text, its behaviour under bash
(USR1 forwarding, requeue, resume args), and sbatch on and off PATH.

These run without Slurm (fast, and where it is not installed): ``sbatch``, ``srun`` and
``scontrol`` are small stand-in scripts in a temp dir on PATH (named ``fake-*`` in their own
comments). They record their arguments; the srun stand-in runs its command in place of itself
(``exec``), so a signal that bash sends to "srun" reaches the command as real srun forwards it to
its tasks. The same paths against a real slurmctld: tests/slurm/.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from trainguard.config import load_config
from trainguard.errors import UsageError
from trainguard.queue.backends import get_backend
from trainguard.queue.base import (
    QueueBackend,
    SubmissionError,
    SubmissionSpec,
    spec_from_job,
    torchrun_argv,
)
from trainguard.queue.slurm import SlurmBackend, slurm_time

# ------------------------------------------------------------------------------------------
# the spec


def test_spec_rejects_bad_values_with_every_problem() -> None:
    with pytest.raises(UsageError) as info:
        SubmissionSpec(entrypoint=[], job_name="bad name!", world_size=3, nodes=2, num_gpus=-1)
    message = str(info.value)
    assert "entrypoint is empty" in message
    assert "job_name 'bad name!'" in message
    assert "world_size 3 is not a multiple of nodes 2" in message
    assert "num_gpus/num_cpus must be >= 0" in message


def test_spec_sizes_per_node_and_links_evidence() -> None:
    spec = SubmissionSpec(
        entrypoint="python train.py --steps 100",
        job_name="digits",
        num_gpus=1,
        num_cpus=4,
        world_size=8,
        nodes=2,
        resume_args=["--resume"],
        gate_report="/r/gate.json",
        mlflow_run_id="abc123",
    )
    assert spec.entrypoint == ["python", "train.py", "--steps", "100"]
    assert (spec.ranks_per_node, spec.gpus_per_node, spec.cpus_per_node) == (4, 4, 16)
    assert spec.rank_argv() == spec.entrypoint  # resume only when asked
    spec.resume = True
    assert spec.rank_argv()[-1] == "--resume"
    assert spec.labels() == {
        "trainguard.job": "digits",
        "trainguard.gate_report": "/r/gate.json",
        "trainguard.mlflow_run_id": "abc123",
    }


def test_torchrun_argv_matches_the_runner_form() -> None:
    assert torchrun_argv(["python", "t.py", "--x"], nproc_per_node=2) == [
        "torchrun", "--nproc-per-node=2", "--standalone", "t.py", "--x",
    ]  # fmt: skip
    multi = torchrun_argv(["python3", "t.py"], nproc_per_node=4, nnodes=2, rdzv_endpoint="h:1")
    assert "--nnodes=2" in multi and "--rdzv-endpoint=h:1" in multi and "--standalone" not in multi
    assert torchrun_argv(["./run.sh"], nproc_per_node=2) == ["./run.sh"]  # starts its own ranks


def test_backend_factory(tmp_path: Path) -> None:
    backend = get_backend("slurm", script_dir=tmp_path)
    assert isinstance(backend, SlurmBackend) and isinstance(backend, QueueBackend)
    with pytest.raises(UsageError, match="unknown queue backend 'pbs'; expected one of ray, slurm"):
        get_backend("pbs")


def test_spec_from_a_job_file_fills_placeholders() -> None:
    job_file = load_config(Path(__file__).parents[1] / "data" / "jobs" / "toy.trainguard.yaml")
    values = {"steps": 500, "seed": 0, "checkpoint_dir": "/ckpt/toy", "run_dir": "/runs/1"}
    spec = spec_from_job(
        job_file, values, world_size=4, num_gpus=1, time_limit_s=600, gate_report="/r.json"
    )
    assert spec.entrypoint[:4] == ["python", "toy_train.py", "--steps", "500"]
    assert "/ckpt/toy" in spec.entrypoint and "/runs/1" in spec.entrypoint
    assert spec.resume_args == ["--resume"] and spec.env == {"OMP_NUM_THREADS": "1"}
    assert (spec.job_name, spec.world_size, spec.working_dir) == ("toy", 4, job_file.cwd)
    assert spec_from_job(job_file, values).world_size == 2  # the job's own


# ------------------------------------------------------------------------------------------
# the script text


def _spec(tmp_path: Path, **kw: object) -> SubmissionSpec:
    values: dict[str, object] = dict(
        entrypoint=["python", "train.py", "--steps", "1000", "--ckpt-dir", "ck pt"],
        job_name="digits",
        working_dir=tmp_path,
        env={"OMP_NUM_THREADS": "1"},
        num_gpus=1,
        num_cpus=2,
        world_size=8,
        nodes=2,
        time_limit_s=3 * 3600,
        resume_args=["--resume"],
        gate_report=str(tmp_path / "gate report.json"),
        mlflow_run_id="run42",
    )
    values.update(kw)
    return SubmissionSpec(**values)  # type: ignore[arg-type]


def test_slurm_time_rounds_up_to_minutes() -> None:
    assert slurm_time(1) == "00:01:00"
    assert slurm_time(3601) == "01:01:00"
    assert slurm_time(2 * 86400 + 90) == "2-00:02:00"


def test_script_directives_from_the_sized_spec(tmp_path: Path) -> None:
    backend = SlurmBackend(tmp_path, margin=0.25, min_margin_s=600, signal_lead_s=300)
    script = backend.render(_spec(tmp_path))
    directives = [
        line.removeprefix("#SBATCH ") for line in script.splitlines() if line.startswith("#SBATCH")
    ]
    # 3 h predicted + 25 % margin (45 min) + the 5 min signal lead = 3 h 50 min
    assert "--time=03:50:00" in directives
    assert "--nodes=2" in directives and "--gpus-per-node=4" in directives
    assert "--cpus-per-task=8" in directives and "--ntasks-per-node=1" in directives
    assert "--requeue" in directives and "--signal=B:USR1@300" in directives
    assert any(d.startswith('--comment="trainguard gate report ') for d in directives)
    # multi-node torchrun with a c10d rendezvous on the first node; the rest quoted
    assert '--rdzv-endpoint="$MASTER_ADDR:29500"' in script and "--nproc-per-node=4" in script
    assert "'ck pt'" in script and "export OMP_NUM_THREADS=1" in script
    assert "export MLFLOW_RUN_ID=run42" in script
    # a short prediction still gets the minimum margin
    short = backend.render(_spec(tmp_path, time_limit_s=60))
    assert "--time=00:16:00" in short  # 1 min + 10 min margin + 5 min lead


def test_script_for_one_rank_runs_the_command_as_is(tmp_path: Path) -> None:
    script = SlurmBackend(tmp_path).render(_spec(tmp_path, world_size=1, nodes=1, num_gpus=0))
    assert "torchrun" not in script and "--gpus-per-node" not in script
    assert "srun --kill-on-bad-exit=1 python train.py" in script


def test_script_is_valid_bash(tmp_path: Path) -> None:
    path = SlurmBackend(tmp_path).write_script(_spec(tmp_path))
    proc = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    assert os.access(path, os.X_OK)


# ------------------------------------------------------------------------------------------
# the script under bash, with stand-ins for srun and scontrol

TRAIN = """\
import json, signal, sys, time
from pathlib import Path
out = Path(sys.argv[1])
(out / "argv.json").write_text(json.dumps(sys.argv[2:]))
def on_usr1(signum, frame):
    (out / "checkpoint").write_text("final checkpoint")
    sys.exit(0)
signal.signal(signal.SIGUSR1, on_usr1)
(out / "started").write_text("1")
if "--resume" in sys.argv:
    sys.exit(0)
time.sleep(30)
sys.exit(3)
"""


def _fake_bin(tmp_path: Path) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls.txt"
    tools = {
        "srun": """\
            #!/bin/bash
            # fake-srun: a stand-in for Slurm's srun (impossible here): drops srun's options and
            # runs the command in its place, so signals sent to "srun" reach the command
            echo "srun $*" >> {calls}
            while [[ $# -gt 0 && $1 == --* ]]; do shift; done
            exec "$@"
            """,
        "scontrol": """\
            #!/bin/bash
            # fake-scontrol: records its arguments; `show hostnames` prints one node
            echo "scontrol $*" >> {calls}
            if [[ $1 == show ]]; then echo node001; fi
            """,
    }
    for name, text in tools.items():
        path = bin_dir / name
        path.write_text(textwrap.dedent(text).format(calls=calls))
        path.chmod(0o755)
    return bin_dir


def _run_script(tmp_path: Path, restart_count: int, usr1_after_start: bool,
                max_requeues: int = 3) -> tuple[int, str]:
    (tmp_path / "train.py").write_text(TRAIN)
    spec = SubmissionSpec(
        entrypoint=[sys.executable, "train.py", str(tmp_path)],
        job_name="stand-in",
        working_dir=tmp_path,
        world_size=1,
        resume_args=["--resume", "--from-latest"],
    )
    script = SlurmBackend(tmp_path, max_requeues=max_requeues).write_script(spec)
    env = {
        **os.environ,
        "PATH": f"{_fake_bin(tmp_path)}{os.pathsep}{os.environ['PATH']}",
        "SLURM_JOB_ID": "777",
        "SLURM_JOB_NODELIST": "node001",
        "SLURM_RESTART_COUNT": str(restart_count),
    }
    proc = subprocess.Popen(["bash", str(script)], env=env, cwd=tmp_path, start_new_session=True)
    try:
        if usr1_after_start:
            deadline = time.monotonic() + 30
            while not (tmp_path / "started").exists():
                assert time.monotonic() < deadline, "the job step never started"
                assert proc.poll() is None, "the batch script exited early"
                time.sleep(0.05)
            proc.send_signal(signal.SIGUSR1)  # what Slurm does signal_lead_s before the limit
        code = proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    calls = (tmp_path / "calls.txt").read_text() if (tmp_path / "calls.txt").exists() else ""
    return code, calls


def test_usr1_is_forwarded_to_the_step_and_the_job_requeued(tmp_path: Path) -> None:
    t0 = time.monotonic()
    code, calls = _run_script(tmp_path, restart_count=0, usr1_after_start=True)
    assert code == 0
    assert (tmp_path / "checkpoint").read_text() == "final checkpoint"
    assert "scontrol requeue 777" in calls
    assert "--resume" not in (tmp_path / "argv.json").read_text()  # a first run does not resume
    assert time.monotonic() - t0 < 20  # the step did not sleep out its 30 s


def test_usr1_after_the_last_requeue_fails_the_job_instead_of_completing_it(tmp_path: Path) -> None:
    code, calls = _run_script(tmp_path, restart_count=0, usr1_after_start=True, max_requeues=0)
    assert (tmp_path / "checkpoint").read_text() == "final checkpoint"
    assert "scontrol requeue" not in calls
    assert code == 75  # Slurm: FAILED with exit code 75, not COMPLETED while unfinished


def test_requeued_run_appends_the_resume_args_and_does_not_requeue(tmp_path: Path) -> None:
    code, calls = _run_script(tmp_path, restart_count=1, usr1_after_start=False)
    assert code == 0
    assert (tmp_path / "argv.json").read_text() == '["--resume", "--from-latest"]'
    assert "scontrol requeue" not in calls and not (tmp_path / "checkpoint").exists()


# ------------------------------------------------------------------------------------------
# sbatch on and off PATH


def _fake_sbatch(tmp_path: Path, *, stdout: str, code: int = 0, stderr: str = "") -> Path:
    bin_dir = tmp_path / "sbatch-bin"
    bin_dir.mkdir()
    path = bin_dir / "sbatch"
    path.write_text(
        "#!/bin/bash\n"
        "# fake-sbatch: a stand-in for Slurm's sbatch (impossible here); records its arguments\n"
        f'printf "%s\\n" "$@" > {tmp_path}/sbatch-args.txt\n'
        f"echo '{stdout}'\n"
        f"echo '{stderr}' >&2\n"
        f"exit {code}\n"
    )
    path.chmod(0o755)
    return bin_dir


def test_sbatch_present_submits_and_parses_the_job_id(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(_fake_sbatch(tmp_path, stdout="4242;cluster-a")))
    backend = SlurmBackend(tmp_path / "scripts")
    result = backend.submit(_spec(tmp_path))
    script = tmp_path / "scripts" / "digits.sbatch"
    assert result.status == "submitted" and result.job_id == "4242" and result.accepted
    assert (tmp_path / "sbatch-args.txt").read_text().split() == ["--parsable", str(script)]
    assert result.links["script"] == str(script)
    assert result.links["log"].endswith("slurm-digits-4242.out")
    assert result.script == script.read_text()


def test_sbatch_refusal_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bin_dir = _fake_sbatch(
        tmp_path, stdout="", code=1, stderr="sbatch: error: Invalid account or account/partition"
    )
    monkeypatch.setenv("PATH", str(bin_dir))
    with pytest.raises(
        SubmissionError, match=r"sbatch refused .*digits.sbatch \(exit 1\): .*Invalid account"
    ):
        SlurmBackend(tmp_path).submit(_spec(tmp_path))


def test_sbatch_absent_returns_the_script(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    result = SlurmBackend(tmp_path).submit(_spec(tmp_path))
    assert result.status == "not_submitted" and result.job_id is None and not result.accepted
    assert "sbatch is not on PATH" in result.message and "sbatch " + str(tmp_path) in result.message
    assert result.script is not None and result.script.startswith("#!/bin/bash")
    assert SlurmBackend(tmp_path).status("1").status == "unknown"  # no scontrol or sacct either


@pytest.mark.parametrize(("failure_requeues", "restart_count", "requeued"),
                         [(2, 1, True), (2, 2, False), (0, 0, False)], ids=["below", "at-limit", "off"])
def test_a_failed_step_is_requeued_below_failure_requeues(tmp_path: Path, failure_requeues: int,
                                                          restart_count: int, requeued: bool) -> None:
    """The restart policy the crash_loop drill on Slurm tests: a step that failed (exit 3) is
    requeued while SLURM_RESTART_COUNT < failure_requeues; at the limit, or without the option,
    the job ends with the step's exit code (Slurm: FAILED)."""
    spec = SubmissionSpec(entrypoint=[sys.executable, "-c", "import sys; sys.exit(3)"], job_name="fails",
                          working_dir=tmp_path, world_size=1, resume_args=["--resume"])
    script = SlurmBackend(tmp_path, failure_requeues=failure_requeues).write_script(spec)
    env = {**os.environ, "PATH": f"{_fake_bin(tmp_path)}{os.pathsep}{os.environ['PATH']}", "SLURM_JOB_ID": "778",
           "SLURM_JOB_NODELIST": "node001", "SLURM_RESTART_COUNT": str(restart_count)}
    proc = subprocess.run(["bash", str(script)], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=30)
    calls = (tmp_path / "calls.txt").read_text()
    assert proc.returncode == 3, proc.stderr
    assert ("scontrol requeue 778" in calls) is requeued, (calls, proc.stderr)
    assert (f"(restart {restart_count + 1} of {failure_requeues})" in proc.stderr) is requeued
