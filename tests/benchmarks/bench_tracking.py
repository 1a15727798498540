"""Tracking overhead (not a CI test): a job's step time with MLflow tracking on vs off, as a ratio
measured in one process, interleaved to cancel drift in the machine's load.

    .venv/bin/python tests/benchmarks/bench_tracking.py blocks [--steps 3000] [--block-s 4]
    .venv/bin/python tests/benchmarks/bench_tracking.py runs [--pairs 6] [--steps 150]
        [--tracker warm|cold]
    (both: [--ranks 1] [--json out.json])

``blocks`` (the low-noise one): one long run of the digits example with tracking switched on and
off every ``--block-s`` seconds (the live metric stream and the system-metric sampling into a
launch run of a connected tracker, exactly what a tracked launch does while its ranks run).
Adjacent on/off blocks are seconds apart, so the machine's load drifts little between them; the
ratio is the median over adjacent block pairs of the blocks' mean step times (throughput) and,
separately, of their median step times. What tracking does after an attempt (per-rank rows,
logs, the plot) happens when the ranks are gone and is not in a step time.

``runs``: each pair launches the digits example twice, once untracked and once tracked (the order
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
from trainguard.config.settings import Settings
from trainguard.launch import MetricPoint
from trainguard.run.request import RunRequest
from trainguard.run.runner import JobRunner
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


def blocks(args: argparse.Namespace) -> dict[str, Any]:
    """One run, tracking toggled every ``block_s`` seconds; ratios of adjacent blocks."""
    from trainguard.tracking import LiveMetrics

    with tempfile.TemporaryDirectory(prefix="bench-tracking-") as tmp:
        project = Path(shutil.copytree(EXAMPLE, Path(tmp) / "digits", ignore=shutil.ignore_patterns(".trainguard")))
        job_file = load_config(project / "trainguard.yaml")
        uri, artifacts = default_store(job_file.state_dir / "store")
        tracker = Tracker(uri, artifact_location=artifacts)
        tracker.session = tracker.start_run("bench")
        handle = tracker.start_run("bench-blocks", parent=tracker.session)
        assert handle.created.wait(300), "the store did not open"
        live = LiveMetrics(tracker, handle, args.ranks)
        state = {"on": False, "block": 0, "until": 0.0}
        blocks_seen: list[tuple[int, bool]] = []
        step_block: dict[int, int] = {}

        def toggle(point: MetricPoint, launcher: Any) -> None:
            if point.name != "loss" or point.rank != 0:
                if state["on"]:
                    live.on_metric(point, launcher)
                return
            now = time.monotonic()
            if point.step > args.warmup and now >= state["until"]:
                state["on"] = not state["on"]
                state["block"] += 1
                state["until"] = now + args.block_s
                blocks_seen.append((int(state["block"]), bool(state["on"])))
                (tracker.start_sampling if state["on"] else tracker.stop_sampling)(handle)
            step_block[point.step] = int(state["block"])
            if state["on"]:
                live.on_metric(point, launcher)

        runner = JobRunner(job_file, Settings())
        request = RunRequest.make(steps=args.steps, seed=0, world_size=args.ranks,
                                  args=["--num-workers", "0", "--ckpt-every", "50"], timeout=3600)
        writer_before = thread_cpu_s(tracker)
        result = runner.run(request, label="bench", on_metric=toggle)
        writer_cpu = thread_cpu_s(tracker) - writer_before
        assert result.ok, result.reason
        flushed = tracker.close()
        assert flushed.complete, flushed
    times = {p.step: p.t for p in result.points if p.name == "loss" and p.rank == 0}
    per_block: dict[int, list[float]] = {}
    for step, t in sorted(times.items()):
        if step - 1 in times and step_block.get(step, 0) and step_block.get(step - 1) == step_block[step]:
            per_block.setdefault(step_block[step], []).append(t - times[step - 1])
    on_of = dict(blocks_seen)
    mean_ratios: list[float] = []
    median_ratios: list[float] = []
    numbers = sorted(b for b in per_block if len(per_block[b]) >= 5)
    for a, b in itertools.pairwise(numbers):
        if b != a + 1:
            continue
        on, off = (per_block[a], per_block[b]) if on_of[a] else (per_block[b], per_block[a])
        mean_ratios.append(statistics.fmean(on) / statistics.fmean(off))
        median_ratios.append(statistics.median(on) / statistics.median(off))
    on_steps = [x for blk, xs in per_block.items() if on_of.get(blk) for x in xs]
    off_steps = [x for blk, xs in per_block.items() if not on_of.get(blk) for x in xs]
    mlo, mq1, mmed, mq3, mhi = quartiles(mean_ratios)
    dlo, dq1, dmed, dq3, dhi = quartiles(median_ratios)
    out = {
        "mode": "blocks", "steps": args.steps, "ranks": args.ranks, "block_s": args.block_s,
        "blocks": len(numbers), "adjacent_pairs": len(mean_ratios),
        "step_ms_mean_on": round(statistics.fmean(on_steps) * 1000, 3),
        "step_ms_mean_off": round(statistics.fmean(off_steps) * 1000, 3),
        "step_ms_median_on": round(statistics.median(on_steps) * 1000, 3),
        "step_ms_median_off": round(statistics.median(off_steps) * 1000, 3),
        "ratio_of_means": {"median": round(mmed, 4), "quartiles": [round(mq1, 4), round(mq3, 4)],
                           "range": [round(mlo, 4), round(mhi, 4)]},
        "ratio_of_medians": {"median": round(dmed, 4), "quartiles": [round(dq1, 4), round(dq3, 4)],
                             "range": [round(dlo, 4), round(dhi, 4)]},
        "writer_cpu_s": round(writer_cpu, 3), "run_s": round(result.duration_s, 1),
        "flush_s": round(flushed.seconds, 2),
    }
    print(f"blocks: {args.steps} steps on {args.ranks} rank(s), {len(numbers)} blocks of {args.block_s:g} s, "
          f"{len(mean_ratios)} adjacent on/off pairs")
    print(f"step time on: mean {out['step_ms_mean_on']} ms, median {out['step_ms_median_on']} ms; "
          f"off: mean {out['step_ms_mean_off']} ms, median {out['step_ms_median_off']} ms")
    print(f"ratio on/off of block means: median {mmed:.4f} ({(mmed - 1) * 100:+.2f}%), quartiles "
          f"{mq1:.4f}..{mq3:.4f}, range {mlo:.4f}..{mhi:.4f}")
    print(f"ratio on/off of block medians: median {dmed:.4f} ({(dmed - 1) * 100:+.2f}%), quartiles "
          f"{dq1:.4f}..{dq3:.4f}, range {dlo:.4f}..{dhi:.4f}")
    print(f"writer thread CPU: {writer_cpu:.3f} s over the {result.duration_s:.0f} s run "
          f"({writer_cpu / result.duration_s * 100:.2f}% of one core, half of it tracking on)")
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", nargs="?", choices=("blocks", "runs"), default="blocks")
    parser.add_argument("--block-s", type=float, default=4.0)
    parser.add_argument("--pairs", type=int, default=6)
    parser.add_argument("--steps", type=int, default=None, help="default: 3000 (blocks), 150 (runs)")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--ranks", type=int, default=1)
    parser.add_argument("--tracker", choices=("warm", "cold"), default="warm")
    parser.add_argument("--json", type=Path, default=None, help="also write the numbers here")
    args = parser.parse_args()
    if args.mode == "blocks":
        args.steps = args.steps or 3000
        numbers = blocks(args)
        if args.json is not None:
            args.json.write_text(json.dumps(numbers, indent=2))
        return
    args.steps = args.steps or 150
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
