"""The drills as a check of the registry: ``checks.drills``, each entry run as ``drill:<name>``
(docs/drills.md), the chaos soak among them (``fault: soak``, one pytest item per seed)."""

from __future__ import annotations

from typing import Any

from trainguard.config import DrillSpec
from trainguard.config.problems import drill_problems, one_process_problems
from trainguard.config.registry import Check, JobFacts, PlanContext, Run
from trainguard.drills.driver import run_drill
from trainguard.faults.soak import SoakFault, soak_seeds

__all__ = ["DRILLS"]


def _runs(spec: DrillSpec, ctx: PlanContext) -> tuple[list[Run], str]:
    world_size = spec.world_size or ctx.job_file.job.world_size
    if spec.fault == "soak":
        return _soak_runs(spec, world_size, ctx.soak_seed)
    fault = (f"fault {spec.fault} on rank {spec.rank} after step {spec.after_step}, "
             f"expect {spec.expectation}")
    runs = [Run("reference", world_size, reference=True), Run("with the fault", world_size)]
    if spec.expectation in ("recover", "fail_clean"):
        runs.append(Run("resumed after the fault", world_size))
    return runs, fault


def _soak_runs(spec: DrillSpec, world_size: int, setting: int | None) -> tuple[list[Run], str]:
    """A soak: the uninterrupted run, then per seed one run with up to max_restarts restarts;
    the schedule of each seed, as it will be drawn."""
    runs, words = [Run("reference", world_size, reference=True)], []
    for seed in soak_seeds(spec.params, setting):
        events = SoakFault.schedule_of(spec.params, spec.steps, world_size, seed)
        limit = spec.max_restarts if spec.max_restarts is not None else len(events) + 2
        runs += [Run(f"seed {seed}, attempt {i}", world_size) for i in range(min(limit, len(events)) + 1)]
        shown = ", ".join(f"{e.kind} r{e.rank} @{e.step}" for e in events[:8])
        words.append(f"seed {seed}: {len(events)} faults ({shown}{', ...' if len(events) > 8 else ''})")
    return runs, "chaos soak, expect recover every time; " + "; ".join(words)


def _requires(drills: list[DrillSpec], facts: JobFacts) -> list[tuple[str, str]]:
    return drill_problems(facts.job_file, facts.command_text, facts.env_text) + one_process_problems(
        facts, [(f"checks.drills[{i}].world_size", d.world_size or 1) for i, d in enumerate(drills)])


def _prepare(runner: Any, spec: DrillSpec) -> None:
    """The drill compares with an uninterrupted run: start it while the fault run starts up (a
    ``continue`` drill measures step rates, so nothing may run beside it)."""
    if spec.expectation != "continue":
        world_size = spec.world_size or runner.job_file.job.world_size
        runner.prefetch(runner.request_for(spec, world_size=world_size))


def _items(spec: DrillSpec, soak_seed: int | None) -> list[tuple[str, DrillSpec]]:
    """A soak is one pytest item per seed (a replay is one test); any other drill is one."""
    if spec.fault != "soak":
        return [("", spec)]
    return [(f"[seed={seed}]", spec.model_copy(update={"params": {**spec.params, "seed": seed, "seeds": None}}))
            for seed in soak_seeds(spec.params, soak_seed)]


#: the fault drills: a real fault in a small run of the job, judged against an uninterrupted run
DRILLS: Check[DrillSpec] = Check(
    "drills", DrillSpec, run=run_drill, runs=_runs, requires=_requires,  # type: ignore[arg-type]
    prepare=_prepare, many=True, item_prefix="drill",
    marks=lambda spec: [("fault", (spec.fault,))], items=_items,
)
