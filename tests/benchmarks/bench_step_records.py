"""Step records' overhead (not a CI test): a job's step time with the run agent's step records
on vs off (issue 44's constraint: at most 5 % on a tiny nanoGPT and on digits at world size 2).

    .venv/bin/python tests/benchmarks/bench_step_records.py [nanogpt|digits|both] [--pairs 5]
        [--steps 250] [--warmup 20] [--json out.json]
    (nanogpt: [--n-layer 2] [--n-head 2] [--n-embd 64] [--block-size 64] [--batch-size 8] [--mirror PATH];
     nanoGPT's README's CPU run ("I only have a macbook"): --n-layer 4 --n-head 4 --n-embd 128
     --block-size 64 --batch-size 12)

Each pair launches the job twice through :class:`JobRunner`, once with ``job.record_steps: false``
(the job as it ran before the step records: the start-up hook still records sample indices,
``record_samples`` as the job has it) and once with the default ``record_steps: true``; the order
alternates between pairs, so the machine's load drifts out of the pair ratios. A pair's ratio is
its on step time over its off step time; reported: the median of the pair ratios with their
spread (min, quartiles, max), the pooled per-step medians, the same ratio of each run's 10th
percentile step time (on a shared machine the steps least slowed by other load), and the CPU
seconds of the ranks per run (``RUSAGE_CHILDREN``: start-up included).

A run's step time is the median of its per-step times after ``--warmup`` steps (start-up and
the first steps excluded; the median is robust to the odd slow step and the machine's load):

* **nanogpt**: karpathy/nanoGPT's train.py, model.py and configurator.py as cloned (a local
  mirror, ``TRAINGUARD_NANOGPT_MIRROR``), random uint16 tokens, the job file `trainguard init`
  writes (tests/benchmarks/cause_table.py's ``nanogpt_job``) with a tiny CPU model and no eval
  after iter 0 (``--eval_interval`` beyond the run): the step time is the job's own ``time ... ms``
  of each ``iter`` line (time.time() around the whole iteration, its print included).
* **digits**: examples/digits at world size 2 (``--num-workers 0``: DataLoader workers on a
  2-core machine only add noise): the interval between consecutive ``step N loss`` lines of
  rank 0 as the launcher reads them (the mean interval, checkpoints every 5 steps and evals every
  20 included, is reported too).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.benchmarks.cause_table import NANOGPT_MIRROR, nanogpt_job
from trainguard.config import load_config
from trainguard.config.settings import Settings
from trainguard.launch import MetricPoint
from trainguard.run.request import RunRequest
from trainguard.run.runner import JobRunner

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "digits"
#: nanoGPT's per-iteration time as it prints it
NANOGPT_STEP_MS = r"iter (?P<step>\d+): loss \S+, time (?P<value>[-+.\d]+)ms"


def quartiles(values: list[float]) -> tuple[float, float, float, float, float]:
    if len(values) < 2:
        return (values[0],) * 5
    q1, q2, q3 = statistics.quantiles(values, n=4)
    return min(values), q1, q2, q3, max(values)


def with_records_off(job_yaml: Path) -> Path:
    """A copy of the job file next to it with ``record_steps: false`` under ``job:``."""
    text = job_yaml.read_text()
    assert text.count("\njob:\n") == 1 or text.startswith("job:\n"), f"no 'job:' block in {job_yaml}"
    off = job_yaml.with_name(job_yaml.stem + "-off.yaml")
    off.write_text(re.sub(r"(^|\n)job:\n", r"\1job:\n  record_steps: false\n", text, count=1))
    return off


def nanogpt_files(tmp: Path, args: argparse.Namespace) -> Path:
    """nanoGPT's job file, tiny, its step time as a metric, no eval or checkpoint after iter 0."""
    path = nanogpt_job(tmp, Path(args.mirror))
    text = path.read_text()
    sizes = {"n_layer": args.n_layer, "n_head": args.n_head, "n_embd": args.n_embd, "block_size": args.block_size,
             "batch_size": args.batch_size, "eval_interval": 1_000_000}
    for key, value in sizes.items():
        text, n = re.subn(rf"--{key}=\d+", f"--{key}={value}", text)
        assert n >= 1, f"no --{key} in {path}"
    text = text.replace("  metrics:\n", f"  metrics:\n    step_ms: '{NANOGPT_STEP_MS}'\n", 1)
    path.write_text(text)
    return path


