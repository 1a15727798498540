"""``trainguard slurm-drill RECORD``: a fault drill against a job running on a Slurm cluster.

RECORD is the submission record ``trainguard gate --submit`` / ``trainguard submit`` write
(``.trainguard/slurm/submission-<JOBID>.json``: the job id and its log). The drill waits for step
``--after-step`` in the job's log, injects the fault through Slurm (``requeue``: a preemption;
``node_down``: the job's node marked DOWN, then resumed), follows the job to its final state and
judges it like a ``recover`` drill against ``--reference``, the log of an uninterrupted run
(docs/queue.md, "Drills on a Slurm job"). Exit 0 when it passed, 1 when it failed or could not
run, 2 on a usage error.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from trainguard.cli.args import metric_regex, nonempty_path, positive_int, seconds, written_path
from trainguard.errors import ConfigError

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> None:
    drill = sub.add_parser(
        "slurm-drill",
        help="inject a fault into a job running on Slurm (requeue, node_down) and judge its recovery",
        description=__doc__.split("\n\n", 1)[1].replace("``", "`"),
    )
    drill.add_argument("record", metavar="RECORD", type=nonempty_path,
                       help="the submission record, e.g. .trainguard/slurm/submission-42.json")
    drill.add_argument("--fault", choices=("requeue", "node_down"), required=True)
    drill.add_argument("--after-step", type=positive_int(), required=True, metavar="K",
                       help="inject once the job printed this step")
    drill.add_argument("--steps", type=positive_int(), required=True, metavar="N",
                       help="the job's last step (the trajectory is compared on 1..N)")
    drill.add_argument("--reference", type=nonempty_path, required=True, metavar="LOG",
                       help="output of an uninterrupted run of the same command (its metric lines)")
    how = drill.add_mutually_exclusive_group(required=True)
    how.add_argument("--config", type=nonempty_path, metavar="CONFIG",
                     help="the job file: its job.metrics.loss (else its first metric) is read")
    how.add_argument("--metric-regex", metavar="RX", type=metric_regex,
                     help="the metric line, groups step and value")
    drill.add_argument("--max-lost-steps", type=positive_int(), metavar="M")
    drill.add_argument("--timeout", type=seconds, default=600.0, metavar="S",
                       help="the most seconds to wait for the step, then for the end (default 600)")
    drill.add_argument("--report-json", type=written_path, metavar="PATH",
                       help="write the result (status, summary, evidence) here as JSON")


def _metric(args: argparse.Namespace) -> tuple[str, str]:
    if args.metric_regex:
        return "loss", args.metric_regex
    from trainguard.config import load_config
    from trainguard.config.schema import MetricRegex

    job = load_config(args.config).job
    if not job.metrics:
        raise ConfigError("the job file has no job.metrics: give --metric-regex", path=args.config,
                          key="job.metrics")
    name = job.progress_metric
    value = job.metrics[name]
    if isinstance(value, str):
        return name, value
    if isinstance(value, MetricRegex) and value.step_group == "step":
        return name, value.regex
    raise ConfigError(f"job.metrics.{name} is not a regex over output lines with a `step` group, "
                      "which is what a Slurm log holds; give --metric-regex",
                      path=args.config, key=f"job.metrics.{name}")


def _record(path: str) -> tuple[str, str]:
    from trainguard._internal.readers import Unreadable, read_json

    try:
        data = read_json(Path(path))
    except Unreadable as exc:  # a FIFO, too large, nested too deep, not JSON
        raise ConfigError(f"unreadable: {exc}; pass the .trainguard/slurm/submission-<JOBID>.json "
                          "the gate wrote", path=path) from None
    try:
        job_id, log = str(data["job_id"]), str(data["links"]["log"])
    except (KeyError, TypeError, IndexError) as exc:
        raise ConfigError(f"not a submission record with a job id and a log ({type(exc).__name__}: "
                          f"{exc}); pass the .trainguard/slurm/submission-<JOBID>.json the gate "
                          "wrote", path=path) from None
    return job_id, log


def _reference(path: str, metric: str, regex: str) -> dict[int, float]:
    """The uninterrupted run's ``{step: value}``, its log read one bounded line at a time."""
    from trainguard._internal.readers import Unreadable, read_text_lines
    from trainguard.launch.metrics import MetricParser, trajectory

    parser = MetricParser({metric: regex})
    try:
        points = [p for line in read_text_lines(Path(path)) for p in parser.parse(line, rank=0, t=0.0)]
    except Unreadable as exc:
        raise ConfigError(f"unreadable: {exc}; give the output of an uninterrupted run of the job "
                          "(a regular file)", path=path) from None
    reference = trajectory(points, metric)
    if not reference:
        raise ConfigError(f"no `{metric}` line matching {regex!r}: give the output of an "
                          "uninterrupted run of the job", path=path)
    return reference


def run(args: argparse.Namespace) -> int:
    from trainguard.queue.slurm import SlurmBackend
    from trainguard.queue.slurm_drill import SlurmDrill, run_slurm_drill

    job_id, log = _record(args.record)
    metric, regex = _metric(args)
    reference = _reference(args.reference, metric, regex)
    if args.after_step >= args.steps:
        raise ConfigError(f"--after-step {args.after_step} must be below --steps {args.steps}")
    drill = SlurmDrill(name=f"slurm-{args.fault}", fault=args.fault, after_step=args.after_step,
                       steps=args.steps, metric_regex=regex, metric=metric,
                       max_lost_steps=args.max_lost_steps, timeout_s=args.timeout)
    backend = SlurmBackend(Path(args.record).parent)
    result = run_slurm_drill(backend, job_id, log, drill, reference)
    print(f"{result.status.upper():7} {result.name}: {result.summary} ({result.duration_s:.1f} s)")
    if args.report_json:
        Path(args.report_json).write_text(json.dumps(
            {"status": result.status, "summary": result.summary, "evidence": result.evidence.to_dict()},
            indent=2, default=str), encoding="utf-8")
    return 0 if result.status == "passed" else 1
