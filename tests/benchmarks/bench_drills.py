"""Drill reliability (not a CI test): N consecutive kill_rank drills with ``expect: recover`` on
the 2-rank digits example, through the same code path as ``trainguard drill``.

    .venv/bin/python tests/benchmarks/bench_drills.py [--runs 100] [--steps N] [--after-step K]

The drill is the example's own ``kill-rank1`` (examples/digits/trainguard.yaml: 60 steps, kill
after step 22), with --steps/--after-step overriding it. Each drill SIGKILLs rank 1 right after
it prints step ``after_step``; trainguard restarts the
group from the latest checkpoint, and the drill passes only when the job completes and every step
equals the uninterrupted 2-rank reference (run once, shared). Prints how many drills recovered
and matched, and the median (and max) time from the kill to the first step printed after the
restart (restart backoff, process start-up, imports, rendezvous, checkpoint load included).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from tests.helpers import report_evidence
from trainguard.config import load_config
from trainguard.drills import make_drill, run_drill
from trainguard.run.runner import JobRunner

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "digits"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--after-step", type=int, default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-drills-") as tmp:
        root = Path(tmp) / "digits"
        shutil.copytree(EXAMPLE, root, ignore=shutil.ignore_patterns(".trainguard", "__pycache__"))
        job_file = load_config(root / "trainguard.yaml")
        example = next(d for d in job_file.checks.drills if d.name == "kill-rank1")
        overrides = {k: v for k, v in (("steps", args.steps), ("after_step", args.after_step)) if v}
        spec = make_drill(job_file, {**example.model_dump(exclude_unset=True), **overrides})
        runner = JobRunner(job_file)
        started = time.monotonic()
        runner.scheduling.reference(runner.request_for(spec, world_size=2))
        print(f"reference run: {time.monotonic() - started:.1f} s")
        passed, latencies, lost, durations = 0, [], [], []
        for i in range(args.runs):
            result = run_drill(runner, spec)
            ok = result.status == "passed"
            passed += ok
            durations.append(result.duration_s)
            recovery = report_evidence(result).get("fault_to_first_step_after_restart_s")
            if recovery is not None:
                latencies.append(recovery)
            if report_evidence(result).get("lost_steps") is not None:
                lost.append(report_evidence(result)["lost_steps"])
            print(f"  drill {i}: {result.status} in {result.duration_s:.1f} s; kill -> first step "
                  f"after restart {recovery} s; {'' if ok else result.summary}", flush=True)
        print(f"kill_rank recover on the 2-rank digits job: {passed}/{args.runs} recovered and "
              f"matched the uninterrupted run")
        if latencies:
            print(f"kill -> first step after restart: median {statistics.median(latencies):.2f} s, "
                  f"max {max(latencies):.2f} s; steps lost: {sorted(set(lost))}; drill wall time "
                  f"median {statistics.median(durations):.1f} s")


if __name__ == "__main__":
    main()
