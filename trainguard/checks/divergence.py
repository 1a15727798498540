"""Where two runs first part, read from the step records both left, and the causes that shows.

A failed determinism or resume check says at which step two loss curves part; the run agent's
step records (:mod:`trainguard.launch.steps`) say what differed inside the job there.
:func:`first_divergence` compares two runs step by step -- the other run's optimizer step ``n``
with the reference's ``n + offset`` (a resumed process counts from 1 again), per rank and
optimizer -- and names the first quantity that differs: within a step in the order that makes
the cause readable (the learning rate and other hyperparameters, the parameters, the optimizer
state, the loss scaler, the RNG states at the step's start, the samples the step trained on,
the gradients). An RNG state that differs while nothing else does yet is remembered, not
reported as the divergence: a job that draws nothing at random there trains the same (a
DataLoader iterator made at another moment draws its seed from it). Two runs with no step in
common are a :class:`NoComparison` with the reason, never equal.

:func:`observed_resume_causes` and :func:`observed_determinism_causes` name the causes that
observation shows, with what the resumed run restored (its ``restore`` lines) and what the
checkpoint held (the saving run's ``save`` lines), each citing both values.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from trainguard.checks.accounting import training_batches
from trainguard.checks.step_compare import StepRow, compared_steps, rows_around, unused_generators
from trainguard.evidence import UNSET, Evidence, Unset
from trainguard.launch.samples import SampleBatch, read_samples
from trainguard.launch.steps import (
    RNG_SET_CALLS,
    CheckpointRead,
    Fingerprint,
    StepRecord,
    StepRecords,
    checkpoint_read,
    read_steps,
)

__all__ = [
    "KINDS",
    "Agreement",
    "Difference",
    "Divergence",
    "DivergenceEvidence",
    "NoComparison",
    "ObservedCause",
    "ObservedRuns",
    "first_divergence",
    "observe_resume",
    "observe_runs",
    "observed_determinism_causes",
    "observed_resume_causes",
    "placed",
    "steps_before",
]

#: the kinds of quantity compared, in the order they are checked within a step
KINDS = ("lr", "hyperparameter", "parameter", "optimizer state", "scaler", "rng", "samples", "gradient")
_ORDER = {kind: i for i, kind in enumerate(KINDS)}

#: a rank's samples, as :func:`trainguard.launch.samples.read_samples` gives them
Samples = Mapping[int, Sequence[SampleBatch]]
#: a step's batches in the reference and in the other run, and the reference's earlier step
#: whose batches the other's are (0: none)
_Drawn = tuple[tuple[tuple[object, ...], ...], tuple[tuple[object, ...], ...], int]


@dataclass(frozen=True)
class Difference:
    """One quantity that differs at a step: the reference's step ``step`` (optimizer steps from
    1), on ``rank``, for optimizer ``opt``; both values as shown."""

    step: int
    rank: int
    opt: int
    kind: str
    name: str
    reference: str
    other: str
    #: samples: the reference's earlier step whose batches the other run drew again (0: none)
    replays: int = 0

    def phrase(self, other: str = "the other run") -> str:
        """``group 0's lr is 0.00285 at step 22 against 0.00291`` (the other value first)."""
        where = f" on rank {self.rank}" if self.rank else ""
        if self.kind == "lr" or self.kind == "hyperparameter":
            return f"{self.name} is {self.other} at step {self.step}{where} against {self.reference}"
        if self.kind == "rng":
            return (f"the {self.name} generator's state at step {self.step}'s start{where} is {self.other} "
                    f"against {self.reference}")
        if self.kind == "samples":
            again = f" (the samples of step {self.replays} again)" if self.replays else ""
            return f"{other}'s step {self.step}{where} drew samples {self.other}{again} against {self.reference}"
        if self.kind == "scaler":
            return f"the loss scaler's {self.name} is {self.other} at step {self.step}{where} against {self.reference}"
        what = {"parameter": "parameter", "optimizer state": "the optimizer state of", "gradient": "the gradient of"}
        return f"{what[self.kind]} {self.name} is {self.other} at step {self.step}{where} against {self.reference}"


