"""Runs each case of a hostile-file corpus in a forked process of its own with a peak-RSS cap and
a wall-time cap; prints one JSON line per case. Used by tests/unit/test_hostile_files.py.

``python tests/hostile_driver.py CORPUS MAX_RSS_MB SECONDS``: every directory of CORPUS is a
case; a child reads it as trainguard's callers do (the inventory, the comparison of the case with
itself; a ``slurm.log`` as ``trainguard slurm-drill`` follows it, a ``metrics.jsonl`` as the
launcher does, the sample records) and writes ``report.json`` beside it. The parent imports torch once, so a case costs a
fork, not an interpreter.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import torch  # noqa: F401 - imported once, before the forks

from trainguard._internal.readers import Unreadable
from trainguard.launch.metrics import JsonlTail
from trainguard.launch.samples import read_samples
from trainguard.queue.slurm_drill import read_attempts
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


def run_case(case: Path, out: Path) -> int:
    target = case / "step-10"
    inventory = checkpoint_inventory(target)
    comparison = compare_checkpoint_dirs(target, target)
    report = {"inventory": inventory.as_evidence(), "summary": inventory.summary(),
              "comparison": comparison.as_evidence(), "ok": comparison.ok, "logs": read_logs(case)}
    out.write_text(json.dumps(report))
    return 0 if comparison.ok else 1


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
