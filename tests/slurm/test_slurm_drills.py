"""Drills whose target is a job on the real local Slurm cluster (trainguard.queue.slurm_drill),
and the time-limit path for real: USR1 before ``--time`` -> checkpoint -> requeue -> resume.

Default run: a preemption (``scontrol requeue``) of the clean toy job through
``trainguard slurm-drill`` passes; the same drill on a job that ignores its checkpoint on restart
fails on lost progress. Slow: the same clean drill through the library, the node marked DOWN
(clean and planted) and the time-limit path (1 minute is Slurm's least ``--time``), clean on 1 and
2 ranks and planted (a job that ignores USR1 must end TIMEOUT, not resumed).
"""

from __future__ import annotations

import itertools
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import report_evidence
from tests.slurm.cluster import SlurmCluster
from trainguard.cli import main
from trainguard.launch.metrics import MetricParser
from trainguard.queue.base import SubmissionSpec
from trainguard.queue.slurm import SlurmBackend
from trainguard.queue.slurm_drill import SlurmDrill, read_attempts, run_slurm_drill

TOY = Path(__file__).resolve().parents[1] / "data" / "jobs" / "toy_train.py"
LOSS = r"step (?P<step>\d+) loss (?P<value>\S+)"


def per_rank_reference(steps: int, world_size: int = 1) -> dict[int, list[float]]:
    """The uninterrupted run's loss per step and rank (the toy job, run here without Slurm)."""
    parser = MetricParser({"loss": LOSS})
    values: dict[int, list[float]] = {}
    for rank in range(world_size):
        out = subprocess.run([sys.executable, str(TOY), "--steps", str(steps)], capture_output=True,
                             text=True, timeout=60, check=True,
                             env={"RANK": str(rank), "WORLD_SIZE": str(world_size), "PATH": "/usr/bin:/bin"}).stdout
        for p in (p for line in out.splitlines() for p in parser.parse(line, rank=rank, t=0)):
            values.setdefault(p.step, []).append(p.value)
    return values


def reference(steps: int) -> dict[int, float]:
    """One rank's uninterrupted run: ``{step: loss}``."""
    return {step: values[0] for step, values in per_rank_reference(steps).items()}


def submit(tmp_path: Path, name: str, steps: int, sleep: float, *, resume: bool = True,
           on_notice: str = "save", world_size: int = 1, backend: SlurmBackend | None = None) -> tuple[SlurmBackend, str, Path]:
    backend = backend or SlurmBackend(tmp_path)
    python = sys.executable if world_size == 1 else "python"  # torchrun takes the script
    argv = [python, str(TOY), "--steps", str(steps), "--sleep", str(sleep), "--ckpt-dir",
            str(tmp_path / "ckpt"), "--ckpt-every", "5", "--on-notice", on_notice]
    if world_size > 1:  # the ranks agree on the step they save at (the toy's barrier)
        argv += ["--sync-dir", str(tmp_path / "sync")]
    spec = SubmissionSpec(entrypoint=argv, job_name=name, working_dir=tmp_path, world_size=world_size,
                          resume_args=["--resume"] if resume else [], env={"OMP_NUM_THREADS": "1"},
                          time_limit_s=1.0)
    sub = backend.submit(spec)
    assert sub.status == "submitted" and sub.job_id, sub
    return backend, sub.job_id, Path(sub.links["log"])


def drill(name: str, fault: str, steps: int) -> SlurmDrill:
    return SlurmDrill(name=name, fault=fault, after_step=8, steps=steps, metric_regex=LOSS,  # type: ignore[arg-type]
                      max_lost_steps=5, timeout_s=150)


