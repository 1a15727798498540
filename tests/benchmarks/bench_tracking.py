"""Tracking overhead (not a CI test): the digits example's step time with MLflow tracking on vs
off, alternating in one process, as a ratio; and the flush time at the end of each tracked run.

    .venv/bin/python tests/benchmarks/bench_tracking.py [--pairs 4] [--steps 60] [--ranks 2]

Each tracked run gets a fresh :class:`~trainguard.tracking.Tracker` on a fresh sqlite store
(the worst case: mlflow imported and the schema created while the ranks train). Step time is
the median interval between consecutive ``loss`` lines of rank 0, after the first 5 steps.
"""

from __future__ import annotations

import argparse
import itertools
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from trainguard.config import load_config
from trainguard.launch import MetricPoint
from trainguard.runner import JobRunner
from trainguard.settings import Settings
from trainguard.tracking import Tracker, default_store

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "digits"


def step_time(points: list[MetricPoint], skip: int = 5) -> float:
    times = sorted(p.t for p in points if p.name == "loss" and p.rank == 0 and p.step > skip)
    return statistics.median(b - a for a, b in itertools.pairwise(times))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pairs", type=int, default=4)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--ranks", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        project = Path(shutil.copytree(EXAMPLE, Path(tmp) / "digits", ignore=shutil.ignore_patterns(".trainguard")))
        job_file = load_config(project / "trainguard.yaml")
        off: list[float] = []
        on: list[float] = []
        flushes: list[float] = []
        for pair in range(args.pairs):
            for tracked in (pair % 2 == 0, pair % 2 == 1):  # alternate which goes first
                tracker = None
                if tracked:
                    uri, artifacts = default_store(job_file.state_dir / f"store-{pair}")
                    tracker = Tracker(uri, artifact_location=artifacts)
                    tracker.session = tracker.start_run("bench")
                runner = JobRunner(job_file, Settings(), tracker=tracker)
                request = runner.request_for(job_file.checks.canary, world_size=args.ranks)
                request = type(request).make(steps=args.steps, seed=0, world_size=args.ranks)
                result = runner.run(request, label="bench")
                assert result.ok, result.reason
                (on if tracked else off).append(step_time(result.points))
                if tracker is not None:
                    started = time.monotonic()
                    flushed = tracker.close()
                    flushes.append(time.monotonic() - started)
                    assert flushed.complete, flushed
        ratio = statistics.median(on) / statistics.median(off)
        print(f"step time off: {[round(x * 1000, 1) for x in off]} ms")
        print(f"step time on:  {[round(x * 1000, 1) for x in on]} ms")
        print(f"ratio on/off (medians): {ratio:.4f} ({(ratio - 1) * 100:+.2f}%)")
        print(f"flush at close: {[round(x, 2) for x in flushes]} s")


if __name__ == "__main__":
    main()
