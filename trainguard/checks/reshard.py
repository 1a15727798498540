"""Elastic resume (``checks.reshard``): checkpoint at N ranks, resume at M, train like N ranks.

For each ``[N, M]`` pair: the uninterrupted N-rank run (shared with other checks of the same
request); an N-rank run SIGKILLed right after ``after_step``; M ranks resumed from its checkpoint
with ``resume_args``. The resumed steps must match the N-rank run within ``rtol``/``atol`` (the
parallel check's tolerances: N ranks and M ranks differ by float rounding). The job keeps the
global batch fixed itself: ``{batch_size}`` is the global batch at every world size.

A failure names the first divergent step, the state component that differs in the final
checkpoints (:func:`trainguard.unit.checkpoints.compare_checkpoint_dirs`), whether the resumed
ranks together drew the same samples per step as the reference ranks (the sample records,
:func:`trainguard.launch.samples.read_samples`), and the likely causes, most likely first.
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainguard.checks.accounting import (
    AccountingEvidence,
    SampleAccounting,
    SampleAgreement,
    Segment,
    account_samples,
    global_batches,
    sample_agreement,
    training_batches,
)
from trainguard.checks.calibration import ToleranceEvidence, tolerance_for
from trainguard.checks.context import CheckContext
from trainguard.checks.diagnosis import (
    DECISIVE,
    NONE,
    RULED_OUT,
    STRONG,
    SUGGESTIVE,
    Cause,
    CauseEvidence,
    read_inventory,
)
from trainguard.checks.divergence import DivergenceEvidence, ObservedCause
from trainguard.checks.divergence_noisy import (
    WORLD_SIZE_CAUSES,
    observe_noisy,
    observed_world_size_causes,
)
from trainguard.checks.equivalence import TrajectoryDiff, compare_trajectories
from trainguard.checks.equivalence_records import TrajectoryEvidence
from trainguard.checks.interruption import InterruptionEvidence, interrupt
from trainguard.checks.resume_judge import where_resumed
from trainguard.config import ReshardCheck
from trainguard.config.problems import one_process_problems
from trainguard.config.registry import Check, JobFacts, Resumes, Run
from trainguard.evidence import MERGED, UNSET, Evidence, Unset
from trainguard.launch.samples import read_samples
from trainguard.report import CheckResult, CheckStatus
from trainguard.unit.checkpoints import (
    CheckpointInventory,
    compare_checkpoint_dirs,
    latest_complete_checkpoint,
)
from trainguard.unit.checkpoints.compare import StateEvidence

__all__ = ["RESHARD", "RESHARD_CAUSES", "PairFacts", "ReshardEvidence", "ReshardPair", "ReshardPairEvidence", "rank_reshard_causes", "run_reshard"]

#: the causes a failed pair is ranked among (key -> text), in the order ties keep
RESHARD_CAUSES = {
    "optimizer_shard": "optimizer state sharded (ZeroRedundancyOptimizer, FSDP) and not resharded: "
    "the checkpoint holds only some ranks' shards, or each rank loads the shard it had at the old size",
    "sampler_offset": "a sampler offset counted per rank but saved as a global one (or the reverse): "
    "the resumed ranks re-read or skip samples",
    "data_order": "a data order that depends on the world size (each rank shuffles its own shard, a "
    "permutation seeded with the rank, or a shard split that changes with the ranks)",
    "batch": "the per-rank batch is not the global batch / world size at the new size",
    "uneven": "a world size that does not divide the data: the sampler pads the ranks' shares with "
    "samples they train again (DistributedSampler without drop_last), or leaves some out",
    "rng": "RNG states saved per rank cannot be restored at another world size (dropout, "
    "augmentation: pass args that disable them for this check)",
}

#: components of the final checkpoints whose difference fails a pair; the rest (RNG states per
#: rank, the world size the job records) may differ between world sizes and are only reported
TRAINING_STATE = ("model", "optimizer", "scheduler", "ema", "scaler")


# -- causes ---------------------------------------------------------------------------------------


@dataclass
class PairFacts:
    """What one failed pair left: where it resumed and parted, the samples, the checkpoint."""

    resumed_from: int
    first_divergent_step: int | None
    samples: SampleAgreement | None
    inventory: CheckpointInventory | None
    differing: list[str] = field(default_factory=list)
    rng_warning: bool = False
    accounting: SampleAccounting | None = None
    #: the causes the step records show (:func:`observed_world_size_causes`): first, decisive
    observed: list[ObservedCause] = field(default_factory=list)


def _shard_coverage(inventory: CheckpointInventory | None) -> tuple[int, int] | None:
    """(parameters with optimizer state, model tensors) when the checkpoint says both."""
    if inventory is None:
        return None
    params, tensors = inventory.parameters_with_state(), inventory.tensors("model")
    return (params, tensors) if params and tensors else None


def rank_reshard_causes(facts: PairFacts) -> list[Cause]:
    """The causes of :data:`RESHARD_CAUSES` by the strength of what the runs left, most likely
    first, those the evidence rules out last."""
    strength: dict[str, int] = {}
    evidence: dict[str, list[str]] = {}

    def add(key: str, points: int, why: str) -> None:
        strength[key] = points if points == RULED_OUT else max(strength.get(key, NONE), points)
        evidence.setdefault(key, []).append(why)

    accounting = facts.accounting
    # samples trained twice and none left out: padding of shares that do not divide evenly
    padded = accounting is not None and accounting.known and not accounting.ok \
        and all(e.twice and not e.never for e in accounting.epochs)
    agreement = facts.samples
    if agreement is not None:
        if agreement.same:
            why = f"the resumed ranks drew the reference's samples on all {agreement.compared_steps} steps"
            for key in ("sampler_offset", "data_order", "batch"):
                add(key, RULED_OUT, why)
        elif agreement.resumed_size != agreement.reference_size:
            # padded shares also make a step larger: the batch split itself is then not the cause
            add("uneven" if padded else "batch", DECISIVE, f"step {agreement.first_different_step}: "
                f"{agreement.resumed_size} samples across the resumed ranks vs {agreement.reference_size}")
        elif agreement.matched_step is not None:
            add("sampler_offset", DECISIVE, f"resumed step {agreement.first_different_step} drew the samples "
                f"of the reference's step {agreement.matched_step}")
        else:
            add("data_order", STRONG, f"resumed step {agreement.first_different_step} drew samples no "
                "reference step drew together")
    if accounting is not None and accounting.known and not accounting.ok:
        add("uneven" if padded else "sampler_offset", STRONG, accounting.summary())
    coverage = _shard_coverage(facts.inventory)
    if coverage is not None and coverage[0] < coverage[1]:
        add("optimizer_shard", DECISIVE, f"the checkpoint the resumed run loaded holds optimizer state "
            f"for {coverage[0]} of its {coverage[1]} model tensors")
    elif coverage is not None:
        add("optimizer_shard", NONE, f"the checkpoint holds optimizer state for all {coverage[1]} parameters")
    boundary = facts.first_divergent_step is not None and facts.first_divergent_step == facts.resumed_from + 1
    if boundary and (agreement is None or agreement.same):
        samples = " with the same samples" if agreement is not None else ""
        add("optimizer_shard", SUGGESTIVE, f"the trajectory parts at the first resumed step "
            f"({facts.first_divergent_step}){samples}: state restored at the boundary differs")
    if facts.rng_warning:
        add("rng", STRONG, "the resumed run's stderr says RNG states were not restored")
    texts = {**RESHARD_CAUSES, **{c.key: WORLD_SIZE_CAUSES[c.key] for c in facts.observed}}
    seen = [c.key for c in facts.observed]
    for cause in facts.observed:  # what the step records show: decisive, its observation first
        strength[cause.key] = DECISIVE
        evidence.setdefault(cause.key, []).insert(0, cause.observation)
    order = list(texts)
    causes = [Cause(k, texts[k], strength.get(k, NONE), tuple(evidence.get(k, ())), k in seen) for k in order]
    return sorted(causes, key=lambda c: (seen.index(c.key) if c.key in seen else len(seen), -c.strength,
                                         order.index(c.key)))


def _rng_warning(run_dir: Path, world_size: int) -> bool:
    pattern = re.compile(r"rng.?states?.*not (?:be )?restored|not restor\w* .*rng", re.I)
    for rank in range(world_size):
        try:
            text = (run_dir / f"rank{rank}.stderr.log").read_text(errors="replace")[-200_000:]
        except OSError:
            continue
        if pattern.search(text):
            return True
    return False


# -- the check ------------------------------------------------------------------------------------


@dataclass
class ReshardPairEvidence(Evidence):
    """One ``N->M`` pair of the reshard check: killed at N ranks, resumed at M."""

    killed_after_step: int | Unset | None = UNSET
    #: how the N-rank checkpoint was made (:meth:`~trainguard.checks.interruption.Interruption.as_evidence`)
    interruption: InterruptionEvidence | Unset = UNSET
    #: reference, killed (or kept_from: the run its checkpoint was kept from), resumed
    run_dirs: dict[str, str] | Unset = UNSET
    #: what the resumed run was given to load
    resumed_checkpoint: Any = UNSET
    stderr_tail: str | Unset = UNSET
    reason: str | Unset = UNSET
    #: the uninterrupted run's, when it did not complete
    run_dir: str | Unset = UNSET
    resumed_from_step: int | Unset = UNSET
    trajectory: TrajectoryEvidence | Unset = UNSET
    #: :meth:`~trainguard.checks.calibration.ToleranceUsed.as_evidence` (the N-rank run's calibration)
    tolerance: ToleranceEvidence | Unset = UNSET
    state: StateEvidence | Unset = UNSET
    #: state that may differ between world sizes (per-rank RNG, the world size itself)
    state_differing_across_world_sizes: list[str] | Unset = UNSET
    samples: str | Unset = UNSET
    #: :meth:`SampleAccounting.as_evidence`: samples trained twice or never, per epoch
    sample_accounting: AccountingEvidence | Unset = UNSET
    #: where the resumed run's step records first part from the uninterrupted run's (whole runs,
    #: sums of squares within the calibrated spread or a default tolerance)
    first_divergence: DivergenceEvidence | Unset = UNSET
    diagnosis: list[CauseEvidence] | Unset = UNSET
    likely_causes: list[str] | Unset = UNSET


@dataclass
class ReshardPair(Evidence):
    """One pair in the reshard check's report: its verdict, then its evidence's keys."""

    status: str
    summary: str
    evidence: ReshardPairEvidence = field(default_factory=ReshardPairEvidence, metadata=MERGED)


@dataclass
class ReshardEvidence(Evidence):
    """The reshard check's evidence (docs/reshard.md)."""

    after_step: int
    steps: int
    tolerance: dict[str, float]
    #: ``"N->M"`` -> its status, summary and :class:`ReshardPairEvidence`
    pairs: dict[str, ReshardPair]
    likely_causes: list[str] | Unset = UNSET


