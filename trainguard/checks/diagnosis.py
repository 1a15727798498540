"""Why an equivalence check failed: causes ranked by what the runs left behind.

A failed resume names the step where the trajectories part; which piece of state was lost is a
separate question, answered here from evidence, most likely first:

* what the checkpoint the resumed run loaded holds and lacks (RNG states, optimizer moments,
  scheduler, data position, step counters), read by :func:`trainguard.unit.checkpoints.checkpoint_inventory`;
* the sample indices each step consumed (recorded in the ranks by the start-up hook,
  :func:`trainguard.launch.samples.read_samples`): a resumed step that trained on the samples of
  an earlier step is said outright;
* where the divergence starts: at the first resumed step (state missing at the boundary) or
  later (an epoch boundary: the sampler's epoch or generator);
* a learning-rate metric the job prints, compared step by step;
* the framework's own warnings on the resumed run's stderr.

Each :class:`Cause` carries its evidence; a cause the evidence rules out is kept, marked, at the
end, so the report says what was checked.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from trainguard.checks.accounting import global_batches, sample_agreement
from trainguard.checks.difference_size import DifferenceSize
from trainguard.checks.divergence import DivergenceEvidence, ObservedCause, observe_resume
from trainguard.checks.framework_warnings import framework_warnings, stderr_lines
from trainguard.evidence import UNSET, Evidence, Unset
from trainguard.unit.checkpoints.state import InventoryEvidence

if TYPE_CHECKING:  # pragma: no cover
    from trainguard.launch.samples import SampleBatch
    from trainguard.unit.checkpoints import CheckpointInventory, StateComparison

__all__ = [
    "LR_METRIC",
    "RESUME_CAUSE_TEXT",
    "Cause",
    "CauseEvidence",
    "ResumeDiagnosis",
    "ResumeFacts",
    "SampleReplay",
    "data_order_note",
    "diagnose_resume",
    "explain",
    "first_different_batch",
    "rank_causes",
    "read_inventory",
    "resume_diagnosis",
    "same_samples_across_ranks",
    "sample_replay",
    "shared_shard_note",
]

#: strength of the evidence for a cause: decisive, strong, suggestive, none, ruled out
DECISIVE, STRONG, SUGGESTIVE, NONE, RULED_OUT = 3, 2, 1, 0, -1
_WORDS = {DECISIVE: "decisive", STRONG: "strong", SUGGESTIVE: "suggestive", NONE: "no evidence either way",
          RULED_OUT: "ruled out"}

RESUME_CAUSE_TEXT = {
    "no_checkpoint": "no checkpoint written before the kill (checkpoint only at exit?)",
    "data_position": "data position not saved or not restored (the resumed run re-reads batches "
    "it already trained on, or the sampler restarts its epoch)",
    "rng": "RNG states not saved or not restored (shuffling, dropout and augmentation draw "
    "differently after the resume)",
    "optimizer": "optimizer state not saved or not restored (Adam moments restart from zero)",
    "scheduler": "LR scheduler state not saved or not restored (the schedule restarts)",
    "stale_checkpoint": "the checkpoint written before the optimizer step or with stale values",
    "ema": "EMA (averaged weights) not saved or not restored (the average restarts from the "
    "current weights)",
    "scaler": "loss-scaler (GradScaler) state not saved or not restored (the loss scale and its "
    "growth count restart)",
    "nondeterministic": "the job is not bitwise deterministic (two runs part without any resume; the "
    "determinism check says why)",
}

#: a metric that reports an average of the weights (``ema_norm``, ``swa_loss``, ``val_loss_ema``)
EMA_METRIC = re.compile(r"(?:^|[_.\-])(?:ema|swa|averaged)(?:$|[_.\-])", re.I)
#: a metric that reports a loss scaler's scale (``loss_scale``, ``grad_scale``, DeepSpeed's ``cur_scale``)
SCALE_METRIC = re.compile(r"(?:^|[_.\-])(?:loss_?scale|grad_?scale|cur_scale)$|^scale$", re.I)


@dataclass(frozen=True)
class Cause:
    """One possible cause, how strongly the evidence points at it, and that evidence."""

    key: str
    text: str
    strength: int
    evidence: tuple[str, ...] = ()
    #: the step records show it (:mod:`trainguard.checks.divergence`): ranked above every inference
    observed: bool = False

    @property
    def ruled_out(self) -> bool:
        return self.strength < 0

    def as_evidence(self) -> CauseEvidence:
        return CauseEvidence(self.text, self.key, _WORDS[max(-1, min(3, self.strength))], list(self.evidence),
                             True if self.observed else UNSET)

    def phrase(self) -> str:
        return f"{self.text}: {'; '.join(self.evidence)}" if self.evidence else self.text


@dataclass
class CauseEvidence(Evidence):
    """One ranked cause in the report (:meth:`Cause.as_evidence`)."""

    cause: str
    key: str
    #: in words: ruled out, weak, ..., strong
    evidence_strength: str
    evidence: list[str]
    #: true when the runs' step records show it (its first evidence is that observation)
    observed: bool | Unset = UNSET


@dataclass
class ResumeDiagnosis(Evidence):
    """What a resume diagnosis read (:func:`resume_diagnosis`): the causes ranked, the resumed
    checkpoint's inventory, the samples replayed, the framework's warnings."""

    diagnosis: list[CauseEvidence]
    resumed_checkpoint: InventoryEvidence | Unset = UNSET
    samples: str | Unset = UNSET
    framework_warnings: list[str] | Unset = UNSET
    #: where the two runs' step records first differ (or why they were not compared)
    first_divergence: DivergenceEvidence | Unset = UNSET


@dataclass
class _Tally:
    strength: dict[str, int] = field(default_factory=dict)
    evidence: dict[str, list[str]] = field(default_factory=dict)
    ruled_out: set[str] = field(default_factory=set)
    #: the causes the step records show, in the order shown
    observed: list[str] = field(default_factory=list)
    #: the causes evidence spoke against (:meth:`weaken`)
    weakened: set[str] = field(default_factory=set)

    def observe(self, cause: ObservedCause) -> None:
        """A cause the step records show: decisive, first, whatever was inferred."""
        if cause.key not in self.observed:
            self.observed.append(cause.key)
        self.strength[cause.key] = DECISIVE
        self.ruled_out.discard(cause.key)
        self.evidence.setdefault(cause.key, []).insert(0, cause.observation)

    def add(self, key: str, points: int, why: str) -> None:
        self.strength[key] = self.strength.get(key, 0) + points
        self.evidence.setdefault(key, []).append(why)

    def rule_out(self, key: str, why: str) -> None:
        self.ruled_out.add(key)
        self.evidence.setdefault(key, []).append(why)

    def weaken(self, key: str, why: str) -> None:
        """Evidence against ``key`` that does not rule it out: a point less, never below none."""
        self.strength[key] = max(NONE, self.strength.get(key, NONE) - 1)
        self.evidence.setdefault(key, []).append(why)
        self.weakened.add(key)


def rank_causes(tally: _Tally, texts: Mapping[str, str]) -> list[Cause]:
    """Causes the step records show first (in the order shown), then by strength, a cause with
    evidence against it after the others of its strength; ruled-out ones last; ties keep
    ``texts``' order."""
    order = list(texts)
    causes = []
    for key in order:
        observed = key in tally.observed
        strength = RULED_OUT if key in tally.ruled_out and not observed else min(DECISIVE, tally.strength.get(key, NONE))
        causes.append(Cause(key, texts[key], strength, tuple(tally.evidence.get(key, ())), observed))
    seen = tally.observed
    return sorted(causes, key=lambda c: (seen.index(c.key) if c.key in seen else len(seen), -c.strength,
                                         c.key in tally.weakened, order.index(c.key)))


