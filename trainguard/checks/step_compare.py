"""Two runs' step records compared step after step: what differs at each step, for the table a
failed check shows (:class:`StepRow`: the first quantity that differs at each step, both values),
and for runs that are not bitwise reproducible (another world size, a calibrated noisy job, base's
checkpoint resumed by the current code).

Two ways to read a run:

* rank by rank (``exact``): each rank's optimizer-0 steps, fingerprints compared bit for bit;
* the whole run (:func:`whole_run`): one record per optimizer step with, per parameter, the sum
  of squares of its local shards summed across the ranks that hold a shard of it (a DTensor:
  the step line names its placement) or one rank's value where every rank holds the whole
  parameter (DDP: no placement). Runs at different world sizes are compared so; the sums of
  squares within an :class:`SsTolerance`, the learning rate, the other hyperparameters, the loss
  scaler and the RNG states (of the lowest rank) exactly.

An RNG state that only one step's generator that neither run draws from holds (Python's and
numpy's global generators, seeded from the OS) is no difference, as in
:mod:`trainguard.checks.divergence`.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType

from trainguard.evidence import Evidence
from trainguard.launch.steps import Fingerprint, StepRecord, StepRecords

__all__ = [
    "DEFAULT_SS_RTOL",
    "MAX_ROWS",
    "ROWS_BEFORE",
    "SsTolerance",
    "StepRow",
    "compared_steps",
    "rows_around",
    "training_steps",
    "unused_generators",
    "whole_run",
]

#: without a calibration, two sums of squares agree within this relative difference
DEFAULT_SS_RTOL = 1e-3
#: the most steps the table of a failed check shows, and how many of them come before the first difference
MAX_ROWS = 50
ROWS_BEFORE = 3
#: the order the kinds are looked at within a step (:data:`trainguard.checks.divergence.KINDS`)
_ORDER = {k: i for i, k in enumerate(("lr", "hyperparameter", "parameter", "optimizer state", "scaler", "rng",
                                      "samples", "gradient"))}
_TENSORS = (("parameter", "param"), ("optimizer state", "optim"), ("gradient", "grad"))


@dataclass
class StepRow(Evidence):
    """One step of the table: the first quantity that differs there (``kind`` and ``name`` empty:
    nothing differs), the reference's value and the other run's, on ``rank`` (0 also for the
    whole run of :func:`whole_run`)."""

    step: int
    kind: str
    name: str
    reference: str
    other: str
    rank: int = 0


@dataclass(frozen=True)
class SsTolerance:
    """How two sums of squares of one tensor are compared: they agree when they differ by at most
    the larger of ``rtol`` x the larger one and ``factor`` x the calibrated same-seed spread of
    that tensor's sum of squares at that step (the largest up to it)."""

    rtol: float = DEFAULT_SS_RTOL
    #: (kind, name) -> step -> the same-seed spread envelope (the calibration's)
    spreads: Mapping[tuple[str, str], Mapping[int, float]] = field(default_factory=dict)
    factor: float = 3.0
    #: where it came from, in words (the evidence's ``compared_by``)
    source: str = ""

    def agree(self, kind: str, name: str, step: int, a: float, b: float) -> bool:
        if math.isnan(a) or math.isnan(b) or math.isinf(a) or math.isinf(b):
            return a == b or (math.isnan(a) and math.isnan(b))
        spread = self.spreads.get((kind, name), {}).get(step, 0.0)
        return abs(a - b) <= max(self.rtol * max(abs(a), abs(b)), self.factor * spread)

    def words(self) -> str:
        own = f"within a relative {self.rtol:g}"
        if not self.spreads:
            return (f"sums of squares of the whole run's tensors (local shards summed across ranks) compared {own} "
                    f"(the default: no calibration of per-parameter spreads){self.source}")
        return (f"sums of squares of the whole run's tensors (local shards summed across ranks) compared within the "
                f"larger of {own} and {self.factor:g}x the same-seed spread calibrated per tensor and step{self.source}")


# -- reading a run ----------------------------------------------------------------------------


def whole_run(records: StepRecords, opt: int = 0) -> dict[int, StepRecord]:
    """Optimizer ``opt``'s step ``n`` of the whole run: the lowest rank's record with each tensor's
    fingerprint made whole -- a tensor any rank records a placement for (a DTensor's local shard)
    summed across the ranks (its sum of squares; the bit sums added modulo 2**64), any other the
    lowest rank's that records it (every rank holds the whole parameter, or one rank its
    optimizer state). Only steps every rank recorded."""
    ranks = [training_steps(r.of(opt)) for r in records.ranks.values() if r.steps]
    if not ranks:
        return {}
    out = {}
    for n in sorted(set.intersection(*(set(r) for r in ranks))):
        steps = [r[n] for r in ranks]
        sharded = frozenset(name for s in steps for name in s.placement)
        optim = None if any(s.optim is None for s in steps) else _present(_summed(steps, "optim", sharded))
        out[n] = replace(steps[0], param=_present(_summed(steps, "param", sharded)), optim=optim,
                         grad=_summed(steps, "grad", sharded))
    return out


