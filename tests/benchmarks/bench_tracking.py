"""Tracking overhead (not a CI test): a job's step time with MLflow tracking on vs off, as a ratio
measured in one process, interleaved to cancel drift in the machine's load.

    .venv/bin/python tests/benchmarks/bench_tracking.py [--pairs 6] [--steps 150] [--ranks 1]
        [--tracker warm|cold] [--json out.json]

Each pair launches the digits example twice, once untracked and once tracked (the order
alternates between pairs). A run's step time is the median interval between consecutive ``loss``
lines of rank 0 after ``--warmup`` steps (robust to the odd slow step); a pair's ratio is its
tracked step time over its untracked one. Reported: the median of the pair ratios with their
spread (min, quartiles, max), the pooled medians of all per-step intervals, and the time
:meth:`Tracker.close` takes at the end.

Wall-clock step times on a shared machine are noisy, so CPU time is reported too, which is not:
the CPU seconds of the ranks (``RUSAGE_CHILDREN``), of this process (``RUSAGE_SELF``: the
launcher's monitor thread, the live metric callback and the writer) and of the writer thread
alone (``/proc/self/task/<tid>/stat``), per run. Tracking's CPU cost over the ranks' CPU time
bounds the slowdown it can cause when every core is busy.

``--tracker warm`` (default: the steady state of a session) uses one tracker for all tracked
runs, connected before the first; ``cold`` gives each tracked run a fresh tracker on a fresh
store, so mlflow's import and the schema creation overlap the run (the first check of a session).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import resource
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from trainguard.config import load_config
from trainguard.launch import MetricPoint
from trainguard.runner import JobRunner, RunRequest
from trainguard.settings import Settings
from trainguard.tracking import Tracker, default_store

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "digits"


def intervals(points: list[MetricPoint], warmup: int) -> list[float]:
    times = sorted(p.t for p in points if p.name == "loss" and p.rank == 0 and p.step > warmup)
    return [b - a for a, b in itertools.pairwise(times)]


def thread_cpu_s(tracker: Tracker | None) -> float:
    """CPU seconds the tracker's writer thread used so far (Linux)."""
    tid = tracker._thread.native_id if tracker is not None else None
    if tid is None:
        return 0.0
    try:
        fields = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0  # the thread has ended
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def quartiles(values: list[float]) -> tuple[float, float, float, float, float]:
    if len(values) < 2:
        return (values[0],) * 5
    q1, q2, q3 = statistics.quantiles(values, n=4)
    return min(values), q1, q2, q3, max(values)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pairs", type=int, default=6)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--ranks", type=int, default=1)
    parser.add_argument("--tracker", choices=("warm", "cold"), default="warm")
    parser.add_argument("--json", type=Path, default=None, help="also write the numbers here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-tracking-") as tmp:
        project = Path(shutil.copytree(EXAMPLE, Path(tmp) / "digits", ignore=shutil.ignore_patterns(".trainguard")))
        job_file = load_config(project / "trainguard.yaml")
        request = RunRequest.make(steps=args.steps, seed=0, world_size=args.ranks, args=["--num-workers", "0"])

        def new_tracker(store: str) -> Tracker:
            uri, artifacts = default_store(job_file.state_dir / store)
            tracker = Tracker(uri, artifact_location=artifacts)
            tracker.session = tracker.start_run("bench")
            return tracker

        warm: Tracker | None = None
        if args.tracker == "warm":
            warm = new_tracker("store")
            assert warm.session is not None and warm.session.created.wait(300), "the store did not open"
        per_run: dict[bool, list[float]] = {False: [], True: []}
        pooled: dict[bool, list[float]] = {False: [], True: []}
        cpu: dict[str, dict[bool, list[float]]] = {k: {False: [], True: []} for k in ("ranks", "self", "writer")}
        ratios: list[float] = []
        flushes: list[float] = []
        for pair in range(args.pairs):
            medians: dict[bool, float] = {}
            for tracked in (pair % 2 == 0, pair % 2 == 1):  # alternate which goes first
                tracker = (warm or new_tracker(f"store-{pair}")) if tracked else None
                runner = JobRunner(job_file, Settings(), tracker=tracker)
                before = (resource.getrusage(resource.RUSAGE_CHILDREN), resource.getrusage(resource.RUSAGE_SELF),
                          thread_cpu_s(tracker))
                result = runner.run(request, label="bench")
                after = (resource.getrusage(resource.RUSAGE_CHILDREN), resource.getrusage(resource.RUSAGE_SELF),
                         thread_cpu_s(tracker))
                assert result.ok, result.reason
                for key, b, a in (("ranks", before[0], after[0]), ("self", before[1], after[1])):
                    cpu[key][tracked].append(a.ru_utime + a.ru_stime - b.ru_utime - b.ru_stime)
                cpu["writer"][tracked].append(after[2] - before[2])
                if tracker is not None and tracker is warm:
                    # what the writer does after a run (rank logs, the plot) must not overlap
                    # the next run, tracked or not
                    deadline = time.monotonic() + 120
                    while tracker._ops and time.monotonic() < deadline:
                        time.sleep(0.1)
                steps = intervals(result.points, args.warmup)
                medians[tracked] = statistics.median(steps)
                per_run[tracked].append(medians[tracked])
                pooled[tracked].extend(steps)
                if tracker is not None and tracker is not warm:
                    started = time.monotonic()
                    flushed = tracker.close()
                    flushes.append(time.monotonic() - started)
                    assert flushed.complete, flushed
            ratios.append(medians[True] / medians[False])
            print(f"pair {pair}: off {medians[False] * 1000:.2f} ms  on {medians[True] * 1000:.2f} ms  "
                  f"ratio {ratios[-1]:.4f}", flush=True)
        if warm is not None:
            started = time.monotonic()
            flushed = warm.close()
            flushes.append(time.monotonic() - started)
            assert flushed.complete, flushed
    lo, q1, med, q3, hi = quartiles(ratios)
    pooled_ratio = statistics.median(pooled[True]) / statistics.median(pooled[False])
    out: dict[str, Any] = {
        "tracker": args.tracker, "pairs": args.pairs, "steps": args.steps, "ranks": args.ranks,
        "step_ms_off": [round(x * 1000, 3) for x in per_run[False]],
        "step_ms_on": [round(x * 1000, 3) for x in per_run[True]],
        "pair_ratios": [round(r, 4) for r in ratios],
        "ratio_median": round(med, 4), "ratio_quartiles": [round(q1, 4), round(q3, 4)],
        "ratio_range": [round(lo, 4), round(hi, 4)],
        "pooled_ratio": round(pooled_ratio, 4),
        "flush_s": [round(x, 2) for x in flushes],
        "cpu_s_per_run": {k: {("on" if t else "off"): round(statistics.median(v), 3) for t, v in d.items() if v}
                          for k, d in cpu.items()},
    }
    ranks_cpu = statistics.median(cpu["ranks"][False] + cpu["ranks"][True])
    extra_self = statistics.median(cpu["self"][True]) - statistics.median(cpu["self"][False])
    out["tracking_cpu_over_ranks_cpu"] = round(extra_self / ranks_cpu, 4)
    print(f"tracker {args.tracker}, {args.pairs} pairs x {args.steps} steps on {args.ranks} rank(s)")
    print(f"step time off: {out['step_ms_off']} ms")
    print(f"step time on:  {out['step_ms_on']} ms")
    print(f"ratio on/off: median of pairs {med:.4f} ({(med - 1) * 100:+.2f}%), quartiles "
          f"{q1:.4f}..{q3:.4f}, range {lo:.4f}..{hi:.4f}; pooled per-step medians {pooled_ratio:.4f}")
    print(f"flush at close: {out['flush_s']} s")
    c = out["cpu_s_per_run"]
    print(f"CPU s per run (medians): ranks off {c['ranks']['off']} on {c['ranks']['on']}; this process "
          f"off {c['self']['off']} on {c['self']['on']} (writer thread {c['writer'].get('on')}); tracking's "
          f"extra CPU / ranks' CPU = {out['tracking_cpu_over_ranks_cpu'] * 100:+.2f}%")
    if args.json is not None:
        args.json.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