@dataclass
class DivergenceEvidence(Evidence):
    """The first divergence of two runs' step records in the report (``first_divergence``): the
    step (the reference's optimizer step, from 1), rank, kind, name and both values, or, when
    the records could not be compared or agree, only the sentence saying so."""

    sentence: str
    compared_steps: int
    step: int | Unset = UNSET
    rank: int | Unset = UNSET
    kind: str | Unset = UNSET
    name: str | Unset = UNSET
    reference: str | Unset = UNSET
    other: str | Unset = UNSET
    #: a failed check's table: the first quantity that differs at each step, from a few steps
    #: before the first difference on (:func:`~trainguard.checks.step_compare.rows_around`)
    steps: list[StepRow] | Unset = UNSET
    #: how runs that are not bitwise reproducible were compared (absent: bit for bit)
    compared_by: str | Unset = UNSET


@dataclass(frozen=True)
class Divergence:
    """The first step at which the records differ: every difference there (in :data:`KINDS`
    order, the first one named), after ``compared_steps`` steps compared."""

    at_step: tuple[Difference, ...]
    compared_steps: int
    #: the other run's step n is the reference's n + offset
    offset: int = 0
    #: the first step whose RNG states differed, possibly with nothing else differing yet
    rng_since: int | None = None
    #: whether the samples were compared at that step, on every rank compared
    samples_compared: bool = False
    #: the first quantity that differs at each step around it (the report's table)
    rows: tuple[StepRow, ...] = ()

    @property
    def first(self) -> Difference:
        return self.at_step[0]

    @property
    def step(self) -> int:
        return self.first.step

    @property
    def kinds(self) -> frozenset[str]:
        return frozenset(d.kind for d in self.at_step)

    def of(self, kind: str) -> Difference | None:
        return next((d for d in self.at_step if d.kind == kind), None)

    def sentence(self, other: str = "the other run") -> str:
        more = len({(d.kind, d.name) for d in self.at_step}) - 1
        also = f" (and {more} more quantit{'ies' if more > 1 else 'y'} there)" if more > 0 else ""
        earlier = (f"; the RNG states differ from step {self.rng_since} on" if self.rng_since is not None
                   and self.rng_since < self.step and self.first.kind != "rng" else "")
        return (f"the step records first differ at step {self.step}, after {self.compared_steps - 1} equal "
                f"step(s): {self.first.phrase(other)}{also}{earlier}")

    def as_evidence(self, other: str = "the other run") -> DivergenceEvidence:
        d = self.first
        return DivergenceEvidence(self.sentence(other), self.compared_steps, d.step, d.rank, d.kind, d.name,
                                  d.reference, d.other, list(self.rows) if self.rows else UNSET)


@dataclass(frozen=True)
class Agreement:
    """Every quantity of every common step agreed; ``notes``: what was not read whole (a record
    cut at a cap: its later steps were not compared)."""

    compared_steps: int
    first_step: int
    last_step: int
    samples_compared: bool = False
    notes: tuple[str, ...] = ()

    def sentence(self, other: str = "the other run") -> str:
        samples = ", samples included" if self.samples_compared else " (no samples recorded to compare)"
        notes = f"; {'; '.join(self.notes)}" if self.notes else ""
        return (f"the step records of {other} agree with the reference's at all {self.compared_steps} steps "
                f"compared ({self.first_step}-{self.last_step}){samples}{notes}")

    def as_evidence(self, other: str = "the other run") -> DivergenceEvidence:
        return DivergenceEvidence(self.sentence(other), self.compared_steps)


@dataclass(frozen=True)
class NoComparison:
    """The records could not be compared, and why: nothing is said equal."""

    reason: str

    def sentence(self, other: str = "the other run") -> str:
        return f"the step records were not compared: {self.reason}"

    def as_evidence(self, other: str = "the other run") -> DivergenceEvidence:
        return DivergenceEvidence(self.sentence(other), 0)


# -- comparing -------------------------------------------------------------------------------


