"""Runs each case of a hostile-file corpus in a forked process of its own with a peak-RSS cap and
a wall-time cap; prints one JSON line per case. Used by tests/unit/test_hostile_files.py.

``python tests/hostile_driver.py CORPUS MAX_RSS_MB SECONDS``: every directory of CORPUS is a
case; a child reads it as trainguard's callers do (the inventory, the comparison of the case with
itself; a ``slurm.log`` as ``trainguard slurm-drill`` follows it, a ``metrics.jsonl`` as the
launcher does, the sample records; a ``.trainguard/`` beside a ``trainguard.yaml`` as the checks,
the plan and ``submit`` read its calibrations, canary baselines and reports) and writes
``report.json`` beside it. The parent imports torch once, so a case costs a
fork, not an interpreter.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch  # noqa: F401 - imported once, before the forks

from trainguard._internal.readers import Unreadable
from trainguard.checks.baseline import (
    BaselineError,
    baseline_files,
    baselines_dir,
    find_baseline,
    load_baseline,
)
from trainguard.checks.calibration import (
    calibrations_dir,
    find_calibration,
    load_calibration,
    tolerance_for,
)
from trainguard.checks.statefiles import JobKey, StoredRequest
from trainguard.config import load_config
from trainguard.errors import TrainguardError
from trainguard.gate.run import read_gate_report
from trainguard.launch.metrics import JsonlTail
from trainguard.launch.samples import read_samples
from trainguard.queue.slurm_drill import read_attempts
from trainguard.report import load_report
from trainguard.run.request import RunRequest
from trainguard.session.plan import make_plan
from trainguard.session.session import session_settings
from trainguard.unit.checkpoints import checkpoint_inventory, compare_checkpoint_dirs

LOSS = r"step (?P<step>\d+) loss (?P<value>\S+)"


def read_logs(case: Path) -> dict[str, object]:
    """What the line readers make of the case's logs and records."""
    logs: dict[str, object] = {"samples": {r: len(b) for r, b in read_samples(case).items()}}
    if (case / "metrics.jsonl").exists():
        tail = JsonlTail(case / "metrics.jsonl", ["loss"], rank=0)
        logs["metrics"] = [len(tail.poll(0.0)), tail.unreadable]
    if (case / "slurm.log").exists():
        try:
            logs["attempts"] = [len(a.points) for a in read_attempts(case / "slurm.log", LOSS)]
        except Unreadable as exc:
            logs["attempts"] = f"unreadable: {exc}"
    return logs


def _outcome(read: Callable[[], object]) -> str:
    """What a state-file or report reader made of the case: ``used: ...`` or ``refused: ...``
    (a TrainguardError, the readers' clean refusal); any other exception escapes (a crash)."""
    try:
        return f"used: {str(read())[:300]}"
    except TrainguardError as exc:
        return f"refused: {exc}"


def read_state(case: Path) -> dict[str, object]:
    """What trainguard makes of the case's ``.trainguard/`` (next to its ``trainguard.yaml``): each
    calibration and canary baseline file, the ones the job's checks would use and the tolerance
    and canary band they would give, and the reports a plan, ``submit`` and ``load_report`` read."""
    job_file = load_config(case / "trainguard.yaml")
    state, request = job_file.state_dir, RunRequest.make(steps=4, seed=0, world_size=1)
    found, note = find_calibration(state, request, JobKey.of(job_file))
    tolerance = tolerance_for(job_file, job_file.checks.resume, request, "resume")

    def baseline() -> object:
        try:
            return find_baseline(job_file, "latest", StoredRequest.of(request))
        except BaselineError as exc:
            raise BaselineError(f"latest: {exc}") from None

    reports = [state / "report.json", state / "drills-report.json", state / "gate" / "latest.json"]
    return {
        "calibrations": {p.name: _outcome(lambda p=p: load_calibration(p).metrics)
                         for p in baseline_files(calibrations_dir(state))},
        "calibration_used": None if found is None else found.path.name, "calibration_note": note,
        "tolerance": {"bands": tolerance.bands, "within": tolerance.within(), "source": tolerance.source},
        "baselines": {p.name: _outcome(lambda p=p: load_baseline(p).trajectories)
                      for p in baseline_files(baselines_dir(state))},
        "baseline_used": _outcome(baseline),
        "plan": _outcome(lambda: make_plan(job_file, session_settings()).as_dict()),
        "gate_report": _outcome(lambda: read_gate_report(state / "gate" / "latest.json")),
        "reports": {p.name: _outcome(lambda p=p: load_report(p).status) for p in reports if os.path.lexists(p)},
    }


def run_case(case: Path, out: Path) -> int:
    report: dict[str, object] = {"logs": read_logs(case)}
    target = case / "step-10"
    ok = True
    if target.exists():
        inventory = checkpoint_inventory(target)
        comparison = compare_checkpoint_dirs(target, target)
        report.update({"inventory": inventory.as_evidence().to_dict(), "summary": inventory.summary(),
                       "comparison": comparison.as_evidence().to_dict(), "ok": comparison.ok})
        ok = comparison.ok
    if (case / "trainguard.yaml").exists():
        report["state"] = read_state(case)
    out.write_text(json.dumps(report, default=str))
    return 0 if ok else 1


def main() -> None:
    corpus, max_rss_mb, seconds = Path(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
    import resource

    base_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for case in sorted(p for p in corpus.iterdir() if p.is_dir()):
        out = corpus / f"{case.name}.report.json"
        started = time.monotonic()
        pid = os.fork()
        if pid == 0:
            code = 2
            try:
                code = run_case(case, out)
            except BaseException as exc:
                print(f"{case.name}: {type(exc).__name__}: {exc}", file=sys.stderr)
            os._exit(code)
        timed_out = False
        while True:
            done, status, usage = os.wait4(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() - started > seconds:
                os.kill(pid, signal.SIGKILL)
                timed_out = True
            time.sleep(0.02)
        grown_mb = max(0.0, (usage.ru_maxrss - base_kb) / 1024)
        print(json.dumps({"case": case.name, "exit": os.waitstatus_to_exitcode(status),
                          "seconds": round(time.monotonic() - started, 3), "timed_out": timed_out,
                          "rss_growth_mb": round(grown_mb, 1), "report": out.is_file(),
                          "over_rss": grown_mb > max_rss_mb}), flush=True)


if __name__ == "__main__":
    main()
