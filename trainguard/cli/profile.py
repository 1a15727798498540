"""``trainguard profile CONFIG [--compare EXPR ...] [--save]`` (added to the main CLI)."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from trainguard.cli.args import SEED_HELP, nonempty_path, seed, world_sizes

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> None:
    """Add the ``profile`` subcommand to ``trainguard``'s subparsers."""
    p = sub.add_parser(
        "profile",
        help="profile a job at several world sizes and write the sizing report",
        description="Run the job briefly at each world size of checks.profile (defaults: 30 steps "
        "at 1 and 2 ranks), measure step times, throughput, memory and scaling, size the full run "
        "of the `target:` section, and write JSON, Markdown and HTML reports "
        "(.trainguard/profile/latest.*). Exit 0 when every size ran and no --compare expression "
        "found a regression, 1 otherwise, 2 on a usage or job-file error. See docs/profiling.md.",
    )
    p.add_argument("config", metavar="CONFIG", type=nonempty_path,
                   help="job file, or a directory holding trainguard.yaml")
    p.add_argument(
        "--compare",
        metavar="EXPR",
        action="append",
        default=[],
        help="fail on a regression against this machine's latest saved profile, e.g. "
        "'p50_step_time:+10%%' or 'throughput@2:-5%%' (repeatable; also checks.profile.compare)",
    )
    p.add_argument("--save", action="store_true", help="save this profile as this machine's baseline")
    p.add_argument(
        "--world-sizes", metavar="N,N", type=world_sizes,
        help="override checks.profile.world_sizes, e.g. 1,2,4"
    )
    p.add_argument(
        "--headroom", action=argparse.BooleanOptionalAction, default=None,
        help="run (or with --no-headroom skip) the batch-size / memory headroom search of "
        "checks.profile.headroom (default: run it when configured)",
    )
    p.add_argument("--seed", type=seed, metavar="N", help=SEED_HELP)
    p.add_argument("-v", "--verbose", action="store_true", help="stream every rank's output")


def run(args: argparse.Namespace) -> int:
    """Run ``trainguard profile``; returns the exit code."""
    from trainguard.config import ProfileCheck, load_config, profile_problems
    from trainguard.errors import ConfigError
    from trainguard.profiling.check import profile_job, summarise
    from trainguard.profiling.compare import RegressionExpressionError, parse_regressions
    from trainguard.session import open_session, session_settings

    job_file = load_config(args.config)
    spec = job_file.checks.profile
    if args.headroom and (spec is None or spec.headroom is None):
        raise ConfigError(
            "--headroom needs a `headroom:` section under checks.profile (and {batch_size} in "
            "job.command), e.g. `headroom: {start: 16, max: 4096, memory_budget_mb: 2000}`",
            path=str(job_file.path), key="checks.profile.headroom",
        )
    if spec is None:
        spec = ProfileCheck.model_validate({})
        problems = profile_problems(job_file, spec, set())
        if problems:
            key, msg = problems[0]
            raise ConfigError(f"{msg} (add a `checks.profile:` section)", path=str(job_file.path), key=key)
        print("no checks.profile in the job file: using the defaults (30 steps at 1 and 2 ranks)")
    try:
        parse_regressions([*spec.compare, *args.compare])  # bad expressions stop before any run
    except RegressionExpressionError as exc:
        print(f"trainguard: error: {exc}", file=sys.stderr)
        return 2
    sizes = args.world_sizes  # checked by argparse (trainguard.cli.args.world_sizes)
    settings = session_settings(seed=args.seed)

    def echo(rank: int, stream: str, line: str) -> None:
        print(f"[rank{rank} {stream}] {line}", file=sys.stderr)

    with open_session(job_file, settings, command="profile", echo=echo if args.verbose else None) as session:
        profile, paths = profile_job(
            session.runner, spec, compare=args.compare, save=args.save, world_sizes=sizes,
            headroom=args.headroom,
        )
    status, summary = summarise(profile)
    for s in profile.sizes:
        if s.step is not None and s.throughput_sps is not None:
            print(
                f"  {s.world_size} rank(s): p50 {s.step.p50_s * 1000:.1f} ms, p90 "
                f"{s.step.p90_s * 1000:.1f} ms, p99 {s.step.p99_s * 1000:.1f} ms per step, "
                f"{s.throughput_sps:.1f} {profile.unit}, startup {s.startup_s or 0:.1f} s"
                + (f" [oversubscribed: {s.oversubscribed}]" if s.oversubscribed else "")
            )
        else:
            print(f"  {s.world_size} rank(s): {s.outcome}: {s.reason}")
    for r in profile.regressions:
        print(f"  compare: {r.describe()}")
    if profile.headroom is not None:
        for pr in profile.headroom.probes:
            peak = f"{pr.peak_mb:.0f} MB" if pr.peak_mb is not None else "-"
            print(f"  headroom probe: batch {pr.batch_size}: {pr.outcome} (peak {peak}, "
                  f"{pr.duration_s:.1f} s){'' if pr.outcome == 'pass' else ': ' + pr.detail}")
        print(f"  {profile.headroom.summary()}")
    if profile.sizing is not None:
        print(f"  sizing: {profile.sizing.recommendation}")
    for note in profile.notes:
        print(f"  note: {note}")
    if profile.saved_path:
        print(f"  saved baseline: {_rel(profile.saved_path)}")
    print(f"{status.upper()}: {summary}")
    print(f"report: {_rel(paths['html'])} (also {_rel(paths['latest_html'])})")
    return 0 if status == "passed" else 1


def _rel(path: str) -> str:
    try:
        rel = os.path.relpath(path)
    except ValueError:
        return path
    return path if rel.startswith("..") else rel  # a fallback under /tmp: said as it is
