"""Profile prediction accuracy (not a CI test): profile the digits example (its shipped
``checks.profile``: 30 steps at 1 and 2 ranks), predict the wall-clock of a run ``--factor``
times longer from it, then run that and compare.

    .venv/bin/python tests/benchmarks/bench_profile_prediction.py [--factor 5] [--sizes 1,2] [--repeats 1] [--noise]

Reported per world size: predicted and measured wall-clock (launch to exit) and the
prediction error, and the same for the steps alone (first step line to last, which leaves out
the start-up whose cost on a shared machine varies from run to run).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
from pathlib import Path

from trainguard.config import load_config
from trainguard.config.settings import Settings
from trainguard.profiling.measure import measure_size
from trainguard.profiling.sizing import predict_duration_s
from trainguard.run.runner import JobRunner

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "digits"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--factor", type=int, default=5)
    parser.add_argument("--sizes", default="1,2")
    parser.add_argument("--repeats", type=int, default=1, help="profile/long-run pairs per size")
    parser.add_argument("--noise", action="store_true",
                        help="run each long run twice: how well one long run predicts its own repeat "
                             "is the machine's noise floor, the best any prediction can do")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    rows = []
    with tempfile.TemporaryDirectory(prefix="tg-bench-profile-") as tmp:
        root = Path(tmp) / "digits"
        shutil.copytree(EXAMPLE, root, ignore=shutil.ignore_patterns(".trainguard", "__pycache__"))
        job_file = load_config(root)
        spec = job_file.checks.profile
        assert spec is not None, "examples/digits/trainguard.yaml has no checks.profile"
        runner = JobRunner(job_file, Settings())
        long_steps = spec.steps * args.factor
        for n in [n for n in sizes for _ in range(args.repeats)]:
            short, _ = measure_size(runner, spec, n, seed=0)
            assert short.step is not None and short.startup_s is not None, short.reason
            predicted = predict_duration_s(
                short.startup_s, short.step.mean_s, long_steps, short.tail_s or 0.0,
                warmup_s=short.warmup_s or 0.0, warmup_steps=spec.warmup_steps,
            )
            predicted_steps = predicted - short.startup_s - (short.tail_s or 0.0)
            # the long run: same job, same measurement, warm-up as in the profile
            long, result = measure_size(runner, spec, n, seed=0, steps=long_steps, label=f"long-n{n}")
            assert result.ok, result.reason
            arrivals = sorted(p.t for p in result.points if p.rank == 0 and p.name == "loss")
            actual_steps = arrivals[-1] - arrivals[0]
            row = {
                "world_size": n,
                "profile_steps": spec.steps,
                "long_steps": long_steps,
                "profile_startup_s": short.startup_s,
                "profile_mean_step_s": round(short.step.mean_s, 5),
                "predicted_s": round(predicted, 2),
                "actual_s": round(result.duration_s, 2),
                "error": round((predicted - result.duration_s) / result.duration_s, 4),
                "predicted_steps_s": round(predicted_steps, 2),
                "actual_steps_s": round(actual_steps, 2),
                "steps_error": round((predicted_steps - actual_steps) / actual_steps, 4),
                "long_startup_s": long.startup_s,
            }
            if args.noise:
                _, again = measure_size(runner, spec, n, seed=0, steps=long_steps, label=f"long-n{n}-again")
                assert again.ok, again.reason
                row["repeat_s"] = round(again.duration_s, 2)
                row["repeat_error"] = round((result.duration_s - again.duration_s) / again.duration_s, 4)
            rows.append(row)
            print(
                f"{n} rank(s): {long_steps} steps predicted {predicted:.1f} s, took "
                f"{result.duration_s:.1f} s (error {row['error']:+.1%}); steps alone predicted "
                f"{predicted_steps:.1f} s, took {actual_steps:.1f} s (error {row['steps_error']:+.1%}); "
                f"start-up {short.startup_s:.1f} s in the profile, {long.startup_s:.1f} s in the long run"
                + (f"; the same long run again took {row['repeat_s']:.1f} s ({row['repeat_error']:+.1%})"
                   if args.noise else ""),
                flush=True,
            )
    for n in sizes:
        errors = sorted(abs(r["error"]) for r in rows if r["world_size"] == n)
        steps_errors = sorted(abs(r["steps_error"]) for r in rows if r["world_size"] == n)
        actual = [r["actual_steps_s"] for r in rows if r["world_size"] == n]
        if args.noise:
            floor = sorted(abs(r["repeat_error"]) for r in rows if r["world_size"] == n)
            print(f"{n} rank(s): noise floor (a long run predicting its own repeat) |error| median "
                  f"{statistics.median(floor):.1%} (max {floor[-1]:.1%})")
        print(
            f"{n} rank(s), {len(errors)} pair(s): |error| median {statistics.median(errors):.1%} "
            f"(max {errors[-1]:.1%}); steps alone median {statistics.median(steps_errors):.1%} "
            f"(max {steps_errors[-1]:.1%}); the long runs' steps took {min(actual):.1f}-{max(actual):.1f} s"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
