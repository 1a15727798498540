"""The stall attribution matrix (issue 46): fault kind x culprit rank x world size, each cell a
real launch of tests/data/jobs/stall_train.py (torch DDP on gloo) with one planted stall, through
trainguard's launcher and its stall watchdog, scored on whether the attribution names the rank.

    .venv/bin/python -m tests.benchmarks.stall_matrix [--kinds stop,sleep,...] [--worlds 2,3,4]
        [--ranks all|last|first] [--stall 2] [--out FILE.md] [--json FILE]

Per cell: the culprit named right or not, seconds from the stall's start (the culprit's last step
line: it stalls right after) to the report (the attribution done), the attribution's own seconds
after the stack dump, and the evidence it cites. A clean run (no fault) is one row per world size:
it must name no culprit (it never stalls, so the watchdog never asks).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainguard.launch import Launcher, LaunchSpec
from trainguard.launch.hook import STALL_DIR, run_hook_env

ROOT = Path(__file__).resolve().parents[2]
JOB = ROOT / "tests" / "data" / "jobs" / "stall_train.py"
KINDS = ("stop", "sleep", "busy", "gil", "loader", "skip", "other")
FAULT_STEP = 3


@dataclass(frozen=True)
class Cell:
    kind: str | None
    culprit: int | None
    world: int
    outcome: str
    named: tuple[int, ...]
    right: bool
    #: the culprit's last step line (the stall's start) to the attribution's end
    stall_to_report_s: float | None
    detected_after_s: float | None
    attribution_s: float | None
    summary: str
    evidence: str


def run_cell(kind: str | None, culprit: int, world: int, root: Path, stall: float = 2.0,
             steps: int = 8, capture: Path | None = None) -> tuple[Cell, dict[str, Any]]:
    """One launch; the scored cell and the run's attribution evidence. ``capture``: the stall's
    inputs (each rank's state, py-spy stack and answer, its Flight Recorder trimmed) saved there
    as a unit test's recorded case."""
    run_dir = root / f"{kind}-r{culprit}-w{world}"
    argv = [sys.executable, str(JOB), "--steps", str(steps), "--sleep", "0.05"]
    if kind is not None:
        argv += ["--fault", kind, "--fault-rank", str(culprit), "--fault-step", str(FAULT_STEP)]
    env = {"OMP_NUM_THREADS": "1", **run_hook_env({"stall_dir": str(run_dir / STALL_DIR)})}
    # torch's start-up and exit take seconds on a loaded machine: their own limits, as a job's
    spec = LaunchSpec(argv=argv, run_dir=run_dir, world_size=world, env=env, timeout=120, stall_timeout=stall,
                      startup_timeout=60, shutdown_timeout=60, final_step=steps,
                      metric_regexes={"loss": r"step (?P<step>\d+) loss (?P<value>\S+)"})
    launcher = Launcher(spec)
    started = time.monotonic()
    result = launcher.run()
    found: dict[str, Any] = result.evidence.get("attribution") or {}
    named = tuple(found.get("culprits") or ())
    expect = () if kind is None else (culprit,)
    last_t = max((p.t for p in result.points if p.rank == culprit), default=None)
    to_report = None
    if found and last_t is not None:
        # the attribution ended since_detection_s after the ask; the ask came detected_after_s
        # past the limit, which ran from the last line of any rank
        last_any = max(p.t for p in result.points)
        to_report = round(last_any + stall + (result.detected_after_s or 0) + found["since_ask_s"] - last_t, 2)
    del started
    if capture is not None and found:
        save_case(capture / f"{kind}-r{culprit}-w{world}.json", result.evidence, run_dir, kind, culprit)
    ranks = {f["rank"]: f for f in found.get("ranks") or []}
    cited = "; ".join(f"r{r}: " + " | ".join(f["evidence"][:2]) for r, f in sorted(ranks.items()) if r in named) or "-"
    cell = Cell(kind, culprit if kind else None, world, result.outcome, named, named == expect, to_report,
                result.detected_after_s and round(result.detected_after_s, 2), found.get("took_s"),
                found.get("summary", result.reason), cited)
    return cell, found


def _trim(answer: dict[str, Any], keep: int = 6) -> dict[str, Any]:
    """An answer with only the last ``keep`` Flight Recorder entries of each group and the fields
    the attribution reads."""
    fr = answer.get("fr")
    if isinstance(fr, dict):
        fields = ("collective_seq_id", "p2p_seq_id", "is_p2p", "pg_id", "process_group", "profiling_name",
                  "input_sizes", "retired", "state", "time_created_ns")
        entries = [{k: e.get(k) for k in fields} for e in fr.get("entries", [])]
        by_pg: dict[Any, list[Any]] = {}
        for e in entries:
            by_pg.setdefault(e["pg_id"], []).append(e)
        kept = sorted((e for es in by_pg.values() for e in es[-keep:]), key=lambda e: e["time_created_ns"])
        answer = {**answer, "fr": {"version": fr.get("version"), "pg_status": fr.get("pg_status"), "entries": kept}}
    return answer


def save_case(path: Path, evidence: dict[str, Any], run_dir: Path, kind: str | None, culprit: int) -> None:
    """One stall's recorded inputs, paths under the repository written as ``{ROOT}``."""
    answers = {}
    for file in sorted((run_dir / STALL_DIR).glob("rank*.json")):
        answers[file.stem.removeprefix("rank")] = _trim(json.loads(file.read_text()))
    case = {"fault": kind, "culprit": culprit, "activity": evidence["ranks"], "stacks": evidence["stacks"],
            "answers": answers, "expect": list(evidence["attribution"]["culprits"])}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(case, indent=1).replace(str(ROOT), "{ROOT}") + "\n")