@dataclass
class _Pair:
    n: int
    m: int
    status: CheckStatus  # passed, failed, error
    summary: str
    evidence: ReshardPairEvidence
    reproduce: str = ""


def _one_pair(ctx: CheckContext[ReshardCheck], n: int, m: int) -> _Pair:
    spec, metric, name = ctx.spec, ctx.metric, f"{n}->{m}"
    old, new = ctx.declared(_uninterrupted(n)).request, ctx.declared(_resumed(spec, n, m)).request
    reproduce = (f"{ctx.command_line(old)}  # kill -9 after step {spec.after_step}, then at {m} "
                 f"rank(s): {ctx.command_line(new, resume=True)}")
    try:  # its uninterrupted run may have kept the checkpoint (the context asked for it)
        reference = ctx.reference(_uninterrupted(n))
        cut = (interrupt(ctx.pool, old, spec.after_step, metric, label=f"reshard-{n}to{m}-killed",
                         what=f"the {n}-rank run") if reference.ok else None)
    except BaseException:
        ctx.stop_background("the reshard check was interrupted")
        raise
    if cut is None:
        return _Pair(n, m, "error", f"{name}: the uninterrupted {n}-rank run did not complete: {reference.reason}",
                     ReshardPairEvidence(stderr_tail=reference.stderr_tail, run_dir=str(reference.run_dir)),
                     reproduce)
    if cut.error is not None:
        return _Pair(n, m, "error", f"{name}: {cut.error}",
                     ReshardPairEvidence(stderr_tail=cut.killed.stderr_tail if cut.killed else UNSET,
                                         killed_after_step=cut.step), reproduce)
    latest = latest_complete_checkpoint(cut.checkpoint_dir)
    inventory = read_inventory(latest if latest is not None else cut.checkpoint_dir)
    resumed = ctx.resume(cut, _resumed(spec, n, m), label=f"reshard-{n}to{m}-resumed")
    evidence = ReshardPairEvidence(
        killed_after_step=cut.step, interruption=cut.as_evidence(),
        run_dirs={"reference": str(reference.run_dir), ("killed" if cut.kept is None else "kept_from"): str(cut.run_dir),
                  "resumed": str(resumed.run_dir)},
    )
    if inventory is not None:
        evidence.resumed_checkpoint = inventory.summary()
    if not resumed.ok:
        evidence.stderr_tail, evidence.reason = resumed.stderr_tail, resumed.reason
        return _Pair(n, m, "failed", f"{name}: the job did not resume at {m} rank(s) from the {n}-rank "
                     f"checkpoint: {resumed.reason}", evidence, reproduce)
    # plain means per step: the ranks differ in number, so none of them is "missing" a step
    actual, expected = resumed.trajectory(metric), reference.trajectory(metric)
    if not actual:
        return _Pair(n, m, "failed", f"{name}: the resumed run printed no `{metric}` line", evidence, reproduce)
    first_step = min(actual)
    _, resumed_from = where_resumed(first_step, expected)
    evidence.resumed_from_step = resumed_from
    tol = tolerance_for(ctx.job_file, spec, old, "reshard")
    diff = compare_trajectories(actual, expected, metric=metric, steps=range(first_step, spec.steps + 1),
                                rtol=spec.rtol, atol=spec.atol, band=tol.band(metric))
    evidence.trajectory, evidence.tolerance = diff.as_evidence(), tol.as_evidence()
    state = compare_checkpoint_dirs(resumed.checkpoints,
                                    reference.checkpoints, rtol=spec.rtol, atol=spec.atol)
    evidence.state = state.as_evidence()
    differing = [c for c in TRAINING_STATE if state.by_component.get(c)] if tol.exact_state else []
    others = [c for c in state.by_component if c not in TRAINING_STATE]
    if others:
        evidence.state_differing_across_world_sizes = others  # expected: per-rank RNG, world size
    agreement, accounting = _pair_samples((reference.run_dir, cut.run_dir, resumed.run_dir), spec.steps,
                                          first_step, resumed_from, n, m)
    if agreement is not None:
        evidence.samples = agreement.sentence(n, m)
    evidence.sample_accounting = accounting.as_evidence()
    problems = _pair_problems(spec, metric, n, m, first_step, resumed_from, diff)
    if differing:
        problems.append("final checkpoints differ in " + ", ".join(
            f"{c} ({len(state.by_component[c])} keys)" for c in differing))
    elif uncompared := state.uncompared_problem("checks.reshard", spec.allow_uncompared):
        problems.append(uncompared)
    if not problems:
        note = f"; {evidence.samples}" if agreement is not None else " (no sample records)"
        return _Pair(n, m, "passed", f"{name}: {cut.words()}, resumed from step {resumed_from}, steps {first_step}-"
                     f"{spec.steps} match the {n}-rank run (max abs diff {diff.max_abs_diff:.3g}){note}",
                     evidence, reproduce)
    facts = PairFacts(resumed_from, diff.first_divergent_step, agreement, inventory, differing,
                       _rng_warning(resumed.run_dir, m), accounting)
    if resumed_from > 0:  # the step records, compared as whole runs from the step resumed at
        runs = observe_noisy(ctx.recorded(reference).run_dir, resumed.run_dir, tolerance=tol.ss_tolerance(),
                             printed=resumed_from + 1, last_printed=spec.steps)
        if runs is not None:
            evidence.first_divergence = runs.evidence(f"the run resumed at {m} rank(s)")
            facts.observed = observed_world_size_causes(runs, 1, f"the run resumed at {m} rank(s)")
    return _Pair(n, m, "failed", _diagnosed(facts, problems, n, m, evidence), evidence, reproduce)