def _summed(steps: Sequence[StepRecord], what: str, sharded: frozenset[str]) -> Mapping[str, Fingerprint | None]:
    """Name -> the whole tensor's fingerprint: a sharded one summed, any other the lowest rank's
    that records it (a ZeroRedundancyOptimizer keeps each parameter's state on one rank only)."""
    out: dict[str, Fingerprint | None] = {}
    for step in steps:
        theirs: Mapping[str, Fingerprint | None] = getattr(step, what)
        out.update((name, p) for name, p in theirs.items() if name not in out or out[name] is None)
    for name in sharded:
        parts = [getattr(s, what).get(name) for s in steps]
        known = [p for p in parts if p is not None]
        out[name] = Fingerprint(sum(p.fp for p in known) % 2**64, math.fsum(p.ss for p in known)) if known else None
    return MappingProxyType(out)


def training_steps(steps: Mapping[int, StepRecord]) -> dict[int, StepRecord]:
    """``steps`` without the optimizer steps that train nothing, renumbered: a step with no backward
    call, every learning rate 0 and every gradient zero is ``torch.distributed.checkpoint``'s
    ``_init_optim_state`` making an optimizer's state before loading it (DCP's ``set_state_dict``
    and ``get_state_dict``), not a step of the job's."""
    out: dict[int, StepRecord] = {}
    for n in sorted(steps):
        step = steps[n]
        if not _makes_state(step):
            out[len(out) + 1] = replace(step, n=len(out) + 1) if step.n != len(out) + 1 else step
    return out


def _makes_state(step: StepRecord) -> bool:
    return (step.backward == 0 and bool(step.groups) and all(g.lr == 0.0 for g in step.groups)
            and all(g is None or g.ss == 0.0 for g in step.grad.values()))


def _present(prints: Mapping[str, Fingerprint | None]) -> Mapping[str, Fingerprint]:
    return MappingProxyType({name: p for name, p in prints.items() if p is not None})


def _lanes(records: StepRecords, exact: bool) -> dict[int, dict[int, StepRecord]]:
    """rank -> its optimizer-0 steps (exact), or the whole run as rank 0."""
    if exact:
        return {rank: training_steps(r.of(0)) for rank, r in records.ranks.items() if r.steps}
    return {0: whole_run(records)}


# -- comparing --------------------------------------------------------------------------------


def compared_steps(reference: StepRecords, other: StepRecords, *, offset: int = 0,
                   tolerance: SsTolerance | None = None) -> list[tuple[int, list[StepRow]]]:
    """(reference step, what differs there, in kind order) for every step both runs recorded:
    the other run's step ``n`` against the reference's ``n + offset``; ``tolerance`` None: rank
    by rank, fingerprints bit for bit; else the whole runs, sums of squares within it."""
    ours, theirs = _lanes(reference, tolerance is None), _lanes(other, tolerance is None)
    common = sorted(set(ours) & set(theirs))
    # a sharded parameter's optimizer state holds, besides its shards, a counter every rank keeps
    # whole (AdamW's step): summed over another number of ranks it differs by that alone
    uneven = frozenset() if len(reference.ranks) == len(other.ranks) else _sharded(reference) | _sharded(other)
    steps = sorted({n + offset for r in common for n in theirs[r] if n + offset in ours[r]})
    out = []
    for step in steps:
        found: list[StepRow] = []
        for rank in common:
            a, b = ours[rank].get(step), theirs[rank].get(step - offset)
            if a is None or b is None:
                continue
            idle = unused_generators(ours[rank], step) & unused_generators(theirs[rank], step - offset)
            found += [row for row in _step_rows(a, b, step, rank, tolerance) if not (row.kind == "rng" and row.name in idle)
                      and not (row.kind == "optimizer state" and row.name in uneven)]
        found.sort(key=lambda row: (_ORDER[row.kind], row.rank))
        out.append((step, found))
    return out


def _sharded(records: StepRecords) -> frozenset[str]:
    """The tensors some rank records a placement for (a DTensor's local shard)."""
    return frozenset(name for rank in records.ranks.values() for step in rank.steps[:1] for name in step.placement)