def first_divergence(
    reference: StepRecords,
    other: StepRecords,
    *,
    offset: int = 0,
    ranks: Sequence[int] | None = None,
    exact: bool = True,
    samples: tuple[Samples, Samples] | None = None,
    rtol: float = 0.0,
) -> Divergence | Agreement | NoComparison:
    """The first step at which ``other``'s records differ from ``reference``'s: other's step
    ``n`` against the reference's ``n + offset``, on ``ranks`` (default: those both recorded),
    per optimizer. ``exact``: fingerprints compared bit for bit; else their sums of squares
    within ``rtol`` (runs that are not bitwise reproducible; the learning rate, the RNG and the
    samples are compared exactly either way). ``samples``: both runs' sample records, compared
    batch by batch as the steps drew them."""
    if not reference.has_steps or not other.has_steps:
        which = "either run" if not reference.has_steps and not other.has_steps else (
            "the reference" if not reference.has_steps else "the other run")
        return NoComparison(f"{which} left no step records (the run agent off, or a rank that is not a Python process)")
    common = sorted(set(reference.ranks) & set(other.ranks) & set(ranks if ranks is not None else reference.ranks))
    pairs = [(rank, opt, reference.ranks[rank].of(opt), other.ranks[rank].of(opt))
             for rank in common for opt in reference.ranks[rank].optimizers]
    steps = sorted({n + offset for _, _, ref, oth in pairs for n in oth if n + offset in ref})
    if not steps:
        cut = [n for n in (*reference.notes(), *other.notes()) if "up to" in n or "cap" in n]
        return NoComparison(f"no step in common on rank(s) {common or 'none in common'} with the other run's step n "
                            f"taken as the reference's n + {offset}" + (f" ({cut[0]})" if cut else ""))
    drawn = _drawn_by_step(samples, pairs, offset) if samples is not None else {}
    rng_since: tuple[Difference, ...] = ()
    for i, step in enumerate(steps):
        found = []
        for rank, _, ref, oth in pairs:
            if step in ref and step - offset in oth:
                idle = unused_generators(ref, step) & unused_generators(oth, step - offset)
                found += [d for d in _differences(ref[step], oth[step - offset], rank, step, exact, rtol)
                          if not (d.kind == "rng" and d.name in idle)]
        compared = [rank for rank in common if (rank, step) in drawn]
        found += [d for rank in compared if (d := _samples_differ(drawn[(rank, step)], rank, step)) is not None]
        found.sort(key=lambda d: (_ORDER[d.kind], d.rank, d.opt))
        if not rng_since and any(d.kind == "rng" for d in found):
            rng_since = tuple(d for d in found if d.kind == "rng")
        if any(d.kind != "rng" for d in found):
            return Divergence(tuple(found), i + 1, offset, rng_since[0].step if rng_since else None,
                              bool(compared) and len(compared) == len(common))
    if rng_since:  # nothing but the RNG ever differed
        return Divergence(rng_since, steps.index(rng_since[0].step) + 1, offset, rng_since[0].step, False)
    return Agreement(len(steps), steps[0], steps[-1], bool(drawn), (*reference.notes(), *other.notes()))


def _differences(a: StepRecord, b: StepRecord, rank: int, step: int, exact: bool, rtol: float) -> list[Difference]:
    """What differs between the reference's record ``a`` and the other's ``b`` of one step."""
    found = [*_hyperparameters(a, b), *_tensors("parameter", a.param, b.param, exact, rtol),
             *(_tensors("optimizer state", a.optim, b.optim, exact, rtol) if a.optim is not None and b.optim is not None
               else ()), *_scaler_and_rng(a, b),
             *_tensors("gradient", a.grad, b.grad, exact, rtol)]
    return [Difference(step, rank, a.opt, kind, name, *_shown_pair(x, y)) for kind, name, x, y in found]


#: (kind, name, reference value, other value)
_Found = tuple[str, str, object, object]


def _hyperparameters(a: StepRecord, b: StepRecord) -> Iterator[_Found]:
    if len(a.groups) != len(b.groups):
        yield "hyperparameter", "the number of param groups", len(a.groups), len(b.groups)
    for g, (ga, gb) in enumerate(zip(a.groups, b.groups)):
        theirs = dict(gb.values)
        for key, value in ga.values:
            if key not in theirs or not _same_value(value, theirs[key]):
                yield "lr" if key == "lr" else "hyperparameter", f"group {g}'s {key}", value, theirs.get(key)