def _diagnosed(facts: PairFacts, problems: list[str], n: int, m: int, evidence: ReshardPairEvidence) -> str:
    """A failed pair's summary: its problems, what the samples say and the most likely cause;
    the causes, ranked, go into ``evidence``."""
    causes = rank_reshard_causes(facts)
    evidence.diagnosis = [c.as_evidence() for c in causes]
    evidence.likely_causes = [c.text for c in causes if not c.ruled_out]
    summary = f"{n}->{m}: " + "; ".join(problems)
    if facts.samples is not None:
        summary += f"; {facts.samples.sentence(n, m)}"
    accounting = facts.accounting
    if accounting is not None and accounting.known and not accounting.ok:
        summary += f"; {accounting.summary()}"
    top = next((c for c in causes if c.strength > NONE), None)
    if top is not None:
        summary += f". Most likely {top.text.split(':')[0].split(' (')[0]}: {'; '.join(top.evidence[:2])}"
    return summary


def _pair_samples(run_dirs: tuple[Path, Path, Path], steps: int, first_step: int,
                  resumed_from: int, n: int, m: int) -> tuple[SampleAgreement | None, SampleAccounting]:
    """Whether the ``m`` resumed ranks together drew the samples the ``n`` reference ranks drew
    per step, and which samples the killed and the resumed run trained twice or never
    (``run_dirs``: the reference's, the killed run's and the resumed run's)."""
    reference_dir, killed_dir, resumed_dir = run_dirs
    ref_samples = read_samples(reference_dir)
    res_samples = read_samples(resumed_dir)
    drawn = training_batches(next(iter(ref_samples.values()), []), None)
    dataset = drawn[0].dataset if drawn else None
    agreement = sample_agreement(
        global_batches(ref_samples, first_step=1, steps=steps, dataset=dataset),
        global_batches(res_samples, first_step=first_step, steps=steps, dataset=dataset),
    )
    accounting = account_samples(ref_samples, [
        Segment(read_samples(killed_dir), 1, resumed_from, f"at {n} rank(s)"),
        Segment(res_samples, resumed_from + 1, steps, f"after the resume at {m} rank(s)"),
    ], steps=steps)
    return agreement, accounting


