"""The first divergence of two runs that are not bitwise reproducible: N ranks against 1
(``parallel``), a resume at another world size (``reshard``), base's checkpoint resumed by the
current code (``compat``), a calibrated noisy job's resume.

Such runs never agree bit for bit, so their step records are compared as whole runs
(:func:`~trainguard.checks.step_compare.whole_run`: per parameter, the sum of squares of its
local shards summed across ranks, or one rank's where every rank holds it whole), the sums of
squares within an :class:`~trainguard.checks.step_compare.SsTolerance` (a default relative
tolerance, or the calibrated same-seed spread per tensor and step), the learning rate, the other
hyperparameters, the loss scaler and the RNG states exactly. The result is a
:class:`~trainguard.checks.divergence.Divergence` like the exact comparison's, with the table of
the first difference at each step around it, so the observed causes of a resume
(:func:`~trainguard.checks.divergence.observed_resume_causes`) read it alike; the causes a change
of world size shows are :func:`observed_world_size_causes`.

The records only add the diagnosis of a failed check: a check never passes or fails by them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from trainguard.checks.divergence import (
    Agreement,
    Difference,
    Divergence,
    DivergenceEvidence,
    NoComparison,
    ObservedCause,
    observed_resume_causes,
    placed,
)
from trainguard.checks.step_compare import (
    SsTolerance,
    StepRow,
    compared_steps,
    rows_around,
    whole_run,
)
from trainguard.launch.steps import StepRecords, read_steps

__all__ = [
    "WORLD_SIZE_CAUSES",
    "NoisyRuns",
    "noisy_divergence",
    "observe_noisy",
    "observe_noisy_resume",
    "observed_world_size_causes",
]

#: the causes a change of world size shows in the step records (key -> text)
WORLD_SIZE_CAUSES = {
    "schedule": "a learning rate or schedule that depends on the world size (an lr scaled by the number of "
    "ranks, a schedule counting steps per epoch from the rank's share of the data)",
    "summed": "gradients summed instead of averaged across ranks (all_reduce without dividing by world size)",
    "initial_weights": "the initial weights differ between the world sizes (a seed that depends on the rank "
    "or the world size, or weights not broadcast from rank 0)",
    "optimizer_shard": "optimizer state sharded (ZeroRedundancyOptimizer, FSDP) and not resharded: the "
    "checkpoint holds only some ranks' shards, or each rank loads the shard it had at the old size",
}


def noisy_divergence(reference: StepRecords, other: StepRecords, *, tolerance: SsTolerance, offset: int = 0,
                     shift: int = 0) -> Divergence | Agreement | NoComparison:
    """Where ``other`` (its step n the reference's n + ``offset``) first parts from ``reference``,
    both read as whole runs; steps named as the reference's optimizer steps moved by ``shift``."""
    if not reference.has_steps or not other.has_steps:
        which = "the reference" if not reference.has_steps else "the other run"
        return NoComparison(f"{which} left no step records (the run agent off, or a rank that is not a Python process)")
    compared = compared_steps(reference, other, offset=offset, tolerance=tolerance)
    if not compared:
        return NoComparison(f"no optimizer step recorded by every rank of both runs in common, with the other run's "
                            f"step n taken as the reference's n + {offset}")
    rng: tuple[int, list[StepRow]] | None = None
    for i, (step, found) in enumerate(compared):
        rng = rng or ((step, [r for r in found if r.kind == "rng"]) if any(r.kind == "rng" for r in found) else None)
        if any(r.kind != "rng" for r in found):
            return _divergence(compared, found, i + 1, offset, shift, rng[0] if rng else None)
    if rng is not None:  # nothing but the RNG ever differed
        return _divergence(compared, rng[1], [s for s, _ in compared].index(rng[0]) + 1, offset, shift, rng[0])
    notes = (*reference.notes(), *other.notes())
    return Agreement(len(compared), compared[0][0] + shift, compared[-1][0] + shift, False, notes)


def _divergence(compared: list[tuple[int, list[StepRow]]], found: list[StepRow], count: int, offset: int, shift: int,
                rng_since: int | None) -> Divergence:
    at = tuple(Difference(r.step + shift, r.rank, 0, r.kind, r.name, r.reference, r.other) for r in found)
    return Divergence(at, count, offset + shift, None if rng_since is None else rng_since + shift, False,
                      tuple(rows_around(compared, found[0].step, shift=shift)))


@dataclass(frozen=True)
class NoisyRuns:
    """Two runs' step records compared as whole runs (:func:`observe_noisy`)."""

    divergence: Divergence | Agreement | NoComparison
    reference: StepRecords
    other: StepRecords
    tolerance: SsTolerance
    #: the other run's step n is the reference's n + offset (optimizer steps)
    offset: int = 0
    shift: int = 0

    def evidence(self, other: str = "the other run") -> DivergenceEvidence:
        """The report's ``first_divergence``, saying how the sums of squares were compared."""
        out = self.divergence.as_evidence(other)
        out.compared_by = self.tolerance.words()
        return out

    def gradient_ratio(self, d: Difference) -> float | None:
        """The other run's sum of squares of ``d``'s tensor over the reference's, at ``d``'s step."""
        kind = {"gradient": "grad", "parameter": "param", "optimizer state": "optim"}.get(d.kind)
        step = d.step - self.shift
        ours, theirs = whole_run(self.reference).get(step), whole_run(self.other).get(step - self.offset)
        if kind is None or ours is None or theirs is None:
            return None
        a, b = getattr(ours, kind).get(d.name), getattr(theirs, kind).get(d.name)
        return b.ss / a.ss if a is not None and b is not None and a.ss > 0 else None


def observe_noisy(reference_dir: Path, other_dir: Path, *, tolerance: SsTolerance, printed: int | None = None,
                  counted_from: int = 1, last_printed: int | None = None) -> NoisyRuns | None:
    """The first divergence of the run in ``other_dir`` from the one in ``reference_dir`` as whole
    runs; ``printed``: the printed step the other run resumed at (None: both from the start), of
    the reference's printed steps ``counted_from``..``last_printed``. None when neither recorded a
    step (nothing to say: the agent off, a job without torch)."""
    reference, other = read_steps(reference_dir), read_steps(other_dir)
    if not reference.has_steps and not other.has_steps:
        return None
    offset, shift = placed(reference, printed=printed, counted_from=counted_from, last_printed=last_printed)
    if isinstance(offset, NoComparison):
        return NoisyRuns(offset, reference, other, tolerance)
    found = noisy_divergence(reference, other, tolerance=tolerance, offset=offset, shift=shift)
    return NoisyRuns(found, reference, other, tolerance, offset, shift)


def observe_noisy_resume(reference_dir: Path, resumed_dir: Path, saved_dir: Path, *, tolerance: SsTolerance,
                         resumed_from: int, counted_from: int,
                         last_printed: int) -> tuple[DivergenceEvidence | None, list[ObservedCause]]:
    """(where a run resumed after printed step ``resumed_from`` first parts from the reference as
    whole runs, the resume causes that shows with what the run in ``saved_dir`` saved:
    :func:`~trainguard.checks.divergence.observed_resume_causes`); (None, []) without step records."""
    runs = observe_noisy(reference_dir, resumed_dir, tolerance=tolerance, printed=resumed_from + 1,
                         counted_from=counted_from, last_printed=last_printed)
    if runs is None:
        return None, []
    causes = (observed_resume_causes(runs.divergence, runs.other, read_steps(saved_dir))
              if isinstance(runs.divergence, Divergence) else [])
    return runs.evidence("the resumed run"), causes


def observed_world_size_causes(runs: NoisyRuns, world_size: int, other: str = "the other run") -> list[ObservedCause]:
    """The causes (:data:`WORLD_SIZE_CAUSES` keys) the first divergence of a run at another world
    size (``world_size``: the reference's ranks against the other's; parallel: 1 against N) shows,
    most telling first: a learning rate that differs; gradients about world_size^2 the reference's
    while the weights agree (summed, not averaged); weights that differ at the first step."""
    found = runs.divergence
    if not isinstance(found, Divergence):
        return []
    out: list[ObservedCause] = []
    first_step = found.compared_steps == 1
    for d in {d.kind: d for d in reversed(found.at_step)}.values():
        what = d.phrase(other)
        cause: ObservedCause | None = None
        if d.kind in ("lr", "hyperparameter"):
            cause = ObservedCause("schedule", f"with the same seed and global batch, {what}")
        elif d.kind == "gradient" and found.kinds <= {"gradient", "rng", "samples"} and world_size > 1:
            ratio = runs.gradient_ratio(d)
            if ratio is not None and abs(ratio / world_size**2 - 1) < 0.25:
                cause = ObservedCause("summed", f"with the same weights, {what}: {ratio:.3g}x the reference's "
                                      f"sum of squares, about {world_size}^2")
        elif d.kind == "parameter" and first_step and runs.offset == 0:
            cause = ObservedCause("initial_weights", f"before any update, {what}")
        elif d.kind == "optimizer state" and first_step and runs.offset > 0:
            cause = ObservedCause("optimizer_shard", f"at the first resumed step, {what}")
        if cause is not None and all(c.key != cause.key for c in out):
            out.append(cause)
    order = ["lr", "hyperparameter", "parameter", "optimizer state", "gradient"]
    return sorted(out, key=lambda c: order.index(_kind_of(c.key)))


def _kind_of(key: str) -> str:
    return {"schedule": "lr", "summed": "gradient", "initial_weights": "parameter",
            "optimizer_shard": "optimizer state"}[key]