# -- samples -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class SampleReplay:
    """What the first resumed step trained on, next to what the reference trained on there."""

    resumed_step: int
    expected_step: int
    #: the reference step whose samples the resumed step trained on; None when none matched
    matched_step: int | None
    first_indices: tuple[int, ...]
    same: bool  # the resumed step's samples are the reference's at that step

    def sentence(self) -> str:
        shown = ", ".join(map(str, self.first_indices[:8])) + (", ..." if len(self.first_indices) > 8 else "")
        if self.same:
            return f"the resumed step {self.resumed_step} trained on the same samples as the reference ([{shown}])"
        if self.matched_step is not None:
            return (f"the resumed step {self.resumed_step} trained on the samples of step {self.matched_step} "
                    f"([{shown}]), not those of step {self.expected_step}")
        return (f"the resumed step {self.resumed_step} trained on samples [{shown}], which no step of the "
                f"reference drew in that order (the reference's step {self.expected_step} drew others)")


def _training_batches(batches: Sequence[SampleBatch], like: str | None = None) -> list[tuple[int, ...]]:
    """The batches of the training data in the order drawn: every loader over the dataset most
    batches came from (``like``: that dataset), since a job may build a new DataLoader per epoch
    and a resumed run one for the rest of its epoch."""
    dataset = like if like is not None else _dataset_of(batches)
    return [tuple(b.indices) for b in batches if b.dataset == dataset]