def _pair_problems(spec: ReshardCheck, metric: str, n: int, m: int, first_step: int, resumed_from: int,
                   diff: TrajectoryDiff) -> list[str]:
    """What the resume at ``m`` ranks lost of the ``n``-rank run: its progress (it began again),
    or where its trajectory parts from the uninterrupted one's."""
    problems: list[str] = []
    if resumed_from == 0:
        problems.append(f"the resumed run started again from step {first_step} (no usable checkpoint, or resume_args "
                        "does not make it load one)")
    if diff.first_divergent_step is not None:
        a, b = diff.first_values or (math.nan, math.nan)
        problems.append(f"{metric} diverges from the uninterrupted {n}-rank run at step "
                        f"{diff.first_divergent_step} (resumed at {m}: {a!r} vs {b!r}; max abs diff "
                        f"{diff.max_abs_diff:.3g}, rtol {spec.rtol:g} atol {spec.atol:g})")
    elif diff.missing_in_actual:
        problems.append(f"the resumed run {diff.missing_words()}")
    return problems


def run_reshard(ctx: CheckContext[ReshardCheck]) -> CheckResult:
    """Each ``[N, M]`` of ``spec.pairs``: checkpoint at N ranks, resume at M, compare with the
    uninterrupted N-rank run. Passes when every pair does."""
    started = time.monotonic()
    spec = ctx.spec
    for n, m in spec.world_size_pairs:  # resumes from checkpoints kept already start up side by side
        kept, _ = ctx.pool.kept(ctx.declared(_uninterrupted(n)).request, spec.after_step)
        if kept is not None:
            ctx.pool.start_resume_kept(kept, ctx.declared(_resumed(spec, n, m)).request,
                                       label=f"reshard-{n}to{m}-resumed")
    pairs = [_one_pair(ctx, n, m) for n, m in spec.world_size_pairs]
    evidence = ReshardEvidence(
        after_step=spec.after_step, steps=spec.steps, tolerance={"rtol": spec.rtol, "atol": spec.atol},
        pairs={f"{p.n}->{p.m}": ReshardPair(p.status, p.summary, p.evidence) for p in pairs},
    )
    bad = [p for p in pairs if p.status != "passed"]
    status: CheckStatus = "passed" if not bad else ("error" if all(p.status == "error" for p in bad) else "failed")
    if not bad:
        summary = "; ".join(p.summary for p in pairs)
    else:
        summary = "; ".join(p.summary for p in bad)
        ok = [f"{p.n}->{p.m}" for p in pairs if p.status == "passed"]
        if ok:
            summary += f" ({', '.join(ok)} passed)"
        first = next(p for p in bad if p.status == bad[0].status)
        found = first.evidence.likely_causes
        evidence.likely_causes = found if found is not UNSET else []
    reproduce = (bad[0] if bad else pairs[0]).reproduce
    return CheckResult("reshard", status, summary, evidence, time.monotonic() - started, reproduce)