def _tensors(kind: str, x: Mapping[str, Fingerprint | None], y: Mapping[str, Fingerprint | None], exact: bool,
             rtol: float) -> Iterator[_Found]:
    for name in _names(x, y):
        if not _same_print(x.get(name), y.get(name), exact, rtol):
            yield kind, name, x.get(name), y.get(name)


def _scaler_and_rng(a: StepRecord, b: StepRecord) -> Iterator[_Found]:
    if a.scaler is not None and b.scaler is not None:
        if a.scaler.scale != b.scaler.scale:
            yield "scaler", "scale", a.scaler.scale, b.scaler.scale
        if a.scaler.skipped != b.scaler.skipped:
            yield "scaler", "skipped step", a.scaler.skipped, b.scaler.skipped
    if a.rng is not None and b.rng is not None:
        for (name, x_state), (_, y_state) in zip(a.rng.generators(), b.rng.generators()):
            if x_state is not None and y_state is not None and x_state != y_state:
                yield "rng", name, x_state, y_state


def _names(x: Mapping[str, Fingerprint | None], y: Mapping[str, Fingerprint | None]) -> Iterator[str]:
    """The names of both, the reference's first in its order."""
    yield from x
    yield from (name for name in y if name not in x)


def _same_value(x: object, y: object) -> bool:
    if isinstance(x, float) and isinstance(y, float) and math.isnan(x) and math.isnan(y):
        return True
    return x == y


def _same_print(x: Fingerprint | None, y: Fingerprint | None, exact: bool, rtol: float) -> bool:
    if x is None or y is None:
        return x is y
    if exact:
        return x.fp == y.fp
    if math.isnan(x.ss) or math.isnan(y.ss):
        return math.isnan(x.ss) and math.isnan(y.ss)
    return abs(x.ss - y.ss) <= rtol * max(abs(x.ss), abs(y.ss))


def _shown_pair(x: object, y: object) -> tuple[str, str]:
    """Both values as shown: two numbers with the fewest digits that tell them apart (``2.85e-03``
    against ``2.91e-03``), anything else as it is."""
    if isinstance(x, float) and isinstance(y, float) and not isinstance(x, bool) and not isinstance(y, bool):
        for digits in range(3, 18):
            a, b = f"{x:.{digits}g}", f"{y:.{digits}g}"
            if a != b:
                return a, b
    return _shown(x), _shown(y)


#: how a value one run lacks is shown (an optimizer state never created)
_ABSENT = "absent"


def _shown(value: object) -> str:
    if value is None:
        return _ABSENT
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, tuple):
        return "(" + ", ".join(_shown(v) for v in value) + ")"
    return str(value)


# -- samples, by step ------------------------------------------------------------------------


def _drawn_by_step(samples: tuple[Samples, Samples], pairs: Sequence[tuple[int, int, Mapping[int, StepRecord],
                   Mapping[int, StepRecord]]], offset: int) -> dict[tuple[int, int], _Drawn]:
    """(rank, reference step) -> (the reference's batches of that step, the other's): a rank's
    batches split into its optimizer-0 steps (gradient accumulation draws several a step), for
    a rank whose reference batches split evenly into its steps and whose other run drew at
    least as many; and the reference's earlier step whose batches the other's are (0: none)."""
    out: dict[tuple[int, int], _Drawn] = {}
    reference, other = samples
    for rank, opt, ref, oth in pairs:
        if opt != 0 or not ref or not oth:
            continue
        mine = training_batches(reference.get(rank, ()), None)
        dataset = mine[0].dataset if mine else None
        theirs = training_batches(other.get(rank, ()), dataset) if dataset is not None else []
        # batches drawn ahead at the end, at most one step's worth (accelerate's loaders read
        # one batch ahead to know the last one)
        per, ahead = divmod(len(mine), len(ref)) if mine else (0, 0)
        if not per or not theirs or ahead > per:
            continue
        extra = len(theirs) - per * len(oth)
        if extra < 0:
            continue
        # batches a resumed run drew before its first step to skip them (the data position
        # restored by drawing: the Trainer's, a loop's `next(it)`) are whole steps' worth at the
        # start; a kill may leave part of a step's at the end, a loader's look-ahead too
        skipped = max(extra - ahead, 0) // per * per
        first_drawn: dict[tuple[tuple[object, ...], ...], int] = {}
        for m in range(len(mine) // per):
            first_drawn.setdefault(tuple(tuple(x.indices) for x in mine[m * per:(m + 1) * per]), m + 1)
        for n in oth:
            if n + offset in ref:
                a = mine[(n + offset - 1) * per:(n + offset) * per]
                b = theirs[skipped + (n - 1) * per:skipped + n * per]
                drew = tuple(tuple(x.indices) for x in b)
                again = first_drawn.get(drew, 0)
                out[(rank, n + offset)] = (tuple(tuple(x.indices) for x in a), drew, again if again < n + offset else 0)
    return out


def _samples_differ(drawn: _Drawn, rank: int, step: int) -> Difference | None:
    a, b, again = drawn
    if a == b:
        return None
    i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), 0)
    return Difference(step, rank, 0, "samples", f"batch {i + 1} of the step", _indices(a[i] if i < len(a) else ()),
                      _indices(b[i] if i < len(b) else ()), again)


