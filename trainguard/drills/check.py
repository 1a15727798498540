"""The drills as a check of the registry: ``checks.drills``, each entry run as ``drill:<name>``
(docs/drills.md), the chaos soak among them (``fault: soak``: its class plans its runs and its
pytest items, one per seed, and names its own drill runner)."""

from __future__ import annotations

from trainguard.checks.context import CheckContext
from trainguard.config import DrillSpec
from trainguard.config.faults import FaultClass, FaultNotInstalled, fault_class
from trainguard.config.problems import drill_problems, one_process_problems
from trainguard.config.registry import Check, JobFacts, Later, PlanContext, Run
from trainguard.drills.driver import run_drill
from trainguard.drills.evidence import DRILL_RECORDS
from trainguard.report import CheckResult

__all__ = ["DRILLS"]


def _runs(spec: DrillSpec, ctx: PlanContext) -> tuple[list[Run], str]:
    world_size = spec.world_size or ctx.job_file.job.world_size
    cls = _fault_class(spec)
    own = cls.drill_runs(spec, world_size, ctx.soak_seed) if cls is not None else None
    if own is not None:
        return own
    fault = (f"fault {spec.fault} on rank {spec.rank} after step {spec.after_step}, "
             f"expect {spec.expectation}")
    runs = [Run("reference", world_size, reference=True), Run("with the fault", world_size)]
    if spec.expectation in ("recover", "fail_clean"):
        runs.append(Run("resumed after the fault", world_size))
    return runs, fault


def _fault_class(spec: DrillSpec) -> FaultClass | None:
    try:
        return fault_class(spec.fault)
    except FaultNotInstalled:  # the drill reports it when it runs
        return None


def _requires(drills: list[DrillSpec], facts: JobFacts) -> list[tuple[str, str]]:
    return drill_problems(facts.job_file, facts.command_text, facts.env_text) + one_process_problems(
        facts, [(f"checks.drills[{i}].world_size", d.world_size or 1) for i, d in enumerate(drills)])


def _prepare(ctx: CheckContext[DrillSpec]) -> None:
    """The drill compares with an uninterrupted run: start it while the fault run starts up (a
    ``continue`` drill measures step rates, so nothing may run beside it)."""
    if ctx.spec.expectation != "continue":
        ctx.prefetch()


def _run(ctx: CheckContext[DrillSpec]) -> CheckResult | Later:
    """The drill driver (the public ``run_drill(runner, spec)``), driven by the context on its
    pool's runner (its supervised runs are admitted against the drill's declared runs)."""
    return ctx.drive(run_drill)


def _items(spec: DrillSpec, soak_seed: int | None) -> list[tuple[str, DrillSpec]]:
    """Most drills are one pytest item; a soak is one per seed (its class says)."""
    cls = _fault_class(spec)
    return cls.drill_items(spec, soak_seed) if cls is not None else [("", spec)]


#: the fault drills: a real fault in a small run of the job, judged against an uninterrupted run
DRILLS: Check[DrillSpec] = Check(
    "drills", DrillSpec, run=_run, runs=_runs, requires=_requires,  # type: ignore[arg-type]
    prepare=_prepare, many=True, item_prefix="drill",
    marks=lambda spec: [("fault", (spec.fault,))], items=_items, evidence=DRILL_RECORDS,
)