def _dataset_of(batches: Sequence[SampleBatch]) -> str | None:
    counts: dict[str, int] = {}
    for b in batches:
        counts[b.dataset] = counts.get(b.dataset, 0) + 1
    return max(counts, key=lambda d: counts[d]) if counts else None


def sample_replay(
    reference: Sequence[SampleBatch], resumed: Sequence[SampleBatch], *, resumed_from: int, steps: int
) -> SampleReplay | None:
    """Compare the first batch the resumed run drew with the reference's batches of one rank.

    ``steps``: how many optimizer steps the reference ran (its batches per step follow from the
    count: gradient accumulation draws several)."""
    dataset = _dataset_of(reference)
    ref = _training_batches(reference)
    res = _training_batches(resumed, like=dataset)
    if not ref or not res or steps <= 0:
        return None
    per_step = max(1, round(len(ref) / steps))
    expected_batch = resumed_from * per_step
    if expected_batch >= len(ref):
        return None
    first = res[0]
    step = resumed_from + 1
    if first == ref[expected_batch]:
        return SampleReplay(step, step, step, first, True)
    matched = next((i for i, b in enumerate(ref) if b == first), None)
    return SampleReplay(step, step, None if matched is None else matched // per_step + 1, first, False)


def same_samples_across_ranks(batches: Mapping[int, Sequence[SampleBatch]]) -> tuple[int, ...] | None:
    """The ranks' first training batches when two or more ranks drew the same indices."""
    firsts = {rank: _training_batches(b)[:1] for rank, b in batches.items()}
    seen: dict[tuple[int, ...], int] = {}
    for rank, first in sorted(firsts.items()):
        if first:
            if first[0] in seen:
                return first[0]
            seen[first[0]] = rank
    return None




# -- resume ------------------------------------------------------------------------------------


@dataclass
class ResumeFacts:
    """What is known after a failed resume, each piece optional."""

    resumed_from: int
    first_divergent_step: int | None = None
    #: the checkpoint the resumed run loaded (read before it ran)
    checkpoint: CheckpointInventory | None = None
    final_state: StateComparison | None = None
    #: (first divergent step or None, metric name) of a learning-rate metric, when the job prints one
    lr: tuple[int | None, str] | None = None
    replay: SampleReplay | None = None
    warnings: list[tuple[str, str]] = field(default_factory=list)
    #: metric -> the step it first differs at after the resume (None: it matched), every metric compared
    metrics: dict[str, int | None] = field(default_factory=dict)
    world_size: int = 1
    #: the samples the interrupted run trained twice or never (:func:`account_samples`), when it did
    samples_accounted: str | None = None
    #: whether the resumed run began again at the first step (None: when it resumed from step 0;
    #: a job counting from 0 that resumed from its checkpoint of step 0 did not)
    began_again: bool | None = None
    #: whether the runs held GPU memory (NVML): their GPU draws have a CUDA generator to restore
    on_gpu: bool = False
    #: whether the first resumed step was compared (False: the metric was not printed there)
    boundary_compared: bool = True
    #: the last step through which the resumed ranks drew the reference's samples (None: not compared)
    samples_agree_through: int | None = None
    #: False: the runs are not bitwise reproducible (a calibrated noisy job): not compared bit for bit here
    exact_records: bool = True
    #: the causes the runs' step records show (:func:`~trainguard.checks.divergence.observe_resume`), ranked above the rest
    observed: tuple[ObservedCause, ...] = ()
    #: the reference printed steps ``counted_from`` (1, or 0 for a job counting from 0) to ``last_step`` (None: ``steps``)
    counted_from: int = 1
    last_step: int | None = None
    #: the first divergent step's values in both runs, with the calibrated spread there
    difference: DifferenceSize | None = None


def diagnose_resume(facts: ResumeFacts) -> list[Cause]:
    """The causes of a failed resume, most likely first, each with its evidence."""
    # the order of the steps below is the order each cause's evidence is listed in
    t = _Tally()
    for cause in facts.observed:
        t.observe(cause)
    boundary = facts.resumed_from + 1
    began_again = facts.resumed_from == 0 if facts.began_again is None else facts.began_again
    if began_again:
        t.add("no_checkpoint", DECISIVE, "the resumed run started again from step 1: the killed run "
              "left no checkpoint it could load")
    else:
        t.rule_out("no_checkpoint", f"the resumed run went on from step {facts.resumed_from}: it "
                   "loaded a checkpoint")
    _samples_drawn(t, facts)
    if facts.checkpoint is not None:
        _checkpoint_lacks(t, facts.checkpoint)
    if facts.lr is not None:
        _learning_rate(t, facts.lr, boundary)
    replay = facts.replay
    step = facts.first_divergent_step
    # a loss is computed before its step's update: lost optimizer or scheduler state shows one
    # step after the boundary, lost data position or RNG at the boundary itself
    if step == boundary and not began_again and replay is not None and replay.same:
        why = (f"step {step}, the first resumed one, drew the reference's samples and still differs: what "
               "it drew at random (dropout) or the weights it loaded differ")
        t.add("rng", SUGGESTIVE, why)
        t.add("stale_checkpoint", SUGGESTIVE, why)
    if facts.checkpoint is not None:
        _rng_states_held(t, facts.checkpoint, facts)
    if step == boundary + 1 and not began_again and facts.boundary_compared:
        _second_resumed_step(t, boundary)
    if step is not None and not began_again and step > boundary + 1:
        _later_divergence(t, facts, step, boundary)
    for w in facts.difference.weights(boundary) if facts.difference is not None and not began_again else ():
        if w.points > 0:
            t.add(w.key, w.points, w.why)
        else:
            t.weaken(w.key, w.why)
    _final_state(t, facts)
    for key, line in facts.warnings:
        t.add(key, STRONG, f"the framework warned: {line}")
    _averaged_weights(t, facts)
    _loss_scale(t, facts, boundary)
    return rank_causes(t, RESUME_CAUSE_TEXT)


def _second_resumed_step(t: _Tally, boundary: int) -> None:
    """The first resumed step matched and the next differs: a lost data position or RNG would
    have shown at the first resumed step itself; a loss comes before its step's update, so lost
    optimizer, scheduler or scaler state shows here. Evidence against the first two, none for
    one of the others over the rest."""
    why = (f"the first resumed step ({boundary}) matched and step {boundary + 1} differs: a lost data position "
           "or RNG shows at the first resumed step itself, lost optimizer, scheduler or scaler state a step later")
    t.weaken("data_position", why)
    t.weaken("rng", why)


def _later_divergence(t: _Tally, facts: ResumeFacts, step: int, boundary: int) -> None:
    """The runs agree for some resumed steps and part later: an epoch boundary (the sampler's
    epoch, a shuffle's RNG), unless the samples agree through it: then a job that is not bitwise
    deterministic, with nothing of the resume to blame."""
    agree = step - boundary
    later = f"the trajectories agree for {agree} resumed step{'s' if agree > 1 else ''} and part at step {step}"
    through = facts.samples_agree_through
    if through is not None and through >= step:
        t.add("nondeterministic", SUGGESTIVE, f"{later}, with the reference's samples at every step: a "
              "lost data position or RNG shows at the first resumed step or in the samples drawn")
    else:
        t.add("data_position", SUGGESTIVE, later)
        t.add("rng", SUGGESTIVE, later)
        t.add("nondeterministic", SUGGESTIVE, later)
    if "optimizer" not in t.ruled_out:
        t.add("optimizer", -1, "lost optimizer moments show within a step of the resume, not later")


def _samples_drawn(t: _Tally, facts: ResumeFacts) -> None:
    """What the first resumed step trained on, and the samples trained twice or never."""
    replay = facts.replay
    ckpt = facts.checkpoint
    if replay is not None:
        if replay.same:
            t.rule_out("data_position", replay.sentence())
        elif replay.matched_step is not None:
            if "data_position" not in t.observed:  # the observed cause cites the samples drawn again
                t.add("data_position", DECISIVE, replay.sentence())
        elif ckpt is not None and ckpt.has("rng"):
            # the checkpoint holds the RNG state a shuffle would be restored from: the data
            # position itself is what came back wrong
            t.add("data_position", STRONG, replay.sentence() + "; the checkpoint holds RNG state")
        else:
            t.add("data_position", SUGGESTIVE, replay.sentence())
            if ckpt is not None:
                t.add("rng", STRONG, "the data order after the resume differs and the checkpoint holds "
                      "no RNG state to restore the shuffle from")
    if facts.samples_accounted:
        t.add("data_position", STRONG, facts.samples_accounted)
    through = facts.samples_agree_through
    if through is not None and through >= (facts.first_divergent_step or 0) > facts.resumed_from:
        t.rule_out("data_position", f"the resumed run drew the reference's samples at every step through step {through}")


def _checkpoint_lacks(t: _Tally, ckpt: CheckpointInventory) -> None:
    """The components the checkpoint the resumed run loaded does not hold."""
    name = Path(str(ckpt.path)).name
    # a component in a file that could not be read safely is there, not missing
    # (accelerate's sampler_1.bin is a pickled sampler object)
    from trainguard.unit.checkpoints.state import classify_path

    unread = {classify_path(Path(name).name, ())[0] for name in ckpt.skipped}
    for key, component in (("rng", "rng"), ("optimizer", "optimizer"), ("scheduler", "scheduler"),
                           ("data_position", "data")):
        if not ckpt.has(component) and component not in unread:
            points = STRONG if key in ("rng", "optimizer") else SUGGESTIVE
            t.add(key, points, f"{name} holds no {_COMPONENT_WORDS[component]}")
    detail = ckpt.details.get("optimizer", "")
    if ckpt.has("optimizer") and "no per-parameter state" in detail:
        t.add("optimizer", STRONG, f"{name}: optimizer {detail}")


def _learning_rate(t: _Tally, lr: tuple[int | None, str], boundary: int) -> None:
    """Where a learning-rate metric parts: at the first resumed step, the schedule restarted."""
    lr_step, lr_name = lr
    if lr_step is None:
        t.rule_out("scheduler", f"{lr_name} matches the uninterrupted run at every step")
    elif lr_step <= boundary:
        t.add("scheduler", DECISIVE, f"{lr_name} differs from step {lr_step} on, the first resumed step")
    else:
        t.add("scheduler", SUGGESTIVE, f"{lr_name} differs from step {lr_step} on")


def _rng_states_held(t: _Tally, ckpt: CheckpointInventory, facts: ResumeFacts) -> None:
    """RNG states the checkpoint holds too few of: none of the CUDA generator for a job on the
    GPU, one torch state for several ranks."""
    if facts.on_gpu and ckpt.has("rng") and not ckpt.cuda_rng_states:
        t.add("rng", STRONG, f"{Path(str(ckpt.path)).name} holds RNG state but none of the CUDA "
              "generator, and the job ran on the GPU: what it draws there (dropout) starts again from the seed")
    if facts.world_size > 1 and ckpt.torch_rng_states == 1:
        t.add("rng", SUGGESTIVE, f"{Path(str(ckpt.path)).name} holds one torch RNG state for "
              f"{facts.world_size} ranks: ranks that draw differently (dropout) come back with rank 0's draws")


def _final_state(t: _Tally, facts: ResumeFacts) -> None:
    """The differences between the final checkpoints that point at one cause."""
    data_differs = facts.replay is not None and not facts.replay.same
    for key, why in _specific_differences(facts.final_state):
        if key.endswith("?"):  # a difference another one explains
            t.add(key[:-1], SUGGESTIVE, why)
        elif key == "rng" and data_differs:
            # other data after the resume moves the RNG too: a DataLoader without a generator of
            # its own draws its workers' seeds from it at each pass
            t.add(key, SUGGESTIVE, f"{why}, or the data after the resume differ (a DataLoader without a "
                  "generator of its own draws its workers' seeds from the global RNG at each pass)")
        else:
            t.add(key, STRONG, why)


def _loss_scale(t: _Tally, facts: ResumeFacts, boundary: int) -> None:
    """A loss-scale metric that parts at the first resumed step, or before the others do: the
    same steps scale alike, so the scaler came back wrong (or not at all)."""
    scales = {m: s for m, s in facts.metrics.items() if SCALE_METRIC.search(m) and s is not None}
    if not scales:
        return
    name, step = min(scales.items(), key=lambda kv: kv[1] or 0)
    others = [s for m, s in facts.metrics.items() if not SCALE_METRIC.search(m) and s is not None]
    if step <= boundary or (others and step < min(others)):
        later = f", before the other metrics part (step {min(others)})" if others else ""
        t.add("scaler", DECISIVE, f"{name} differs from step {step} on{later}: the same steps "
              "scale alike unless the scaler's state did not come back")
    else:
        t.add("scaler", SUGGESTIVE, f"{name} differs from step {step} on")


def _averaged_weights(t: _Tally, facts: ResumeFacts) -> None:
    """An EMA metric that parts while the others match, or a checkpoint without an EMA."""
    ema = {m: s for m, s in facts.metrics.items() if EMA_METRIC.search(m) and s is not None}
    others = [m for m in facts.metrics if not EMA_METRIC.search(m)]
    if not ema:
        return
    name, step = min(ema.items(), key=lambda kv: kv[1] or 0)
    matching = [m for m in others if facts.metrics[m] is None]
    if matching and len(matching) == len(others):
        t.add("ema", DECISIVE, f"{name} differs from step {step} on while {', '.join(matching)} "
              "match: the weights came back, their average did not")
    else:
        t.add("ema", SUGGESTIVE, f"{name} differs from step {step} on")
    ckpt = facts.checkpoint
    if ckpt is not None and ckpt.files and not ckpt.has("ema"):
        t.add("ema", STRONG, f"{Path(str(ckpt.path)).name} holds no EMA (averaged weights)")


#: a key whose value counts steps: equal in both runs unless that component restarted
_COUNTER = re.compile(r"(?:^|\.)(?:step|_step_count|last_epoch|global_step|iteration)$")


def _specific_differences(state: StateComparison | None) -> list[tuple[str, str]]:
    """Differences between the final checkpoints that point at one cause (a key ending in ``?``:
    at it only weakly, another difference explains it).

    After any divergence the weights and the optimizer's moments differ; step counters, the
    scheduler and the RNG states do not (the same steps draw the same numbers and count the
    same), unless that component was not restored."""
    if state is None or not getattr(state, "compared", False):
        return []
    by_component: Mapping[str, list[str]] = getattr(state, "by_component", {}) or {}
    what = dict(state.differing)
    out: list[tuple[str, str]] = []
    counters = [k for k, _ in state.differing if "optim" in k.lower() and _COUNTER.search(k)]
    if counters and by_component.get("scaler"):
        out.append(("optimizer?", f"the final optimizer step counts differ ({counters[0]}: "
                    f"{what.get(counters[0], '')}), as they do when a loss scaler skips other steps"))
    elif counters:
        out.append(("optimizer", f"the final optimizer step counts differ ({counters[0]}: {what.get(counters[0], '')})"))
    if by_component.get("scheduler"):
        key = by_component["scheduler"][0]
        out.append(("scheduler", f"the final scheduler state differs ({key}: {what.get(key, '')})"))
    if by_component.get("ema") and not by_component.get("model"):
        key = by_component["ema"][0]
        out.append(("ema", f"the final EMA differs ({key}: {what.get(key, '')}) while the weights match"))
    if by_component.get("scaler"):
        key = by_component["scaler"][0]
        out.append(("scaler", f"the final loss-scaler state differs ({key}: {what.get(key, '')}); "
                    "the same steps scale alike unless it was not restored"))
    if by_component.get("rng"):
        key = by_component["rng"][0]
        out.append(("rng", f"the final RNG states differ ({key}); the same steps draw the same "
                    "numbers unless the RNG was not restored"))
    return out


_COMPONENT_WORDS = {
    "rng": "RNG state (torch, numpy, python random)",
    "optimizer": "optimizer state",
    "scheduler": "LR scheduler state",
    "data": "data position (sampler or dataloader state)",
    "ema": "EMA (averaged weights)",
    "scaler": "loss-scaler state",
}


def explain(causes: Sequence[Cause]) -> str:
    """``most likely: <cause> (<evidence>)`` for the summary line; empty without evidence."""
    best = [c for c in causes if c.strength > NONE]
    if not best:
        return ""
    top = best[0]
    return f"most likely {top.text.split(' (')[0]}: {'; '.join(top.evidence[:2])}"


def first_different_batch(
    first: Sequence[SampleBatch], second: Sequence[SampleBatch]
) -> tuple[int, tuple[int, ...], tuple[int, ...]] | None:
    """``(batch number, first run's indices, second run's)`` where two runs' training batches
    first differ; None when they drew the same samples in the same order."""
    a, b = _training_batches(first), _training_batches(second)
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i, x, y
    return None


def _shown(indices: Sequence[int]) -> str:
    return "[" + ", ".join(map(str, indices[:8])) + (", ...]" if len(indices) > 8 else "]")


def data_order_note(first: Sequence[SampleBatch], second: Sequence[SampleBatch]) -> str | None:
    """For a failed determinism check: whether the two runs drew the same samples."""
    if not _training_batches(first) or not _training_batches(second):
        return None
    diff = first_different_batch(first, second)
    if diff is None:
        return "both runs drew the same samples in the same order: the data order is not the cause"
    i, x, y = diff
    return (f"the two runs drew different samples from batch {i + 1} on ({_shown(x)} vs {_shown(y)}): "
            "the data order is not seeded (shuffle generator, sampler seed or worker order)")


def shared_shard_note(batches: Mapping[int, Sequence[SampleBatch]]) -> str | None:
    """For a failed parallel check: two ranks that trained on the same samples."""
    same = same_samples_across_ranks(batches)
    if same is None:
        return None
    return (f"ranks {', '.join(str(r) for r in sorted(batches))} trained on the same first batch "
            f"{_shown(same)}: each rank reads the same shard")


#: metric names that carry the learning rate
LR_METRIC = re.compile(r"^(?:lr|learning_rate|.*[._-]lr)$", re.I)


def read_inventory(checkpoint: Path) -> CheckpointInventory | None:
    """What a checkpoint (or the newest complete one of a folder) holds; None when it cannot be
    read (the diagnosis then goes without it)."""
    from trainguard.unit.checkpoints import checkpoint_inventory

    try:
        inventory = checkpoint_inventory(checkpoint)
    except (OSError, ValueError, RuntimeError):
        return None
    return inventory if inventory.files else None


def _samples_agree_through(reference: Mapping[int, Sequence[SampleBatch]], resumed: Mapping[int, Sequence[SampleBatch]],
                           facts: ResumeFacts, steps: int) -> int | None:
    """The last step through which the resumed ranks together drew the reference ranks'
    samples, step by step; None when the records cannot say."""
    last = facts.last_step if facts.last_step is not None else steps
    agreement = sample_agreement(global_batches(reference, first_step=facts.counted_from, steps=last),
                                 global_batches(resumed, first_step=facts.resumed_from + 1, steps=last))
    if agreement is None:
        return None
    if agreement.first_different_step is not None:
        return agreement.first_different_step - 1
    return facts.resumed_from + agreement.compared_steps


def resume_diagnosis(
    *,
    reference_dir: Path,
    resumed_dir: Path,
    world_size: int,
    steps: int,
    facts: ResumeFacts,
    saved_dir: Path | None = None,
) -> tuple[list[Cause], ResumeDiagnosis]:
    """Complete ``facts`` with what the runs left (step and sample records, stderr warnings) and
    rank the causes; also the evidence to report (the first divergence of the step records, the
    checkpoint's inventory, the replay). ``saved_dir``: the run that wrote the checkpoint the
    resumed run loaded (its save records say what the checkpoint held)."""
    from trainguard.launch.samples import read_samples

    divergence: DivergenceEvidence | None = None
    if facts.resumed_from > 0 and not facts.began_again and not facts.observed and facts.exact_records:
        divergence, observed = observe_resume(reference_dir, resumed_dir, saved_dir, resumed_from=facts.resumed_from,
                                              counted_from=facts.counted_from,
                                              last_printed=facts.last_step if facts.last_step is not None else steps)
        facts.observed = tuple(observed)
    reference, resumed = read_samples(reference_dir), read_samples(resumed_dir)
    if facts.replay is None and reference.get(0) and resumed.get(0) and facts.resumed_from > 0:
        facts.replay = sample_replay(reference[0], resumed[0], resumed_from=facts.resumed_from, steps=steps)
    if facts.samples_agree_through is None and facts.resumed_from > 0:
        facts.samples_agree_through = _samples_agree_through(reference, resumed, facts, steps)
    if not facts.warnings:
        facts.warnings = framework_warnings(stderr_lines(resumed_dir, world_size))
    causes = diagnose_resume(facts)
    evidence = ResumeDiagnosis([c.as_evidence() for c in causes])
    if facts.checkpoint is not None:
        evidence.resumed_checkpoint = facts.checkpoint.as_evidence()
        evidence.resumed_checkpoint.summary = facts.checkpoint.summary()
    if facts.replay is not None:
        evidence.samples = facts.replay.sentence()
    if facts.warnings:
        evidence.framework_warnings = [line for _, line in facts.warnings]
    if divergence is not None:
        evidence.first_divergence = divergence
    return causes, evidence
