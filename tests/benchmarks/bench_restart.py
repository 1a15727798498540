"""Restart reliability (not a CI test): the 2-rank digits example, rank 1 SIGKILLed right after
step 25, restarted by trainguard's restart policy (max_restarts 1) from the latest checkpoint.

    .venv/bin/python tests/benchmarks/bench_restart.py [--runs 8] [--torchrun]

Counts recoveries whose trajectory matches the uninterrupted 2-rank reference exactly, and the
median time from the kill to the first step printed after the restart. With --torchrun, also
runs the same kill under `python -m torch.distributed.run --max-restarts 1` for comparison
(with TORCH_DISABLE_SHARE_RDZV_TCP_STORE unset, as users run it).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from trainguard.checks.equivalence import compare_trajectories
from trainguard.config import parse_config
from trainguard.launch import Launcher, MetricPoint, reserve_port
from trainguard.launch.metrics import MetricParser, aligned_trajectories, trajectory
from trainguard.run.request import RunRequest
from trainguard.run.runner import JobRunner, LaunchOptions

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "digits"
STEPS, KILL_AFTER = 40, 25
JOB = """
job:
  name: restart-bench
  command: "python train.py --steps {steps} --ckpt-dir {checkpoint_dir} --seed {seed} --num-workers 2"
  resume_args: "--resume"
  world_size: 2
  env: {OMP_NUM_THREADS: "1"}
  metrics: {loss: 'step (?P<step>\\d+) loss (?P<value>\\S+)'}
  timeout: 300
  max_restarts: 1
"""


def ours(root: Path, runs: int) -> None:
    job_file = parse_config(JOB, path=root / "trainguard.yaml")
    runner = JobRunner(job_file)
    request = RunRequest.make(steps=STEPS, seed=0, world_size=2)
    reference = runner.scheduling.reference(request)
    recovered, latencies = 0, []
    for i in range(runs):
        killed_at: list[float] = []
        first_after: list[float] = []

        def inject(point: MetricPoint, launcher: Launcher, killed_at=killed_at, first_after=first_after) -> None:
            if launcher.spec.restart_count == 0 and point.step == KILL_AFTER and not killed_at:
                launcher.kill_rank(1, signal.SIGKILL)
                killed_at.append(time.monotonic())
            elif launcher.spec.restart_count == 1 and not first_after:
                first_after.append(time.monotonic())

        run = runner.supervise(request, label=f"bench{i}", options=LaunchOptions(backoff_s=0.0), on_metric=inject)
        actual, expected = aligned_trajectories(run.points, reference.points, "loss")
        diff = compare_trajectories(actual, expected, metric="loss")
        ok = run.ok and run.restarts == 1 and diff.ok
        recovered += ok
        if killed_at and first_after:
            latencies.append(first_after[0] - killed_at[0])
        print(f"  ours run {i}: {'recovered+matched' if ok else 'FAILED'} "
              f"({[a.outcome for a in run.attempts]}, first divergence {diff.first_divergent_step})")
    print(f"trainguard restart: {recovered}/{runs} recovered and matched the reference; "
          f"kill -> first step after restart: median {statistics.median(latencies):.2f} s")


def torchrun(root: Path, runs: int) -> None:
    parser = MetricParser({"loss": r"step (?P<step>\d+) loss (?P<value>\S+)"})
    ok = 0
    for i in range(runs):
        ckpt = root / f"tr{i}"
        ckpt.mkdir()
        env = {k: v for k, v in os.environ.items() if k != "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"}
        env["OMP_NUM_THREADS"] = "1"
        with reserve_port() as port:
            proc = subprocess.Popen(
                [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                 "--max-restarts", "1", "--master-addr", "127.0.0.1", "--master-port", str(port.port),
                 str(EXAMPLE / "train.py"), "--steps", str(STEPS), "--ckpt-dir", str(ckpt), "--seed", "0",
                 "--num-workers", "2", "--resume"],
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, cwd=EXAMPLE,
                start_new_session=True,
            )
            points = []
            killed = False
            timer = threading.Timer(300, lambda p=proc: os.killpg(p.pid, signal.SIGKILL))
            timer.start()
            assert proc.stdout is not None
            for raw in proc.stdout:
                for point in parser.parse(raw.decode(), rank=len(points) % 2, t=0.0):
                    points.append(point)
                    if point.step == KILL_AFTER and not killed:
                        killed = True
                        # rank 1 is the second worker child of the elastic agent
                        import psutil
                        workers = [c for c in psutil.Process(proc.pid).children(recursive=True)
                                   if "train.py" in " ".join(c.cmdline())]
                        workers.sort(key=lambda c: c.pid)
                        if len(workers) >= 2:
                            workers[1].kill()
            code = proc.wait()
            timer.cancel()
        steps = set(trajectory(points))
        good = code == 0 and STEPS in steps
        ok += good
        print(f"  torchrun run {i}: exit {code}, reached step {max(steps) if steps else 0}")
    print(f"torchrun --max-restarts 1: {ok}/{runs} recovered")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=8)
    parser.add_argument("--torchrun", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "digits"
        shutil.copytree(EXAMPLE, root, ignore=shutil.ignore_patterns(".trainguard", "__pycache__"))
        ours(root, args.runs)
        if args.torchrun:
            torchrun(Path(tmp), args.runs)


if __name__ == "__main__":
    main()