def table(cells: list[Cell]) -> str:
    rows = ["| fault | culprit | world | outcome | named | right | stall → report (s) | attribution (s) | summary |",
            "|---|---|---|---|---|---|---|---|---|"]
    for c in cells:
        rows.append(f"| {c.kind or 'clean'} | {c.culprit if c.culprit is not None else '-'} | {c.world} | {c.outcome} | "
                    f"{', '.join(map(str, c.named)) or '-'} | {'yes' if c.right else '**no**'} | "
                    f"{c.stall_to_report_s if c.stall_to_report_s is not None else '-'} | "
                    f"{c.attribution_s if c.attribution_s is not None else '-'} | {c.summary.replace('|', '/')[:400]} |")
    right = sum(c.right for c in cells)
    rows.append(f"\n{right} of {len(cells)} cells named right.")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kinds", default=",".join(KINDS))
    p.add_argument("--worlds", default="2,3,4")
    p.add_argument("--ranks", choices=("all", "last", "first"), default="all")
    p.add_argument("--stall", type=float, default=2.0)
    p.add_argument("--clean", action="store_true", help="a clean run per world size too")
    p.add_argument("--out", default=None)
    p.add_argument("--json", default=None)
    p.add_argument("--capture", default=None, help="save each stall's inputs here (unit test cases)")
    args = p.parse_args(argv)
    cells: list[Cell] = []
    with tempfile.TemporaryDirectory(prefix="tg-stall-matrix-") as tmp:
        for world in (int(w) for w in args.worlds.split(",")):
            ranks = {"all": range(world), "last": [world - 1], "first": [0]}[args.ranks]
            if args.clean:
                cells.append(run_cell(None, 0, world, Path(tmp), args.stall)[0])
                print(table(cells[-1:]).splitlines()[2], flush=True)
            for kind in args.kinds.split(","):
                for rank in ranks:
                    cells.append(run_cell(kind, rank, world, Path(tmp), args.stall,
                                          capture=Path(args.capture) if args.capture else None)[0])
                    print(table(cells[-1:]).splitlines()[2], flush=True)
    text = table(cells)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps([c.__dict__ for c in cells], indent=1))
    return 0 if all(c.right for c in cells) else 1


if __name__ == "__main__":
    raise SystemExit(main())