def digits_files(tmp: Path, args: argparse.Namespace) -> Path:
    project = Path(shutil.copytree(EXAMPLE, tmp / "digits", ignore=shutil.ignore_patterns(".trainguard")))
    return project / "trainguard.yaml"


def nanogpt_steps(points: list[MetricPoint], warmup: int) -> list[float]:
    """nanoGPT's own per-iteration times (s) after ``warmup`` iterations."""
    return [p.value / 1000 for p in points if p.name == "step_ms" and p.step > warmup]


def digits_steps(points: list[MetricPoint], warmup: int) -> list[float]:
    """Intervals (s) between rank 0's consecutive loss lines after ``warmup`` steps."""
    times = {p.step: p.t for p in points if p.name == "loss" and p.rank == 0 and p.step > warmup}
    return [times[s] - times[s - 1] for s in sorted(times) if s - 1 in times]


JOBS: dict[str, tuple[Callable[[Path, argparse.Namespace], Path], Callable[[list[MetricPoint], int], list[float]],
                      int, list[str]]] = {
    # name: (job files, step times, world size, args)
    "nanogpt": (nanogpt_files, nanogpt_steps, 1, []),
    "digits": (digits_files, digits_steps, 2, ["--num-workers", "0"]),
}


def bench(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """``args.pairs`` alternating off/on runs of job ``name``; the ratios and their spread."""
    make_files, step_times, world_size, job_args = JOBS[name]
    with tempfile.TemporaryDirectory(prefix=f"bench-steps-{name}-") as tmp:
        on_yaml = make_files(Path(tmp), args)
        files = {True: load_config(on_yaml), False: load_config(with_records_off(on_yaml))}
        assert files[True].job.record_steps and not files[False].job.record_steps
        request = RunRequest.make(steps=args.steps + args.warmup, seed=0, world_size=world_size, args=job_args)
        per_run: dict[bool, list[float]] = {False: [], True: []}
        means: dict[bool, list[float]] = {False: [], True: []}
        pooled: dict[bool, list[float]] = {False: [], True: []}
        cpu: dict[bool, list[float]] = {False: [], True: []}
        ratios: list[float] = []
        fast: dict[bool, list[float]] = {False: [], True: []}
        fast_ratios: list[float] = []
        for pair in range(args.pairs):
            medians: dict[bool, float] = {}
            p10: dict[bool, float] = {}
            for on in (pair % 2 == 1, pair % 2 == 0):  # alternate which goes first
                runner = JobRunner(files[on], Settings())  # a fresh pool: no run shared
                before = resource.getrusage(resource.RUSAGE_CHILDREN)
                result = runner.run(request, label=f"bench-{'on' if on else 'off'}")
                after = resource.getrusage(resource.RUSAGE_CHILDREN)
                assert result.ok, result.reason
                records = list((result.run_dir).rglob("trainguard-steps/rank0.jsonl"))
                assert bool(records) == on, f"step records {'missing' if on else 'written'}: {result.run_dir}"
                steps = step_times(result.points, args.warmup)
                assert len(steps) >= args.steps - 2, f"{len(steps)} step times in {result.run_dir}"
                medians[on] = statistics.median(steps)
                p10[on] = statistics.quantiles(steps, n=10)[0]
                fast[on].append(p10[on])
                per_run[on].append(medians[on])
                means[on].append(statistics.fmean(steps))
                pooled[on].extend(steps)
                cpu[on].append(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)
            ratios.append(medians[True] / medians[False])
            fast_ratios.append(p10[True] / p10[False])
            print(f"{name} pair {pair}: off {medians[False] * 1000:.3f} ms  on {medians[True] * 1000:.3f} ms  "
                  f"ratio {ratios[-1]:.4f}", flush=True)
    lo, q1, med, q3, hi = quartiles(ratios)
    out: dict[str, Any] = {
        "job": name, "pairs": args.pairs, "steps": args.steps, "warmup": args.warmup, "world_size": world_size,
        "step_ms_off": [round(x * 1000, 3) for x in per_run[False]],
        "step_ms_on": [round(x * 1000, 3) for x in per_run[True]],
        "step_ms_off_median": round(statistics.median(per_run[False]) * 1000, 3),
        "step_ms_on_median": round(statistics.median(per_run[True]) * 1000, 3),
        "pair_ratios": [round(r, 4) for r in ratios],
        "ratio_median": round(med, 4), "ratio_quartiles": [round(q1, 4), round(q3, 4)],
        "ratio_range": [round(lo, 4), round(hi, 4)],
        "pooled_ratio": round(statistics.median(pooled[True]) / statistics.median(pooled[False]), 4),
        "mean_step_ratio": round(statistics.median(means[True]) / statistics.median(means[False]), 4),
        "step_ms_p10_off": [round(x * 1000, 3) for x in fast[False]],
        "step_ms_p10_on": [round(x * 1000, 3) for x in fast[True]],
        "p10_ratios": [round(r, 4) for r in fast_ratios], "p10_ratio_median": round(statistics.median(fast_ratios), 4),
        "cpu_s_per_run": {"off": round(statistics.median(cpu[False]), 2), "on": round(statistics.median(cpu[True]), 2)},
    }
    if name == "nanogpt":
        out["model"] = {"n_layer": args.n_layer, "n_head": args.n_head, "n_embd": args.n_embd, "block_size": args.block_size, "batch_size": args.batch_size}
    print(f"{name}: {args.pairs} pairs x {args.steps} steps (+{args.warmup} warm-up) on {world_size} rank(s)")
    print(f"  step ms off: {out['step_ms_off']}")
    print(f"  step ms on:  {out['step_ms_on']}")
    print(f"  ratio on/off: median of pairs {med:.4f} ({(med - 1) * 100:+.2f}%), quartiles {q1:.4f}..{q3:.4f}, "
          f"range {lo:.4f}..{hi:.4f}; pooled per-step medians {out['pooled_ratio']:.4f}; "
          f"mean step times {out['mean_step_ratio']:.4f}")
    print(f"  10th percentiles of the step times (the steps least slowed by other load): off "
          f"{out['step_ms_p10_off']} on {out['step_ms_p10_on']}; ratio median of pairs {out['p10_ratio_median']:.4f}")
    print(f"  CPU s per run (ranks, start-up included, medians): off {out['cpu_s_per_run']['off']} "
          f"on {out['cpu_s_per_run']['on']}", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("job", nargs="?", choices=("nanogpt", "digits", "both"), default="both")
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--steps", type=int, default=250, help="timed steps per run (after the warm-up)")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--n-layer", type=int, default=2)
    parser.add_argument("--n-head", type=int, default=2)
    parser.add_argument("--n-embd", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--mirror", default=str(NANOGPT_MIRROR))
    parser.add_argument("--json", type=Path, default=None, help="also write the numbers here")
    args = parser.parse_args()
    names = ["nanogpt", "digits"] if args.job == "both" else [args.job]
    if "nanogpt" in names and not (Path(args.mirror) / "HEAD").exists():
        raise SystemExit(f"no nanoGPT mirror at {args.mirror} (--mirror or TRAINGUARD_NANOGPT_MIRROR)")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    results = [bench(name, args) for name in names]
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
