"""Launcher benchmark (not a CI test): death-to-teardown and hang-detection latency, and the
2-rank launch overhead versus a bare `python -m torch.distributed.run` of the same script.

    .venv/bin/python tests/benchmarks/bench_launcher.py [--kills 20] [--hangs 20] [--overhead 5]

Prints a table; numbers go into the closing notes. Uses a real 2-rank gloo job (a tiny
all-reduce loop) so the ranks are really inside collectives when one dies or stops.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from trainguard.launch import Launcher, LaunchSpec, reserve_port

SCRIPT = textwrap.dedent(
    """
    import os, sys, time
    import torch
    import torch.distributed as dist
    steps = int(sys.argv[1])
    dist.init_process_group("gloo")
    t = torch.zeros(1000)
    for step in range(1, steps + 1):
        t += 1
        dist.all_reduce(t)
        time.sleep(0.05)
        print(f"step {step} loss {float(t[0]) / 1e6:.6f}", flush=True)
    dist.destroy_process_group()
    """
)
REGEX = {"loss": r"step (?P<step>\d+) loss (?P<value>\S+)"}


def _spec(script: Path, run_dir: Path, steps: int, stall: float | None = 30.0) -> LaunchSpec:
    return LaunchSpec(
        argv=[sys.executable, str(script), str(steps)],
        run_dir=run_dir,
        world_size=2,
        env={"OMP_NUM_THREADS": "1"},
        metric_regexes=REGEX,
        timeout=300,
        stall_timeout=stall,
        startup_timeout=120.0,
        grace_period=2.0,
    )


def death_latency(script: Path, root: Path, n: int) -> list[float]:
    """SIGKILL rank 1 at step 5; time from the kill until run() returned (all ranks gone)."""
    out = []
    for i in range(n):
        launcher = Launcher(_spec(script, root / f"kill{i}", 10_000))
        killed_at: list[float] = []

        def cb(point, launcher, killed_at=killed_at):
            if point.step == 5 and not killed_at:
                os.kill(launcher.ranks[1].pid, signal.SIGKILL)
                killed_at.append(time.monotonic())

        launcher.on_metric.append(cb)
        result = launcher.run()
        done = time.monotonic()
        assert result.outcome == "failed" and result.failed_rank == 1, result.reason
        out.append(done - killed_at[0])
    return out


def hang_latency(script: Path, root: Path, n: int, stall: float) -> list[float]:
    """SIGSTOP rank 1 at step 5; time from stall_timeout expiry to the hang being reported
    (detection + CPU sampling + py-spy stacks + teardown)."""
    out = []
    for i in range(n):
        launcher = Launcher(_spec(script, root / f"hang{i}", 10_000, stall=stall))
        stopped_at: list[float] = []

        def cb(point, launcher, stopped_at=stopped_at):
            if point.step == 5 and not stopped_at:
                os.kill(launcher.ranks[1].pid, signal.SIGSTOP)
                stopped_at.append(time.monotonic())

        launcher.on_metric.append(cb)
        result = launcher.run()
        done = time.monotonic()
        assert result.outcome == "hung", result.reason
        # the last metric line arrived at most one step (50 ms) after the stop
        out.append(done - stopped_at[0] - stall)
    return out


def overhead(script: Path, root: Path, n: int, steps: int = 20) -> tuple[list[float], list[float]]:
    ours, bare = [], []
    for i in range(n):
        t = time.monotonic()
        result = Launcher(_spec(script, root / f"ovh{i}", steps)).run()
        ours.append(time.monotonic() - t)
        assert result.ok, result.reason
        with reserve_port() as port:
            t = time.monotonic()
            subprocess.run(
                [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                 "--master-addr", "127.0.0.1", "--master-port", str(port.port), str(script), str(steps)],
                check=True, capture_output=True, timeout=300,
                env={**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"},
            )
            bare.append(time.monotonic() - t)
    return ours, bare


def _fmt(values: list[float]) -> str:
    q = statistics.quantiles(values, n=20) if len(values) >= 2 else [values[0]] * 19
    return (f"n={len(values)} median {statistics.median(values):.3f} s, p95 {q[18]:.3f} s, "
            f"max {max(values):.3f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--hangs", type=int, default=20)
    parser.add_argument("--stall", type=float, default=2.0)
    parser.add_argument("--overhead", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        script = root / "job.py"
        script.write_text(SCRIPT)
        if args.kills:
            print("death -> all ranks torn down:", _fmt(death_latency(script, root, args.kills)))
        if args.hangs:
            print(f"hang detection beyond stall_timeout={args.stall:g}s (incl. stacks + teardown):",
                  _fmt(hang_latency(script, root, args.hangs, args.stall)))
        if args.overhead:
            ours, bare = overhead(script, root, args.overhead)
            print(f"2-rank 20-step run: trainguard {statistics.median(ours):.2f} s vs torch.distributed.run "
                  f"{statistics.median(bare):.2f} s (median of {args.overhead}; ratio "
                  f"{statistics.median(ours) / statistics.median(bare):.2f})")


if __name__ == "__main__":
    main()
