"""The straggler matrix (issue 46): one rank throttled by a cgroup CPU quota, slowdown x world size,
each cell a real launch of tests/data/jobs/pace_train.py (torch DDP on gloo) through trainguard's
launcher with the run agent's step clocks, scored on whether the pace judgement names that rank.

    .venv/bin/python -m tests.benchmarks.pace_matrix [--slowdowns 1.25,1.5,2] [--worlds 2,3,4]
        [--steps 80] [--clean 2] [--hogs 0] [--out FILE.md] [--json FILE]

The quota is relative to the CPU share the rank got in a clean run at the same world size just
before (a loaded machine gives a rank less than one CPU, and a quota above what it gets never
binds): ``share / slowdown`` of one CPU (cgroup v1 ``cpu.cfs_quota_us``, as the slow_rank fault).
Per cell: named or not, the ratio it was named with, the steps until named, and the slowdown
measured (the run's median step time over the clean run's). ``--clean N``: N clean runs per world
size, each must name no straggler; ``--hogs H``: H busy-loop processes run beside every launch.
Needs root (a CPU cgroup); the culprit is the last rank.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

from trainguard.launch import Launcher, LaunchSpec
from trainguard.launch.hook import PACE_DIR, run_hook_env
from trainguard.launch.pace import read_pace, run_pace

ROOT = Path(__file__).resolve().parents[2]
JOB = ROOT / "tests" / "data" / "jobs" / "pace_train.py"
CGROUP_BASE = Path("/sys/fs/cgroup/cpu")
PERIOD_US = 100_000


@dataclass(frozen=True)
class Cell:
    world: int
    slowdown: float | None
    culprit: int | None
    named: tuple[int, ...]
    ratio: float | None
    steps_until_named: int | None
    measured_slowdown: float | None
    summary: str
    #: the share of the run's CFS periods in which the quota throttled the culprit (proof it bit)
    throttled_share: float | None = None


def _step_wall(run_dir: Path) -> float:
    """The run's median wall seconds per step (rank 0's clocks)."""
    clocks = read_pace(run_dir / PACE_DIR).get(0) or []
    walls = [b.wall - a.wall for a, b in itertools.pairwise(clocks)]
    return statistics.median(walls) if walls else float("nan")


def _share(run_dir: Path, rank: int) -> float:
    """The CPU share ``rank``'s training thread got per step (its CPU seconds over wall)."""
    clocks = read_pace(run_dir / PACE_DIR).get(rank) or []
    pairs = list(itertools.pairwise(clocks))
    return statistics.median((b.cpu - a.cpu) / (b.wall - a.wall) for a, b in pairs if b.wall > a.wall)


def launch(run_dir: Path, world: int, steps: int, extra: list[str]) -> None:
    argv = [sys.executable, str(JOB), "--steps", str(steps), "--width", "1024", *extra]
    env = {"OMP_NUM_THREADS": "1", **run_hook_env({"pace_dir": str(run_dir / PACE_DIR)})}
    spec = LaunchSpec(argv=argv, run_dir=run_dir, world_size=world, env=env, timeout=600,
                      startup_timeout=60, shutdown_timeout=60)
    result = Launcher(spec).run()
    if result.outcome != "ok":
        raise SystemExit(f"{run_dir}: the launch ended {result.outcome}")


def run_cell(root: Path, world: int, slowdown: float | None, steps: int, share: float | None) -> Cell:
    """One launch: clean (``slowdown`` None) or the last rank under a quota of ``share / slowdown``."""
    culprit = world - 1 if slowdown is not None else None
    run_dir = root / f"w{world}-{slowdown or 'clean'}-{uuid.uuid4().hex[:6]}"
    group = None
    throttled = None
    extra: list[str] = []
    if slowdown is not None and share is not None:
        group = CGROUP_BASE / f"trainguard-pace-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        group.mkdir()
        (group / "cpu.cfs_period_us").write_text(str(PERIOD_US))
        (group / "cpu.cfs_quota_us").write_text(str(max(1000, int(PERIOD_US * share / slowdown))))
        extra = ["--quota-rank", str(culprit), "--cgroup", str(group)]
    try:
        launch(run_dir, world, steps, extra)
    finally:
        if group is not None:
            stat = dict(line.split() for line in (group / "cpu.stat").read_text().splitlines())
            throttled = round(int(stat["nr_throttled"]) / max(1, int(stat["nr_periods"])), 2)
            home = CGROUP_BASE / "cgroup.procs"
            for pid in (group / "cgroup.procs").read_text().split():
                with open(home, "w") as handle:  # (a rank still exiting)
                    handle.write(pid)
            group.rmdir()
    report = run_pace(run_dir)
    named = tuple(r.rank for r in report.stragglers)
    row = next((r for r in report.ranks if r.rank == culprit), None)
    return Cell(world, slowdown, culprit, named, round(row.ratio, 3) if row else None,
                row.named_at_step if row else None, None, report.summary(), throttled)


def _hogs(n: int) -> list[subprocess.Popen[bytes]]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--slowdowns", default="1.25,1.5,2")
    p.add_argument("--worlds", default="2,3,4")
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--clean", type=int, default=1)
    p.add_argument("--hogs", type=int, default=0)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    hogs = _hogs(args.hogs)
    cells: list[Cell] = []
    try:
        with tempfile.TemporaryDirectory(prefix="tg-pace-") as tmp:
            root = Path(tmp)
            for world in (int(w) for w in args.worlds.split(",")):
                share = None
                clean_wall = float("nan")
                for _ in range(max(1, args.clean)):
                    cell = run_cell(root, world, None, args.steps, None)
                    cells.append(cell)
                    print(cell, flush=True)
                    last = max(root.glob(f"w{world}-clean-*"), key=lambda d: d.stat().st_mtime)
                    share, clean_wall = _share(last, world - 1), _step_wall(last)
                for slowdown in (float(s) for s in args.slowdowns.split(",") if s):
                    cell = run_cell(root, world, slowdown, args.steps, share)
                    done = max(root.glob(f"w{world}-{slowdown}-*"), key=lambda d: d.stat().st_mtime)
                    cell = Cell(**{**asdict(cell), "measured_slowdown": round(_step_wall(done) / clean_wall, 2)})
                    cells.append(cell)
                    print(cell, flush=True)
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    lines = ["| world | quota slowdown | measured slowdown | periods throttled | named | ratio | steps until named |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for c in cells:
        lines.append(f"| {c.world} | {c.slowdown or 'clean'} | {c.measured_slowdown or ''} | "
                     f"{'' if c.throttled_share is None else f'{c.throttled_share:.0%}'} | "
                     f"{', '.join(f'rank {r}' for r in c.named) or 'none'} | {c.ratio or ''} | "
                     f"{c.steps_until_named or ''} |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        args.out.write_text(table + "\n")
    if args.json:
        args.json.write_text(json.dumps([asdict(c) for c in cells], indent=1))


if __name__ == "__main__":
    main()