def _indices(batch: object) -> str:
    items = list(batch) if isinstance(batch, tuple) else []
    return "[" + ", ".join(map(str, items[:8])) + (", ...]" if len(items) > 8 else "]")


# -- the causes observed ---------------------------------------------------------------------


@dataclass(frozen=True)
class ObservedCause:
    """A cause the records show: its key (a resume's :data:`~trainguard.checks.diagnosis.RESUME_CAUSE_TEXT`
    key; a determinism check's ``seed``, ``kernels``, ``data_order`` or ``wall_clock``) and the
    observation, citing both values."""

    key: str
    observation: str


#: restore calls that restore a whole state at once (a model's, an optimizer's, ...)
_WHOLE = frozenset({"dcp.load", "dcp.set_state_dict"})
_RESTORES = {
    "optimizer": _WHOLE | {"Optimizer.load_state_dict"},
    "scheduler": frozenset({"LRScheduler.load_state_dict"}),
    "model": _WHOLE | {"Module.load_state_dict", "safetensors.load_file"},
    "scaler": frozenset({"GradScaler.load_state_dict"}),
    "rng": RNG_SET_CALLS,
    "loader": frozenset({"DataLoader.load_state_dict", "sampler.load_state_dict"}),
}
_RESUMED = "the resumed run"


def observed_resume_causes(divergence: Divergence, resumed: StepRecords,
                           saved: StepRecords | None = None) -> list[ObservedCause]:
    """The causes ``divergence`` (the resumed run against the uninterrupted one) shows, with
    what the resumed run restored and what the saving run's checkpoints held (``saved``: the run
    whose checkpoint it loaded), most telling first; empty when it shows none (then the
    checkpoint's inventory is what is left to go by)."""
    calls = resumed.restore_calls()
    held = checkpoint_read(saved, resumed) if saved is not None else None
    at_first = divergence.step == divergence.offset + 1
    found: list[ObservedCause] = []
    for d in _firsts(divergence):
        cause = _resume_cause(d, divergence, calls, held, at_first)
        if cause is not None and all(c.key != cause.key for c in found):
            found.append(cause)
    return found


def _firsts(divergence: Divergence) -> list[Difference]:
    """The first difference of each kind at the divergence, in :data:`KINDS` order."""
    seen: dict[str, Difference] = {}
    for d in divergence.at_step:
        seen.setdefault(d.kind, d)
    return list(seen.values())


@dataclass(frozen=True)
class _Restored:
    """What the resumed run restored (its restore calls) and what the checkpoint it read held
    (None: no save recorded)."""

    calls: frozenset[str]
    held: CheckpointRead | None

    def loaded(self, what: str) -> bool:
        return bool(self.calls & _RESTORES[what])

    def lacks(self, owner: str) -> bool:
        return self.held is not None and owner not in self.held.owners


