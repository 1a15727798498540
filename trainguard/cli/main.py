"""The ``trainguard`` command.

Exit codes: 0 every check passed, 1 a check failed, 2 usage or job-file error, 130 interrupted
(SIGINT, Ctrl-C), 143 terminated (SIGTERM).
Bad input is a one-paragraph message naming the file, the key and the fix -- never a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import textwrap
from collections.abc import Callable, Iterator, Sequence
from types import FrameType
from typing import TYPE_CHECKING, Any, NoReturn

from trainguard._version import __version__
from trainguard.cli.args import SEED_HELP, dashdash_value, nonempty_path, only_names, seconds, seed
from trainguard.errors import ConfigError, TrainguardError

if TYPE_CHECKING:
    from trainguard.report import Report

__all__ = ["main"]

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130
#: SIGTERM (a CI runner cancelling the job): 128 + 15, as a shell reports a process it ended
EXIT_TERMINATED = 143


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # argparse's own exit code is 2 as well
        self.print_usage(sys.stderr)
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="trainguard",
        description="Test ML training code before it spends days of GPU time.",
        epilog="Settings also come from TRAINGUARD_* environment variables "
        "(see docs/markers-and-options.md).",
    )
    parser.add_argument("--version", action="version", version=f"trainguard {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    check = sub.add_parser(
        "check",
        help="run the checks of a job file (trainguard.yaml)",
        description="Run the checks configured in a job file and write a JSON report. "
        "Exit 0 when every check passed, 1 when one failed, 2 on a usage or job-file error.",
    )
    check.add_argument("config", metavar="CONFIG", type=nonempty_path,
                       help="job file, or a directory holding trainguard.yaml")
    check.add_argument(
        "--only",
        metavar="NAME",
        action="append",
        help="run only this check (repeatable, or comma-separated): smoke, canary, determinism, resume, parallel, "
        "reshard, profile, drills (all drills), drill:NAME (one drill)",
    )
    check.add_argument(
        "--report-json",
        metavar="PATH",
        type=nonempty_path,
        help="where to write the report (default: .trainguard/report.json next to the job file)",
    )
    check.add_argument("--seed", type=seed, metavar="N", help=SEED_HELP)
    check.add_argument(
        "--save-baseline",
        action="store_true",
        default=None,
        help="save the canary's trajectory as this machine's baseline instead of comparing it "
        "with the saved one (canary only; see docs/baselines.md)",
    )
    loudness = check.add_mutually_exclusive_group()
    loudness.add_argument("-v", "--verbose", action="store_true", help="stream every rank's output")
    loudness.add_argument("-q", "--quiet", action="store_true", help="print only the verdict lines")

    _drill_parser(
        sub, "drill", "drill", SEED_HELP,
        help="run the fault drills of a job file (checks.drills)",
        description="Inject each drill's real fault (kill_rank, hang, oom, disk_full, network) "
        "into a small run of the job and judge what follows (recover, fail_clean, continue; "
        "docs/drills.md). Exit 0 when every drill passed or was skipped, 1 when one failed, "
        "2 on a usage or job-file error.",
    )
    _drill_parser(
        sub, "soak", "soak",
        "the schedule's seed for every soak (replays a failing soak; default: each soak's "
        "params.seed / seeds, or TRAINGUARD_SOAK_SEED)",
        help="run the chaos soaks of a job file (its `fault: soak` drills)",
        description="Run the job once for each soak's steps while faults drawn from a seed "
        "(kind x rank x trigger step) strike it; trainguard restarts it after each, and every "
        "recovery must match the uninterrupted run (docs/drills.md, \"Chaos soak\"). The "
        "report holds what each fault cost (restart time, steps lost) and the goodput. Exit 0 "
        "when every soak passed or was skipped, 1 when one failed, 2 on a usage or job-file error.",
    )

    gate = sub.add_parser(
        "gate",
        help="run every configured check and decide: promote or block (the pre-submit gate)",
        description="Run every check the job file configures (smoke, canary, determinism, resume, "
        "parallel, profile, drills), decide promote or block by the `gate:` policy, and write the "
        "gate report (JSON, Markdown, HTML) to .trainguard/gate/. Exit 0 on promote, 1 on block, "
        "2 on a usage or job-file error. See docs/gate.md.",
    )
    gate.add_argument("config", metavar="CONFIG", type=nonempty_path,
                      help="job file, or a directory holding trainguard.yaml")
    gate.add_argument("--submit", action="store_true",
                      help="on promote, submit the sized job to gate.queue (ray: RAY_ADDRESS or an embedded head; slurm: sbatch)")
    gate.add_argument("--wait", type=seconds, default=30.0, metavar="S",
                      help="with --submit: seconds to follow the submitted job's status, 0 to 86400 (default: 30)")
    gate.add_argument("--seed", type=seed, metavar="N", help=SEED_HELP)
    gate_loudness = gate.add_mutually_exclusive_group()
    gate_loudness.add_argument("-v", "--verbose", action="store_true", help="stream every rank's output")
    gate_loudness.add_argument("-q", "--quiet", action="store_true",
                               help="no progress display: one line per check (CI logs)")

    submit = sub.add_parser(
        "submit",
        help="submit the job of a promoted gate report (refuses a blocked or stale one)",
        description="Submit the job a promoted gate report describes to its queue. Refuses a "
        "blocked report and a stale one (the job file, its repository's commit or dirty state, or "
        "the trainguard version changed, or it is older than gate.max_report_age). Exit 0 when "
        "submitted, 1 when refused or the queue rejected it, 2 on a usage error.",
    )
    submit.add_argument("report", metavar="REPORT", type=nonempty_path,
                        help="the gate report, e.g. .trainguard/gate/latest.json")
    submit.add_argument("--queue", choices=("ray", "slurm"), help="override gate.queue")
    submit.add_argument("--wait", type=seconds, default=30.0, metavar="S",
                        help="seconds to watch the submitted job's status, 0 to 86400 (default: 30)")

    from trainguard.cli import init as init_cli

    init_cli.add_parser(sub)

    from trainguard.cli import profile as profile_cli

    profile_cli.add_parser(sub)
    from trainguard.cli import validate as validate_cli

    validate_cli.add_parser(sub)
    from trainguard.cli import calibrate as calibrate_cli

    calibrate_cli.add_parser(sub)
    from trainguard.cli import slurm_drill as slurm_drill_cli

    slurm_drill_cli.add_parser(sub)
    sub.add_parser("version", help="print the trainguard version", description="Print the trainguard version.")
    from trainguard.faults.toxiproxy import standalone as toxiproxy_standalone

    toxiproxy_standalone.add_parser(sub)
    return parser


class _Terminated(KeyboardInterrupt):
    """SIGTERM, raised like Ctrl-C so every ``finally`` tears down the same way; exits 143."""


_received: list[int] = []  # the signals main() has received, first one first


def _raise_interrupt(signum: int, frame: FrameType | None) -> None:
    # SIGTERM (a CI runner cancelling us) gets the same clean teardown as Ctrl-C. Only the first
    # signal interrupts: a second Ctrl-C (or a runner's repeated SIGTERM) arriving while the
    # teardown runs would cut it short and leave ranks, mounts or cgroups behind
    _received.append(signum)
    if len(_received) > 1:
        with contextlib.suppress(OSError):
            os.write(2, b"trainguard: still stopping what it started (each step has a deadline)\n")
        return
    raise _Terminated if signum == signal.SIGTERM else KeyboardInterrupt


def entry() -> NoReturn:
    """The ``trainguard`` console script: :func:`main`, then a quick way out. By the time main
    returns, everything the command started is ended and written (reports atomically, ranks
    reaped, mounts, cgroups and servers stopped); the interpreter's own shutdown would then spend
    seconds freeing the modules a gate imports (torch, MLflow, matplotlib: 3.4 s with no Python
    frame on the stack after a digits gate, 2 idle cores). So the first two steps of that shutdown
    run as the interpreter runs them -- threading's (executors told to stop, threads that are not
    daemons joined), then the exit handlers (every ``atexit`` cleanup, logging's flush) --, the
    streams are flushed, and the process ends with main's code. An exception from main, or a
    Python without those two steps, takes the interpreter's usual way out."""
    import atexit
    import threading

    code = main()
    shutdown = getattr(threading, "_shutdown", None)
    exit_handlers = getattr(atexit, "_run_exitfuncs", None)
    if shutdown is None or exit_handlers is None:
        sys.exit(code)
    shutdown()
    exit_handlers()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a reader gone (`| head -1`): nothing to flush to
            stream.flush()
    os._exit(code if isinstance(code, int) and 0 <= code <= 255 else 1)


def main(argv: Sequence[str] | None = None) -> int:
    """``trainguard ARGS``: the exit code. Its stdout may close early (``| head -1``): the run
    goes on, writes its report and exits with its own result (:mod:`trainguard.cli.output`)."""
    from trainguard.cli.output import stdout_outliving_its_reader

    with stdout_outliving_its_reader():
        return _main(argv)


def _main(argv: Sequence[str] | None) -> int:
    from trainguard.cli import init as init_cli

    _escape_unencodable_output()
    parser = build_parser()
    tokens = init_cli.join_flag_values(sys.argv[1:] if argv is None else argv)
    if (refused := dashdash_value(tokens)) is not None:
        parser.error(refused)
    args = parser.parse_args(tokens)
    if args.command is None:
        parser.print_help()
        return EXIT_USAGE
    with _signals_interrupt():
        try:
            return _run_command(args, parser)
        except ConfigError as exc:
            print(f"trainguard: error: {exc}", file=sys.stderr)
            return EXIT_USAGE
        except TrainguardError as exc:
            print(f"trainguard: error: {exc}", file=sys.stderr)
            return EXIT_FAILED
        except FileNotFoundError as exc:
            print(f"trainguard: error: {exc}", file=sys.stderr)
            return EXIT_USAGE
        except OSError as exc:  # a file trainguard itself had to write (read-only, full disk, ...)
            from trainguard._internal.atomic import os_error_text

            where = f"{exc.filename}: " if exc.filename else ""
            print(f"trainguard: error: {where}{os_error_text(exc)}; free space there or make it "
                  "writable", file=sys.stderr)
            return EXIT_USAGE
        except KeyboardInterrupt as exc:
            terminated = isinstance(exc, _Terminated) or _received[:1] == [signal.SIGTERM]
            what = "terminated (SIGTERM)" if terminated else "interrupted"
            print(f"trainguard: {what}; every process it started has been stopped", file=sys.stderr)
            return EXIT_TERMINATED if terminated else EXIT_INTERRUPTED


@contextlib.contextmanager
def _signals_interrupt() -> Iterator[None]:
    """While the command runs, SIGINT and SIGTERM raise (:func:`_raise_interrupt`), so every
    ``finally`` it passes through tears down what it started; after it, the handlers it found."""
    _received.clear()
    # a signal the shell set to be ignored (`nohup`, a background job's SIGINT) stays ignored
    previous = {sig: signal.signal(sig, _raise_interrupt) for sig in (signal.SIGINT, signal.SIGTERM)
                if signal.getsignal(sig) is not signal.SIG_IGN}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            # after a signal the process is on its way out (exit handlers unmount, remove
            # cgroups): a later one is ignored, not let kill it there (Python's finalization
            # puts the default handlers back, but leaves an ignored signal ignored)
            signal.signal(sig, signal.SIG_IGN if _received else handler)


def _run_command(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Run the subcommand ``args.command`` names: its exit code."""
    # the modules that add their own subcommand: build_parser imported them already
    from trainguard.cli import calibrate as calibrate_cli
    from trainguard.cli import init as init_cli
    from trainguard.cli import profile as profile_cli
    from trainguard.cli import slurm_drill as slurm_drill_cli
    from trainguard.cli import validate as validate_cli
    from trainguard.faults.toxiproxy import standalone as toxiproxy_standalone

    if args.command == "version":
        print(f"trainguard {__version__}")
        return EXIT_OK
    commands: dict[str, Callable[[argparse.Namespace], int]] = {
        "check": _cmd_check,
        "init": init_cli.run,
        "profile": profile_cli.run,
        "calibrate": calibrate_cli.run,
        "validate": validate_cli.run,
        "drill": _cmd_drill,
        "soak": _cmd_drill,
        "gate": _cmd_gate,
        "submit": _cmd_submit,
        "slurm-drill": slurm_drill_cli.run,
        "toxiproxy-server": toxiproxy_standalone.run,
    }
    if (command := commands.get(args.command)) is None:
        parser.error(f"unknown command {args.command!r}")
        return EXIT_USAGE
    return command(args)


def _escape_unencodable_output() -> None:
    """Print what the terminal cannot encode escaped (``\\udcff``), not raise: a path may hold
    bytes that are not UTF-8 (they reach Python as lone surrogates), and under a strict locale
    (en_US.UTF-8) printing it would end the command with a UnicodeEncodeError."""
    for stream in (sys.stdout, sys.stderr):
        if getattr(stream, "errors", None) == "strict" and hasattr(stream, "reconfigure"):
            with contextlib.suppress(ValueError, OSError):  # a stream that cannot change: leave it
                stream.reconfigure(errors="backslashreplace")


def _cmd_check(args: argparse.Namespace) -> int:
    from trainguard.report import CheckResult
    from trainguard.session import check

    def echo(rank: int, stream: str, line: str) -> None:
        print(f"[rank{rank} {stream}] {line}", file=sys.stderr)

    def show(result: CheckResult) -> None:
        print(f"{result.status.upper():7} {result.name}: {result.summary} ({result.duration_s:.1f} s)")
        if not result.ok and not args.quiet:
            shown = result.evidence.to_dict()  # what the report says, key by key
            for key in ("first_divergent_step", "reason", "stderr_tail", "likely_causes", "run_dir", "plots"):
                if shown.get(key):
                    value = shown[key]
                    if isinstance(value, list):
                        value = "\n" + "\n".join(f"- {v}" for v in value)
                    print(textwrap.indent(f"{key}: {value}", "        "))
            if result.reproduce:
                print(f"        reproduce: {result.reproduce}")
        sys.stdout.flush()

    report = check(
        args.config,
        only=only_names(args.only),
        seed=args.seed,
        report_json=args.report_json,
        echo=echo if args.verbose else None,
        on_result=show,
        save_baseline=args.save_baseline,
    )
    if not report.checks:
        print("no checks configured: add a `checks:` section (see docs/config.md)")
    _print_unwritten(report)
    print(f"{report.status.upper()}: {len(report.checks)} check(s); report: {_rel(report.path)}")
    if report.tracking_uri and not args.quiet:
        from trainguard.tracking.store import ui_command

        print(f"MLflow runs: {ui_command(report.tracking_uri)}")
    return EXIT_OK if report.ok else EXIT_FAILED


def _cmd_gate(args: argparse.Namespace) -> int:
    import contextlib

    from rich.console import Console

    from trainguard.gate.run import run_gate
    from trainguard.report import CheckResult

    console = Console(highlight=False, soft_wrap=True)
    live = console.is_terminal and not args.quiet
    status = console.status("starting the gate") if live else contextlib.nullcontext()

    def echo(rank: int, stream: str, line: str) -> None:
        print(f"[rank{rank} {stream}] {line}", file=sys.stderr)

    from trainguard.errors import TrainguardError
    from trainguard.session.plan import make_plan
    from trainguard.session.session import session_settings

    with contextlib.suppress(TrainguardError, OSError):  # the gate itself says what is wrong with the file
        print(make_plan(args.config, session_settings(seed=args.seed)).cost.line(), flush=True)
    with status as spinner:

        def on_start(name: str) -> None:
            if spinner is not None:
                spinner.update(f"running {name} ...")
            elif not args.quiet:
                print(f"running {name} ...", flush=True)

        def show(result: CheckResult) -> None:
            colour = {"passed": "green", "failed": "red", "error": "red", "skipped": "yellow"}[result.status]
            console.print(f"[{colour}]{result.status.upper():7}[/] {result.name}: {result.summary} "
                          f"({result.duration_s:.1f} s)", markup=True)

        gate = run_gate(args.config, submit=args.submit, seed=args.seed, submit_wait_s=args.wait,
                        echo=echo if args.verbose else None, on_start=on_start, on_result=show)
    verdict = gate.decision.verdict.upper()
    console.print(f"[bold {'green' if gate.promoted else 'red'}]{verdict}[/]: {gate.job} "
                  f"({gate.duration_s:.0f} s)", markup=True)
    for reason in gate.decision.reasons:
        console.print(f"  - {reason}", markup=False)
    for fallback in gate.decision.fallbacks:
        console.print(f"  fallback: {fallback}", markup=False)
    if gate.submission:
        console.print(f"submission: {gate.submission.status}: {gate.submission.message}", markup=False)
    console.print(f"report: {_rel(gate.paths['html'])} (also {_rel(gate.paths['json'])}, "
                  f"{_rel(gate.paths['markdown'])})", markup=False)
    if gate.tracking_uri:
        from trainguard.tracking.store import ui_command

        console.print(f"MLflow runs: {ui_command(gate.tracking_uri)}", markup=False)
    return EXIT_OK if gate.promoted else EXIT_FAILED


def _cmd_submit(args: argparse.Namespace) -> int:
    from trainguard.gate.run import submit_report

    submission = submit_report(args.report, wait_s=args.wait, queue=args.queue)
    print(f"submission: {submission.status}: {submission.message}")
    if submission.job_id:
        print(f"job id: {submission.job_id}")
    for name, link in submission.links.items():
        print(f"{name}: {link}")
    states = submission.evidence.get("states")
    if states:  # the states a followed job went through, seconds since the follow began
        print("states: " + " -> ".join(f"{state} ({at:g} s)" for at, state, _ in states))
    if submission.note:
        print(submission.note)
    accepted = submission.job_id and submission.status not in ("unschedulable", "not_submitted", "failed")
    return EXIT_OK if accepted else EXIT_FAILED


def _drill_parser(sub: Any, command: str, what: str, seed_help: str, **texts: str) -> None:
    """The parser of ``drill`` or ``soak``: a job file, --only, --report-json, --seed, -v."""
    parser = sub.add_parser(command, **texts)
    parser.add_argument("config", metavar="CONFIG", type=nonempty_path,
                        help="job file, or a directory holding trainguard.yaml")
    parser.add_argument("--only", metavar="NAME", action="append", help=f"run only this {what} (repeatable, or comma-separated)")
    parser.add_argument("--report-json", metavar="PATH", type=nonempty_path,
                        help=f"where to write the report (default: .trainguard/{what}{'s' if what == 'drill' else ''}"
                        "-report.json next to the job file)")
    parser.add_argument("--seed", type=seed, metavar="N", help=seed_help)
    parser.add_argument("-v", "--verbose", action="store_true", help="stream every rank's output")


def _cmd_drill(args: argparse.Namespace) -> int:
    from trainguard.drills.evidence import SoakEvidence, SoakMeasured, SoakReport, SoakRuns
    from trainguard.drills.soak import soak_lines
    from trainguard.report import CheckResult
    from trainguard.session import drill, soak

    def echo(rank: int, stream: str, line: str) -> None:
        print(f"[rank{rank} {stream}] {line}", file=sys.stderr)

    def show(result: CheckResult) -> None:
        print(f"{result.status.upper():7} {result.name}: {result.summary} ({result.duration_s:.1f} s)")
        found = result.evidence
        runs = found.runs if isinstance(found, SoakRuns) else [found] if isinstance(found, SoakReport) else []
        for run in runs:  # a soak: what it measured
            if isinstance(run.found, SoakEvidence) and isinstance(run.found.measured, SoakMeasured):
                print(textwrap.indent(soak_lines(run.seed, run.found.measured), "        "))
        shown = found.to_dict()  # what the report says, key by key
        if not result.ok:
            for key in ("likely_causes", "run_dir"):
                value = shown.get(key)
                if value:
                    text = "\n" + "\n".join(f"- {v}" for v in value) if isinstance(value, list) else value
                    print(textwrap.indent(f"{key}: {text}", "        "))
            if result.reproduce:
                print(f"        reproduce: {result.reproduce}")
        sys.stdout.flush()

    run = soak if args.command == "soak" else drill
    report = run(
        args.config, only=only_names(args.only), report_json=args.report_json, seed=args.seed,
        echo=echo if args.verbose else None, on_result=show,
    )
    _print_unwritten(report)
    print(f"{report.status.upper()}: {len(report.checks)} {args.command}(s); report: {_rel(report.path)}")
    return EXIT_OK if report.ok else EXIT_FAILED


def _print_unwritten(report: Report) -> None:
    # no file took the report (its directory and every fallback failed): the result stays
    # on stdout, never lost
    if report.path is None and report.write_problem is not None:
        print(report.to_json(), end="")


def _rel(path: str | None) -> str:
    if path is None:
        return "(not written)"
    try:
        rel = os.path.relpath(path)
    except ValueError:
        return path
    return path if rel.startswith("..") else rel  # a fallback under /tmp: said as it is


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