@pytest.mark.timeout(200)
def test_slurm_drill_cli_preempts_a_submitted_job_and_it_recovers(
    slurm_env: SlurmCluster, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`trainguard slurm-drill RECORD`: the record as the gate writes it, the reference the
    output of an uninterrupted run; exit 0 and the verdict line."""
    _, job_id, log = submit(tmp_path, "cli-preempt", steps=30, sleep=0.1)
    record = tmp_path / f"submission-{job_id}.json"
    record.write_text(json.dumps({"job_id": job_id, "links": {"log": str(log)}}))
    (tmp_path / "reference.out").write_text(
        subprocess.run([sys.executable, str(TOY), "--steps", "30"], capture_output=True, text=True,
                       timeout=60, check=True).stdout)
    config = tmp_path / "trainguard.yaml"  # the metric is read from the job file
    config.write_text("job:\n  name: cli-preempt\n  command: python toy_train.py\n"
                      f"  metrics:\n    loss: '{LOSS}'\n")
    code = main(["slurm-drill", str(record), "--fault", "requeue", "--after-step", "8", "--steps", "30",
                 "--reference", str(tmp_path / "reference.out"), "--config", str(config),
                 "--max-lost-steps", "5", "--report-json", str(tmp_path / "drill.json")])
    out = capsys.readouterr().out
    assert code == 0, out
    assert out.startswith("PASSED  drill:slurm-requeue: requeue of Slurm job") and "all 30 steps match" in out
    ev = json.loads((tmp_path / "drill.json").read_text())["evidence"]
    assert ev["restarts"] == 1 and ev["state"] == "COMPLETED" and ev["lost_steps"] <= 5
    print(f"\n{out.strip()}")


def test_slurm_drill_cli_refuses_a_file_that_is_not_a_record(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "x.json").write_text("{}")
    code = main(["slurm-drill", str(tmp_path / "x.json"), "--fault", "requeue", "--after-step", "2",
                 "--steps", "5", "--reference", str(tmp_path / "x.json"), "--metric-regex", LOSS])
    assert code == 2
    assert "not a submission record with a job id and a log" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_a_preempted_job_is_requeued_resumes_and_matches(slurm_env: SlurmCluster, tmp_path: Path) -> None:
    backend, job_id, log = submit(tmp_path, "preempt-clean", steps=30, sleep=0.1)
    result = run_slurm_drill(backend, job_id, log, drill("preempt", "requeue", 30), reference(30))
    ev = report_evidence(result)
    assert result.status == "passed", (result.summary, ev)
    assert ev["restarts"] == 1 and ev["state"] == "COMPLETED" and ev["lost_steps"] <= 5
    assert [a["restart"] for a in ev["attempts"]] == [0, 1]
    assert ev["trajectory"]["compared_steps"] == 30 and ev["fault_to_first_step_after_restart_s"] > 0
    print(f"\n{result.summary} ({result.duration_s:.1f} s)")


@pytest.mark.timeout(200)
def test_a_preempted_job_that_ignores_its_checkpoint_fails_on_lost_progress(
    slurm_env: SlurmCluster, tmp_path: Path
) -> None:
    backend, job_id, log = submit(tmp_path, "preempt-scratch", steps=30, sleep=0.1, resume=False)
    result = run_slurm_drill(backend, job_id, log, drill("preempt-scratch", "requeue", 30), reference(30))
    assert result.status == "failed", (result.summary, report_evidence(result))
    assert "began again at step 1" in result.summary and "steps of progress lost" in result.summary
    assert report_evidence(result)["attempts"][1]["first_step"] == 1
    print(f"\n{result.summary} ({result.duration_s:.1f} s)")


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("resume", [True, False], ids=["clean", "ignores-checkpoint"])
def test_a_node_marked_down_requeues_the_job(slurm_node_alone: SlurmCluster, tmp_path: Path,
                                             resume: bool) -> None:
    slurm_env = slurm_node_alone
    backend, job_id, log = submit(tmp_path, "node-down", steps=30, sleep=0.1, resume=resume)
    try:
        result = run_slurm_drill(backend, job_id, log, drill("node-down", "node_down", 30), reference(30))
    finally:  # the node is back for the other tests whatever happened
        slurm_env.run("scontrol", "update", f"NodeName={slurm_env.node}", "State=RESUME", check=False)
    assert report_evidence(result).get("fault_evidence", {}).get("node") == slurm_env.node, result.summary
    print(f"\n{result.summary} ({result.duration_s:.1f} s)")
    if resume:
        assert result.status == "passed", (result.summary, report_evidence(result))
        assert report_evidence(result)["restarts"] >= 1
    else:
        assert result.status == "failed" and "began again at step 1" in result.summary


def _time_limited(tmp_path: Path, steps: int, on_notice: str, world_size: int,
                  max_requeues: int = 6) -> tuple[dict, list, float]:
    # --time=1 (Slurm's least): predicted 1 s, no margin, USR1 30 s before the limit; the toy
    # needs steps x 0.5 s > 30 s, so at least one USR1 comes before it is done
    backend = SlurmBackend(tmp_path, margin=0, min_margin_s=0, signal_lead_s=30,
                           max_requeues=max_requeues)
    started = time.monotonic()
    backend, job_id, log = submit(tmp_path, f"limit-{on_notice}", steps=steps, sleep=0.5,
                                  on_notice=on_notice, world_size=world_size, backend=backend)
    final = backend.wait(job_id, 420, poll_s=1.0)
    attempts = read_attempts(log, LOSS)
    return final.evidence, attempts, time.monotonic() - started


@pytest.mark.slow
@pytest.mark.timeout(480)
@pytest.mark.parametrize("world_size", [1, 2])
def test_the_time_limit_checkpoints_requeues_and_resumes(slurm_env: SlurmCluster, tmp_path: Path,
                                                          world_size: int) -> None:
    steps = 80
    final, attempts, took = _time_limited(tmp_path, steps, "save", world_size)
    assert final["state"] == "COMPLETED" and final["restarts"] >= 1, final
    assert "#SBATCH --signal=B:USR1@30" in (tmp_path / "limit-save.sbatch").read_text()
    # the log does not say which rank printed a line, and two ranks' lines can run into one
    # ("step 7 loss 0.5step 7 loss 0.6"): each step's values, found anywhere in the attempt's
    # text, as a multiset, must be the uninterrupted run's (the latest attempt's values win)
    printed: dict[int, list[float]] = {}
    text = next(tmp_path.glob("slurm-limit-save-*.out")).read_text()
    for chunk in text.split("trainguard: attempt ")[1:]:
        found: dict[int, list[float]] = {}
        for match in re.finditer(r"step (\d+) loss (\d+\.\d{6})", chunk):
            found.setdefault(int(match[1]), []).append(float(match[2]))
        printed.update({step: sorted(values) for step, values in found.items()})
    expected = {step: sorted(v) for step, v in per_rank_reference(steps, world_size).items()}
    # a step trained and checkpointed right before the requeue may miss the log: srun ends the
    # step when torchrun exits and drops what it had not forwarded yet (seen with 2 ranks)
    unlogged = [s for before, after in itertools.pairwise(attempts)
                for s in range(max(p.step for p in before.points) + 1, min(p.step for p in after.points))]
    assert len(unlogged) <= final["restarts"], unlogged
    expected = {s: v for s, v in expected.items() if s not in unlogged}
    assert printed == expected, [(s, printed.get(s), expected[s]) for s in expected if printed.get(s) != expected[s]][:5]
    for before, after in itertools.pairwise(attempts):  # each attempt resumed where the last saved
        assert min(p.step for p in after.points) - 1 >= max(p.step for p in before.points)
    log = next(tmp_path.glob("slurm-limit-save-*.out")).read_text()
    assert log.count("USR1 (time limit near)") == final["restarts"]
    if world_size > 1:  # torchrun handled USR1 (passed it on, waited) instead of dying of it
        assert "death signal, shutting down workers" in log and "User defined signal 1" not in log
    print(f"\ntime limit, {world_size} rank(s): {final['restarts']} requeue(s), "
          f"{len(attempts)} attempts, COMPLETED in {took:.0f} s; states {final['states']}")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_job_that_ignores_usr1_times_out_and_is_not_resumed(slurm_env: SlurmCluster, tmp_path: Path) -> None:
    final, attempts, took = _time_limited(tmp_path, 400, "ignore", 1)
    assert final["state"] == "TIMEOUT" and final["restarts"] == 0, final
    assert len(attempts) == 1 and max(p.step for p in attempts[0].points) < 400
    print(f"\nignores USR1: {final['state']} after {took:.0f} s, last step "
          f"{max(p.step for p in attempts[0].points)} of 400, no requeue")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_usr1_after_the_last_requeue_ends_failed_not_completed(slurm_env: SlurmCluster, tmp_path: Path) -> None:
    final, attempts, took = _time_limited(tmp_path, 80, "save", 1, max_requeues=0)
    assert final["state"] == "FAILED" and final["exit_code"] == "75:0" and final["restarts"] == 0, final
    assert len(attempts) == 1 and max(p.step for p in attempts[0].points) < 80
    print(f"\nno requeue left: {final['state']} ({final['exit_code']}) after {took:.0f} s")