def _resume_cause(d: Difference, div: Divergence, calls: frozenset[str], held: CheckpointRead | None,
                  at_first: bool) -> ObservedCause | None:
    restored, what = _Restored(calls, held), d.phrase(_RESUMED)
    if d.kind in ("lr", "hyperparameter"):
        if at_first and not restored.loaded("optimizer") and "optimizer state" in div.kinds:
            return None  # a fresh optimizer: its state's difference says so, the lr is part of it
        return _schedule_cause(what, restored, at_first)
    if d.kind in ("parameter", "optimizer state", "scaler"):
        return _state_cause(d, what, restored, at_first)
    if d.kind == "rng":
        # an RNG that differs is a cause where it is the first difference or the samples differ with it
        if div.first.kind != "rng" and "samples" not in div.kinds:
            return None
        if "samples" in div.kinds and (restored.loaded("rng") or any(x.replays for x in div.at_step)):
            # set, or an earlier step's batches drawn again: the data position parts the runs,
            # and the RNG's state follows from what was drawn
            return None
        return ObservedCause("rng", _rng_observation(what, restored))
    if d.kind == "samples":
        lost = "; it restored no loader state" if not restored.loaded("loader") else ""
        return ObservedCause("data_position", f"{what}{lost}")
    if div.kinds == {"gradient"} and div.samples_compared:
        return ObservedCause("nondeterministic", f"at step {d.step} the learning rate, parameters, optimizer state, "
                             f"RNG states and samples of both runs agree and {what}: the backward pass is not "
                             "deterministic, and nothing the resume restored differs")
    return None


def _schedule_cause(what: str, restored: _Restored, at_first: bool) -> ObservedCause:
    """A learning rate (or another hyperparameter) that differs: the scheduler's state, or at
    the first resumed step the optimizer's, where the rate is kept, when that was not loaded."""
    if at_first and not restored.loaded("optimizer"):
        return ObservedCause("optimizer", f"{_RESUMED} loaded no optimizer state, where the learning rate is kept: {what}")
    if not restored.loaded("scheduler"):
        held = "; its checkpoint holds none" if restored.lacks("scheduler") else ""
        return ObservedCause("scheduler", f"{_RESUMED} never loaded the scheduler's state: {what}{held}")
    return ObservedCause("scheduler", f"{what}, though {_RESUMED} loaded a scheduler state: one saved stale, "
                         "or a schedule stepped again after the load")


def _state_cause(d: Difference, what: str, restored: _Restored, at_first: bool) -> ObservedCause | None:
    """Weights, optimizer state or a loss scaler that differ: not loaded, not saved, or loaded
    from another step (stale) -- the last only at the first resumed step, where what was loaded
    is what is compared; later, an update differed after a step whose inputs agreed."""
    if d.kind == "scaler":
        if not restored.loaded("scaler"):
            return ObservedCause("scaler", f"{_RESUMED} never loaded the loss scaler's state: {what}")
        return ObservedCause("scaler", f"{what}, though {_RESUMED} loaded a loss-scaler state")
    if d.kind == "optimizer state" and not restored.loaded("optimizer"):
        return ObservedCause("optimizer", f"{_RESUMED} loaded no optimizer state: {what}")
    if d.kind == "optimizer state" and restored.lacks("optimizer"):
        return ObservedCause("optimizer", f"its checkpoint saves no optimizer state: {what}")
    if d.kind == "optimizer state" and d.other == _ABSENT:
        return ObservedCause("optimizer", f"{what}, though {_RESUMED} loaded an optimizer state: the state was "
                             "cleared, or the optimizer made anew, after the load")
    if not at_first:
        return None
    if d.kind == "parameter":
        none = "" if restored.loaded("model") else f"; it loaded no model state (no {', '.join(sorted(_RESTORES['model']))})"
        return ObservedCause("stale_checkpoint", f"the weights {_RESUMED} started from differ from the reference's "
                             f"after step {d.step - 1}: {what}{none}")
    return ObservedCause("stale_checkpoint", f"the optimizer state {_RESUMED} loaded differs from the reference's "
                         f"after step {d.step - 1}: {what}")