def _step_rows(a: StepRecord, b: StepRecord, step: int, rank: int, tolerance: SsTolerance | None) -> Iterator[StepRow]:
    for g, (ga, gb) in enumerate(zip(a.groups, b.groups)):
        theirs = dict(gb.values)
        for key, value in ga.values:
            if key not in theirs or not _equal(value, theirs[key]):
                yield StepRow(step, "lr" if key == "lr" else "hyperparameter", f"group {g}'s {key}",
                              *_pair(value, theirs.get(key)), rank)
    for kind, what in _TENSORS:
        x: Mapping[str, Fingerprint | None] | None = getattr(a, what)
        y: Mapping[str, Fingerprint | None] | None = getattr(b, what)
        if x is None or y is None:  # an optimizer state one run did not read at this step: not compared
            continue
        for name in [*x, *(n for n in y if n not in x)]:
            p, q = x.get(name), y.get(name)
            same = (p is q) if p is None or q is None else (
                p.fp == q.fp if tolerance is None else tolerance.agree(kind, name, step, p.ss, q.ss))
            if not same:
                yield StepRow(step, kind, name, *_prints(p, q, tolerance is None), rank)
    if a.scaler is not None and b.scaler is not None and a.scaler != b.scaler:
        yield StepRow(step, "scaler", "scale", *_pair(a.scaler.scale, b.scaler.scale), rank)
    if a.rng is not None and b.rng is not None:
        for (name, x_state), (_, y_state) in zip(a.rng.generators(), b.rng.generators()):
            if x_state is not None and y_state is not None and x_state != y_state:
                yield StepRow(step, "rng", name, str(x_state), str(y_state), rank)


def unused_generators(steps: Mapping[int, StepRecord], n: int) -> frozenset[str]:
    """The generators step ``n`` does not draw from: their state the same at the start of the
    next step that read the states (the agent reads them on a schedule: docs/step-records.md), or
    of the one before at the last. Python's and numpy's global generators are seeded from the OS
    at start unless the job seeds them, so two processes differ there even where the job never
    draws from them: such a difference changes nothing and is not one."""
    here = steps.get(n)
    if here is None or here.rng is None:
        return frozenset()
    beside = _next_read(steps, range(n + 1, max(steps) + 1)) or _next_read(steps, range(n - 1, min(steps) - 1, -1))
    if beside is None or beside.rng is None:
        return frozenset()
    return frozenset(g for (g, s), (_, t) in zip(here.rng.generators(), beside.rng.generators()) if s is not None and s == t)


def _next_read(steps: Mapping[int, StepRecord], order: range) -> StepRecord | None:
    """The first step in ``order`` whose RNG states were read."""
    for k in order:
        step = steps.get(k)
        if step is not None and step.rng is not None:
            return step
    return None


def _equal(x: object, y: object) -> bool:
    return x == y or (isinstance(x, float) and isinstance(y, float) and math.isnan(x) and math.isnan(y))


def _pair(x: object, y: object) -> tuple[str, str]:
    """Two numbers with the fewest significant digits that tell them apart."""
    if isinstance(x, (int, float)) and isinstance(y, (int, float)) and not isinstance(x, bool) and x != y:
        digits = next((d for d in range(3, 18) if f"{x:.{d}g}" != f"{y:.{d}g}"), 17)
        return f"{x:.{digits}g}", f"{y:.{digits}g}"
    return ("absent" if x is None else str(x)), ("absent" if y is None else str(y))


def _prints(p: Fingerprint | None, q: Fingerprint | None, exact: bool) -> tuple[str, str]:
    """Two fingerprints as shown: bit sums and sums of squares (exact), or the sums of squares."""
    if p is None or q is None or exact:
        return ("absent" if p is None else str(p)), ("absent" if q is None else str(q))
    a, b = _pair(p.ss, q.ss)
    return f"sum of squares {a}", f"sum of squares {b}"


def rows_around(compared: Sequence[tuple[int, Sequence[StepRow]]], first: int, *, shift: int = 0,
                at_first: StepRow | None = None) -> list[StepRow]:
    """The table of a failed check: the first quantity that differs at each step from
    :data:`ROWS_BEFORE` steps before step ``first`` on, at most :data:`MAX_ROWS` steps (an RNG
    state named only where nothing else differs; a step where nothing differs: a row with no
    kind); ``at_first``: the difference named first at step ``first`` (the check's own, which
    may be one this comparison does not make: samples); steps moved by ``shift`` (a job's
    printed steps)."""
    index = next((i for i, (step, _) in enumerate(compared) if step == first), None)
    if index is None:
        return []
    rows = []
    for step, found in compared[max(0, index - ROWS_BEFORE):max(0, index - ROWS_BEFORE) + MAX_ROWS]:
        shown = next((r for r in found if r.kind != "rng"), found[0] if found else None)
        if step == first and at_first is not None:
            shown = at_first
        row = shown if shown is not None else StepRow(step, "", "", "", "")
        rows.append(replace(row, step=step + shift))
    return rows
