"""``trainguard calibrate CONFIG [--runs N] [--check NAME]`` (added to the main CLI)."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from trainguard.cli.args import SEED_HELP, nonempty_path, seed

__all__ = ["add_parser", "run"]


def _runs(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number; e.g. --runs 5") from None
    if not 3 <= value <= 100:
        raise argparse.ArgumentTypeError(f"{value} runs: use 3 to 100 (a spread needs at least 3)")
    return value


def add_parser(sub: Any) -> None:
    """Add the ``calibrate`` subcommand to ``trainguard``'s subparsers."""
    p = sub.add_parser(
        "calibrate",
        help="measure a job's run-to-run noise: the tolerances of canary, resume, parallel, reshard, compat",
        description="Run each reference run the job file's canary, resume, compat, parallel and reshard "
        "checks compare against N times with one seed and once with each of N-1 more seeds, and store the "
        "per-step mean and spread of every metric as this machine's calibration "
        "(.trainguard/calibration/). Later checks of the same run allow 3x the same-seed spread "
        "per step, and the canary's band is the across-seed mean ± 3 std; determinism stays "
        "exact. Exit 0 when stored, 1 when a run failed, 2 on a usage or job-file error. See "
        "docs/calibration.md.",
    )
    p.add_argument("config", metavar="CONFIG", type=nonempty_path,
                   help="job file, or a directory holding trainguard.yaml")
    p.add_argument("--runs", type=_runs, default=5, metavar="N",
                   help="runs of one seed (and N-1 more seeds) per reference run (default: 5)")
    p.add_argument("--check", metavar="NAME", action="append",
                   help="calibrate only the reference runs of this check (repeatable)")
    p.add_argument("--seed", type=seed, metavar="N", help=SEED_HELP)
    p.add_argument("-v", "--verbose", action="store_true", help="stream every rank's output")


def run(args: argparse.Namespace) -> int:
    """Run ``trainguard calibrate``; returns the exit code."""
    from trainguard.checks.calibration import CalibrationError
    from trainguard.session.calibrate import calibrate

    def echo(rank: int, stream: str, line: str) -> None:
        print(f"[rank{rank} {stream}] {line}", file=sys.stderr)

    try:
        done = calibrate(args.config, runs=args.runs, only=args.check, seed=args.seed,
                         echo=echo if args.verbose else None,
                         on_request=lambda what: print(f"calibrating {what}", flush=True))
    except CalibrationError as exc:
        print(f"FAILED: {exc}")
        return 1
    for entry in done:
        spreads = ", ".join(f"{m} same-seed spread up to {s['max_same_seed_spread']:.3g}, across seeds "
                            f"std up to {s['max_across_seed_std']:.3g}" for m, s in entry["metrics"].items())
        print(f"  {entry['steps']} steps at {entry['world_size']} rank(s): {spreads} "
              f"({entry['launches']} launches, {entry['seconds']:.0f} s)")
        print(f"  saved: {_rel(entry['path'])}")
    print(f"PASSED: {len(done)} reference run(s) calibrated")
    return 0


def _rel(path: str) -> str:
    try:
        rel = os.path.relpath(path)
    except ValueError:
        return path
    return rel if not rel.startswith("../../") else path