def _rng_observation(what: str, restored: _Restored) -> str:
    """What the resume did with the RNG states, and what the checkpoint it read holds of them
    (not what a save once wrote: a file removed since is not read)."""
    set_calls, held = sorted(restored.calls & _RESTORES["rng"]), restored.held
    gone = [name for name, owners in held.gone if "rng" in owners] if held is not None else []
    if not set_calls and gone and restored.lacks("rng"):
        return (f"its checkpoint holds no RNG state and the resume sets none: the save wrote {gone[0]}, which is not "
                f"in the folder the resume loaded from: {what}")
    if not set_calls and restored.lacks("rng"):
        return f"its checkpoint saves no RNG state and the resume sets none: {what}"
    if not set_calls:
        some = ("" if held is None else " although the checkpoint it loaded holds some" if held.matched
                else " although the saving run's saves held some")
        return (f"the resume sets no RNG state (no torch.set_rng_state, numpy.random.set_state or "
                f"random.setstate call){some}: {what}")
    return (f"{_RESUMED} set RNG state ({', '.join(set_calls)}), but {what}: a state saved at another step or "
            "by another rank, or drawn from after it was set")


#: the determinism check's observed causes, keyed as :data:`trainguard.checks.equivalence.NONDETERMINISM_CAUSES`
_SEEDS = {"torch CPU": "torch.manual_seed", "CUDA": "torch.manual_seed", "numpy": "numpy.random.seed",
          "Python random": "random.seed"}


def observed_determinism_causes(divergence: Divergence, first: StepRecords, second: StepRecords) -> list[ObservedCause]:
    """The causes ``divergence`` of two runs with the same seed shows (``seed``: something is not
    seeded; ``kernels``: the same inputs give other results; ``data_order``: other samples;
    ``wall_clock``: another learning rate), first the most telling."""
    found: list[ObservedCause] = []
    at_start = divergence.step == divergence.offset + 1  # the runs' first step
    for d in _firsts(divergence):
        what = d.phrase("the second run")
        cause: ObservedCause | None = None
        if d.kind in ("lr", "hyperparameter"):
            cause = ObservedCause("wall_clock", f"with the same seed, {what}")
        elif d.kind == "parameter" and at_start:
            cause = ObservedCause("seed", f"the initial weights are not seeded: {what}, before any update")
        elif d.kind == "rng" and (divergence.first.kind == "rng" or "samples" in divergence.kinds):
            unseeded = [r for r, run in (("first", first), ("second", second)) if _SEEDS[d.name] not in run.seed_calls()]
            none = f" (no {_SEEDS[d.name]} call in the {' and '.join(unseeded)} run)" if unseeded else ""
            cause = ObservedCause("seed", f"the seed is not fixed: {what}{none}")
        elif d.kind == "samples":
            cause = ObservedCause("data_order", what)
        elif d.kind in ("parameter", "optimizer state", "scaler") and divergence.kinds <= {"parameter", "optimizer state",
                                                                                           "scaler", "gradient"}:
            cause = ObservedCause("kernels", f"{what}, after a step whose inputs agreed: the update is not deterministic")
        elif divergence.kinds == {"gradient"} and divergence.samples_compared:
            cause = ObservedCause("kernels", f"at step {d.step} the parameters, RNG states and samples of both runs agree "
                                  f"and {what}: the backward pass is not deterministic")
        if cause is not None and all(c.key != cause.key for c in found):
            found.append(cause)
    return found


# -- reading two runs ------------------------------------------------------------------------