def _uninterrupted(n: int) -> str:
    return f"{n} rank(s), uninterrupted"


def _resumed(spec: ReshardCheck, n: int, m: int) -> str:
    return f"{m} rank(s), resumed from the checkpoint kept after step {spec.after_step} of the {n}-rank run"


def _reshard_runs(spec: ReshardCheck, ctx: object) -> tuple[list[Run], str]:
    runs = []
    for n, m in spec.world_size_pairs:
        runs += [Run(_uninterrupted(n), n, reference=True),
                 Run(_resumed(spec, n, m), m, resumes=Resumes(spec.after_step, n))]
    return runs, ("each resume at another world size must train like the uninterrupted run (a checkpoint that "
                  "cannot be kept from it: one more run, killed)")


def _reshard_requires(spec: ReshardCheck, facts: JobFacts) -> list[tuple[str, str]]:
    job = facts.job_file.job
    problems = []
    if not job.resume_args:
        problems.append(("job.resume_args", "checks.reshard resumes the job at another world size. "
                         'Fix: set job.resume_args to the flags that make the script resume, e.g. "--resume"'))
    if not facts.checkpoints:
        problems.append(("job.command", "checks.reshard needs the job to write checkpoints where "
                         "trainguard can find them. Fix: pass {checkpoint_dir} to the script, e.g. "
                         "`--ckpt-dir {checkpoint_dir}` in job.command"))
    if "batch_size" in facts.used and job.batch_size is not None:
        sizes = sorted({w for pair in spec.world_size_pairs for w in pair})
        uneven = [w for w in sizes if job.batch_size % w]
        if uneven:
            lcm = math.lcm(*sizes)
            problems.append(("checks.reshard.pairs", f"{{batch_size}} is the global batch "
                             f"(job.batch_size {job.batch_size}) at every world size, split over the ranks, "
                             f"but {', '.join(map(str, uneven))} rank(s) cannot split it evenly. Fix: a "
                             f"job.batch_size that is a multiple of {lcm}, or pairs of sizes that divide it"))
    return problems + one_process_problems(
        facts, [("checks.reshard.pairs", max(max(p) for p in spec.world_size_pairs))])


#: reshard: a resume at another world size must train like the uninterrupted run
#: (docs/equivalence.md); the gate requires it only where gate.require names it
RESHARD: Check[ReshardCheck] = Check(
    "reshard", ReshardCheck, run=run_reshard, runs=_reshard_runs, requires=_reshard_requires,
    gate_default=False,
    calibrates=lambda spec: sorted({n for n, _ in spec.world_size_pairs}),
    evidence=(ReshardEvidence,),
)
