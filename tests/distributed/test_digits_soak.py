"""The digits example's chaos soak (examples/digits/drills.trainguard.yaml, `chaos`), slow: three
seeds of 200 steps with 6-8 faults each (kill_rank, preempt, kill_worker, hang) must recover and
match every time, and a replay of each seed must give the same schedule, the same faults struck
and the same verdict.

It also validates the goodput model (docs/profiling.md, "Goodput forecast"): for each seed, the
model predicts the soak's wall-clock and goodput from the faults that occurred, with each kind's
restart cost measured on the *other two* seeds (leave one out) and half a checkpoint interval of
lost work per fault. ``TRAINGUARD_SOAK_TABLE=path`` writes the table (markdown) there.
"""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import report_evidence
from trainguard.config import load_config
from trainguard.drills import run_drill
from trainguard.drills.soak import forecast_for
from trainguard.report import CheckResult
from trainguard.run.runner import JobRunner

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "digits" / "drills.trainguard.yaml"
SEEDS = (1, 2, 3)


def _run(runner: JobRunner, seed: int) -> CheckResult:
    spec = next(d for d in runner.job_file.checks.drills if d.name == "chaos")
    return run_drill(runner, spec.model_copy(update={"params": {**spec.params, "seed": seed, "seeds": None}}))


def _struck(ev: dict[str, Any]) -> list[tuple[Any, ...]]:
    return [(f["kind"], f["rank"], f["step"], f["attempt"]) for f in ev["faults"]]


def leave_one_out(runs: dict[int, dict[str, Any]]) -> list[dict[str, Any]]:
    """Per seed: the model's wall-clock and goodput for its faults, each kind's restart cost the
    mean over the other seeds' faults of that kind (over all their faults for a kind they lack)."""
    rows = []
    for seed, ev in runs.items():
        others = [f for s, o in runs.items() if s != seed for f in o["faults"]
                  if f.get("fault_to_first_step_after_restart_s") is not None]
        every = [f["fault_to_first_step_after_restart_s"] for f in others]
        by_kind = {k: statistics.mean(f["fault_to_first_step_after_restart_s"] for f in others if f["kind"] == k)
                   for k in {f["kind"] for f in others}}
        m = ev["measured"]
        struck = [f["kind"] for f in ev["faults"] if f.get("attempt") is not None]
        interval = m["checkpoint_every_steps"] * m["step_s"]
        predicted = forecast_for(m["failure_free_wall_s"], [by_kind.get(k, statistics.mean(every)) for k in struck],
                                 interval)
        rows.append({"seed": seed, "faults": len(struck), "kinds": struck, "work_s": m["failure_free_wall_s"],
                     "wall_s": m["wall_s"], "predicted_wall_s": predicted["wall_s"],
                     "goodput": m["goodput"], "predicted_goodput": predicted["goodput"],
                     "wall_error": predicted["wall_s"] / m["wall_s"] - 1,
                     "goodput_error": predicted["goodput"] / m["goodput"] - 1,
                     "lost_steps": (m.get("lost_steps") or {}).get("total", 0),
                     "restart_s_by_kind": {k: round(v, 2) for k, v in sorted(by_kind.items())}})
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| seed | faults | steps lost | failure-free s | measured wall-clock s | predicted s | error "
             "| measured goodput | predicted | error |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        kinds = ", ".join(f"{r['kinds'].count(k)} {k}" for k in sorted(set(r["kinds"])))
        lines.append(f"| {r['seed']} | {r['faults']} ({kinds}) | {r['lost_steps']} | {r['work_s']:.1f} | "
                     f"{r['wall_s']:.1f} | {r['predicted_wall_s']:.1f} | {r['wall_error']:+.1%} | "
                     f"{r['goodput']:.3f} | {r['predicted_goodput']:.3f} | {r['goodput_error']:+.1%} |")
    return "\n".join(lines)


def test_the_digits_soaks_recover_replay_and_match_the_goodput_model() -> None:
    runner = JobRunner(load_config(EXAMPLE))  # one uninterrupted reference for every seed
    runs: dict[int, dict[str, Any]] = {}
    for seed in SEEDS:
        first = _run(runner, seed)
        assert first.status == "passed", first.summary
        assert len(report_evidence(first)["schedule"]) >= 5
        replay = _run(runner, seed)
        assert replay.status == first.status, replay.summary
        assert report_evidence(replay)["schedule"] == report_evidence(first)["schedule"]
        assert _struck(report_evidence(replay)) == _struck(report_evidence(first))
        runs[seed] = report_evidence(first)
        print(f"seed {seed}: {first.summary}; replay: {replay.summary}")
    rows = leave_one_out(runs)
    text = table(rows)
    print("\n" + text)
    if os.environ.get("TRAINGUARD_SOAK_TABLE"):
        out = Path(os.environ["TRAINGUARD_SOAK_TABLE"])
        out.write_text(text + "\n")
        out.with_suffix(".json").write_text(json.dumps({"rows": rows, "runs": runs}, indent=1, default=str))
    # with each soak's own restart cost per kind, the model's sum (failure-free wall-clock + each
    # fault's restart + half an interval) held within 4 % here; its restart costs from the other
    # seeds, within 15 % on a quiet machine and 47 % on a loaded one (docs/profiling.md): the
    # margins are wide, the numbers go to the docs
    for seed, ev in runs.items():
        assert abs(ev["measured"]["forecast"]["wall_error"]) < 0.15, (seed, ev["measured"])
    for r in rows:
        assert abs(r["wall_error"]) < 0.6, text