def steps_before(reference: StepRecords, printed: int, *, counted_from: int, last_printed: int) -> int | NoComparison:
    """The optimizer steps the reference made before its printed step ``printed`` (the offset of
    a run resumed there): the printed steps ``counted_from``..``last_printed`` each span as many
    optimizer steps (gradient accumulation and epochs counted as steps included)."""
    counts = [len(rank.of(0)) for rank in reference.ranks.values() if rank.steps]
    span = last_printed - counted_from + 1
    if not counts or span <= 0:
        return NoComparison("the reference left no step records")
    if counts[0] % span:
        return NoComparison(f"the reference's {counts[0]} optimizer steps do not split evenly into its {span} printed "
                            "steps, so the step a resume went on from cannot be placed among them")
    return (printed - counted_from) * (counts[0] // span)


def placed(reference: StepRecords, *, printed: int | None, counted_from: int = 1,
           last_printed: int | None = None) -> tuple[int | NoComparison, int]:
    """(the offset of a run resumed at printed step ``printed`` -- its step n is the reference's
    n + offset; 0 for None: from the start --, the shift from the reference's optimizer steps to
    its printed ones: where a printed step is one optimizer step, ``counted_from - 1``, else 0)."""
    offset: int | NoComparison = 0
    shift = 0
    if last_printed is not None:
        per = steps_before(reference, counted_from + 1, counted_from=counted_from, last_printed=last_printed)
        shift = counted_from - 1 if per == 1 else 0
        if printed is not None:
            offset = steps_before(reference, printed, counted_from=counted_from, last_printed=last_printed)
    return offset, shift


@dataclass(frozen=True)
class ObservedRuns:
    """Two runs' step records compared (:func:`observe_runs`) and the records read."""

    divergence: Divergence | Agreement | NoComparison
    reference: StepRecords
    other: StepRecords


def observe_runs(reference_dir: Path, other_dir: Path, *, printed: int | None = None, counted_from: int = 1,
                 last_printed: int | None = None) -> ObservedRuns | None:
    """The first divergence of the run in ``other_dir`` from the one in ``reference_dir``, their
    samples included; ``printed``: the printed step the other run resumed at (None: both ran
    from the start), of the reference's printed steps ``counted_from``..``last_printed``. Where a
    printed step is one optimizer step, the steps named are the printed ones (nanoGPT's `iter 10`
    is its 11th step); else the optimizer steps, from 1. None when neither run recorded a step
    (nothing to say, as before: the agent off, a job that never steps a torch optimizer)."""
    reference, other = read_steps(reference_dir), read_steps(other_dir)
    if not reference.has_steps and not other.has_steps:  # a job without torch, the agent off: nothing to say
        return None
    offset, shift = placed(reference, printed=printed, counted_from=counted_from, last_printed=last_printed)
    if isinstance(offset, NoComparison):
        return ObservedRuns(offset, reference, other)
    samples = (read_samples(reference_dir), read_samples(other_dir))
    found = first_divergence(reference, other, offset=offset, samples=samples)
    if isinstance(found, Divergence):  # the table: the first difference at each step around it
        d = found.first
        found = replace(found, rows=tuple(rows_around(compared_steps(reference, other, offset=offset), found.step,
                                                      shift=shift, at_first=StepRow(d.step, d.kind, d.name, d.reference,
                                                                                    d.other, d.rank))))
    return ObservedRuns(_renumbered(found, shift) if shift else found, reference, other)


def _renumbered(found: Divergence | Agreement | NoComparison, shift: int) -> Divergence | Agreement | NoComparison:
    """``found`` with its steps moved by ``shift`` (to a job's printed steps)."""
    if isinstance(found, Agreement):
        return replace(found, first_step=found.first_step + shift, last_step=found.last_step + shift)
    if isinstance(found, Divergence):
        return replace(found, at_step=tuple(replace(d, step=d.step + shift) for d in found.at_step),
                       offset=found.offset + shift,
                       rng_since=None if found.rng_since is None else found.rng_since + shift)
    return found


def observe_resume(reference_dir: Path, resumed_dir: Path, saved_dir: Path | None, *, resumed_from: int,
                   counted_from: int, last_printed: int) -> tuple[DivergenceEvidence | None, list[ObservedCause]]:
    """(where the step records of a run resumed after printed step ``resumed_from`` first differ
    from the reference's, the causes that shows); ``saved_dir``: the run whose checkpoint it
    loaded. (None, []) when neither run left step records (a non-Python rank, the agent off:
    the checkpoint's inventory is then what is left to go by)."""
    runs = observe_runs(reference_dir, resumed_dir, printed=resumed_from + 1, counted_from=counted_from,
                        last_printed=last_printed)
    if runs is None:
        return None, []
    found = runs.divergence
    if not isinstance(found, Divergence):
        return found.as_evidence(_RESUMED), []
    saved = None if saved_dir is None else runs.reference if Path(saved_dir) == Path(reference_dir) else read_steps(saved_dir)
    return found.as_evidence(_RESUMED), observed_resume_causes(found, runs.other, saved)
