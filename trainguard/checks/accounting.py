"""Every sample exactly once: which samples a run interrupted and resumed (once or several times,
at the same or another world size) trained twice or never, epoch by epoch, against the run that
was not interrupted.

The sample records (:mod:`trainguard.launch.samples`) say which dataset indices each rank's
batches held. A step's samples are every rank's batches of that step (gradient accumulation
draws several per rank: the count per step follows from the uninterrupted run's records). The
interrupted run's training is the steps each segment's progress survived: the killed run's
steps up to the checkpoint the next run resumed from, then the resumed run's; the steps a kill
cut short and the next run trained again count once, as they did for the weights. Epochs are
the uninterrupted run's passes over its loader, by step.

"samples 640-703 never trained in epoch 1 (steps 21-40) after the resume at step 30; 0-63
trained twice" is said when the counts differ from the uninterrupted run's; where the records
cannot say (an iterable dataset, a loader that yields out of order, no records) the accounting
says so instead of guessing.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from trainguard.evidence import UNSET, Evidence, Unset
from trainguard.launch.samples import SampleBatch

__all__ = ["AccountingEvidence", "EpochAccount", "EpochEvidence", "SampleAccounting", "SampleAgreement", "Segment", "account_samples", "batch_order_difference",
           "global_batches", "index_ranges", "sample_agreement", "training_batches"]


@dataclass(frozen=True)
class Segment:
    """One run's part of the training: its sample records and the steps whose progress it kept
    (``first_step``..``last_step``); ``label`` names it ("the resume at step 30")."""

    samples: Mapping[int, Sequence[SampleBatch]]
    first_step: int
    last_step: int
    label: str = ""


@dataclass(frozen=True)
class EpochAccount:
    """One epoch (a pass of the uninterrupted run) whose samples the interrupted run did not
    train exactly as often: ``twice`` more often, ``never`` less (each index once per time)."""

    epoch: int
    first_step: int
    last_step: int
    twice: tuple[Any, ...] = ()
    never: tuple[Any, ...] = ()
    #: the label of the segment the first difference falls in
    where: str = ""

    def sentence(self) -> str:
        parts = []
        span = f"epoch {self.epoch} (steps {self.first_step}-{self.last_step})"
        after = f" {self.where}" if self.where else ""
        if self.never:
            parts.append(f"{_samples(self.never)} never trained in {span}{after}")
        if self.twice:
            lead = "" if parts else f"in {span}{after} "
            parts.append(f"{lead}{_samples(self.twice)} trained twice")
        return "; ".join(parts)

    def as_evidence(self) -> EpochEvidence:
        return EpochEvidence(self.epoch, [self.first_step, self.last_step], self.where,
                             index_ranges(self.twice, limit=50), index_ranges(self.never, limit=50),
                             len(self.twice), len(self.never))


@dataclass
class EpochEvidence(Evidence):
    """One epoch whose samples differ from the uninterrupted run's (:class:`EpochAccount`)."""

    epoch: int
    #: [first, last] step of the epoch compared
    steps: list[int]
    where: str
    #: the sample indices trained twice / never, as ranges (``0-63, 640-703``)
    twice: str
    never: str
    twice_count: int
    never_count: int


@dataclass
class AccountingEvidence(Evidence):
    """:class:`SampleAccounting` in the report (``sample_accounting``): the first ten epochs."""

    compared_steps: int
    ok: bool
    summary: str
    epochs: list[EpochEvidence]
    note: str | Unset = UNSET


@dataclass
class SampleAccounting:
    """The epochs whose samples differ (empty: every sample as often as uninterrupted), over
    ``compared_steps`` steps; ``note``: why the records could not say, when they could not."""

    compared_steps: int = 0
    epochs: list[EpochAccount] = field(default_factory=list)
    note: str = ""

    @property
    def known(self) -> bool:
        return self.compared_steps > 0 and not self.note

    @property
    def ok(self) -> bool:
        return self.known and not self.epochs

    def summary(self) -> str:
        if not self.known:
            return self.note or "no sample records to account for"
        if not self.epochs:
            return f"every sample trained as often as in the uninterrupted run over {self.compared_steps} steps"
        return "; ".join(e.sentence() for e in self.epochs[:3]) + (
            f"; and {len(self.epochs) - 3} more epochs" if len(self.epochs) > 3 else "")

    def as_evidence(self) -> AccountingEvidence:
        return AccountingEvidence(self.compared_steps, self.ok, self.summary(),
                                  [e.as_evidence() for e in self.epochs[:10]], self.note or UNSET)


def _samples(indices: Sequence[Any]) -> str:
    """``samples 20-39``; scattered (a shuffled order): ``240 samples (1-2, 4, 11, ...)``."""
    shown = index_ranges(indices, limit=6)
    if "more ranges" not in shown:
        return f"samples {shown}"
    return f"{len(set(indices))} samples ({shown.split(', ... (')[0]}, ...)"


def index_ranges(indices: Sequence[Any], limit: int = 8) -> str:
    """``0-63, 640-703, 901`` for sorted integer indices (others as they are), at most ``limit``
    runs shown."""
    ints = sorted({i for i in indices if isinstance(i, int) and not isinstance(i, bool)})
    spans: list[list[int]] = []
    for i in ints:
        if spans and i == spans[-1][1] + 1:
            spans[-1][1] = i
        else:
            spans.append([i, i])
    runs = [f"{a}-{b}" if b != a else f"{a}" for a, b in spans]
    runs.extend(repr(i) for i in indices if not (isinstance(i, int) and not isinstance(i, bool)))
    return ", ".join(runs[:limit]) + (f", ... ({len(runs) - limit} more ranges)" if len(runs) > limit else "")


def _dataset(samples: Mapping[int, Sequence[SampleBatch]]) -> str | None:
    counts: Counter[str] = Counter(b.dataset for batches in samples.values() for b in batches)
    return counts.most_common(1)[0][0] if counts else None


class _Misaligned(Exception):
    """A step's batches span two passes of a loader: the run's batches are not the steps'."""


def _per_step(samples: Mapping[int, Sequence[SampleBatch]], dataset: str, first_step: int, last_step: int,
              per_step: int) -> dict[int, tuple[Counter[Any], tuple[int, int] | None]]:
    """Step -> (the indices every rank drew for it, the first rank's pass (loader, iter)).
    _Misaligned when one step's batches came from two passes (a run that resumed inside what
    the job counts as a step, an epoch say: its batches do not split into steps)."""
    ranks = {r: [b for b in batches if b.dataset == dataset] for r, batches in sorted(samples.items())}
    out: dict[int, tuple[Counter[Any], tuple[int, int] | None]] = {}
    for i, step in enumerate(range(first_step, last_step + 1)):
        drawn: Counter[Any] = Counter()
        first_pass = None
        for batches in ranks.values():
            chunk = batches[i * per_step:(i + 1) * per_step]
            if len({(b.loader, b.iter) for b in chunk}) > 1 and len(chunk) == per_step:
                raise _Misaligned(f"step {step}'s batches come from two passes of the loader")
            for b in chunk:
                drawn.update(_hashable(x) for x in b.indices)
            if first_pass is None and chunk:
                first_pass = (chunk[0].loader, chunk[0].iter)
        if not drawn:
            break
        out[step] = (drawn, first_pass)
    return out


def _hashable(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


def _order(value: Any) -> tuple[bool, Any]:
    """Integers by value, then anything else by its repr."""
    is_int = isinstance(value, int) and not isinstance(value, bool)
    return (not is_int, value if is_int else repr(value))


def account_samples(reference: Mapping[int, Sequence[SampleBatch]], segments: Sequence[Segment], *,
                    steps: int, first_step: int = 1) -> SampleAccounting:
    """Which samples the interrupted run (``segments``, in order) trained more or less often than
    ``reference`` (the uninterrupted run of ``steps`` steps from ``first_step``: 1, or 0 for a job
    counting from 0), per epoch of the reference."""
    dataset = _dataset(reference)
    if dataset is None or steps <= 0:
        return SampleAccounting(note="no sample records of the uninterrupted run (an iterable dataset, a "
                                "loader with workers and in_order=False, a ray_train job, or "
                                "job.record_samples off)")
    first_rank = min(reference)
    drawn = [b for b in reference[first_rank] if b.dataset == dataset]
    if len(drawn) % steps:
        return SampleAccounting(note=f"the uninterrupted run's rank {first_rank} drew {len(drawn)} batches "
                                f"of {dataset} in {steps} steps: not a whole number per step, so batches "
                                "cannot be assigned to steps")
    per_step = len(drawn) // steps
    try:
        ref = _per_step(reference, dataset, first_step, first_step + steps - 1, per_step)
    except _Misaligned as exc:
        return SampleAccounting(note=f"the uninterrupted run's batches do not split into steps ({exc})")
    if not ref:
        return SampleAccounting(note=f"no batch of {dataset} recorded")
    epoch_of = _epochs(ref)
    got: dict[int, Counter[Any]] = {}
    label_of: dict[int, str] = {}
    for segment in segments:
        if segment.last_step < segment.first_step:
            continue
        seg_dataset = dataset if any(b.dataset == dataset for bs in segment.samples.values() for b in bs) \
            else _dataset(segment.samples)
        if seg_dataset is None:
            return SampleAccounting(note=f"no sample records of {segment.label or 'a run'}")
        try:
            drawn_per_step = _per_step(segment.samples, seg_dataset, segment.first_step, segment.last_step, per_step)
        except _Misaligned as exc:
            return SampleAccounting(note=f"the batches of {segment.label or 'a run'} do not split into the "
                                    f"uninterrupted run's steps ({exc}: it resumed inside a step)")
        for step, (counts, _) in drawn_per_step.items():
            got[step], label_of[step] = counts, segment.label
    compared = sorted(s for s in ref if s in got)
    if not compared:
        return SampleAccounting(note="the interrupted run's records cover none of the uninterrupted run's steps")
    out = SampleAccounting(compared_steps=len(compared))
    for e in sorted(set(epoch_of[s] for s in compared)):
        account = _epoch_account(e, [s for s in compared if epoch_of[s] == e], ref, got, label_of)
        if account is not None:
            out.epochs.append(account)
    return out


def _epochs(ref: Mapping[int, tuple[Counter[Any], tuple[int, int] | None]]) -> dict[int, int]:
    """Step -> the uninterrupted run's epoch it falls in, from 0: a new pass of the first rank's
    loader starts one."""
    epoch_of: dict[int, int] = {}
    epoch, last_pass = -1, None
    for step in sorted(ref):
        if ref[step][1] != last_pass:
            epoch, last_pass = epoch + 1, ref[step][1]
        epoch_of[step] = epoch
    return epoch_of


def _epoch_account(epoch: int, in_epoch: Sequence[int],
                   ref: Mapping[int, tuple[Counter[Any], tuple[int, int] | None]],
                   got: Mapping[int, Counter[Any]], label_of: Mapping[int, str]) -> EpochAccount | None:
    """The samples of one epoch's steps (``in_epoch``, in order) the interrupted run trained
    more or less often than the uninterrupted one; None when it trained each as often. Counted
    over the whole epoch, not step by step: a resume that draws the same samples in another
    order within the epoch still trained each once."""
    want: Counter[Any] = Counter()
    have: Counter[Any] = Counter()
    for s in in_epoch:
        want.update(ref[s][0])
        have.update(got[s])
    twice = tuple(sorted((have - want).elements(), key=_order))
    never = tuple(sorted((want - have).elements(), key=_order))
    if not (twice or never):
        return None
    first_diff = next((s for s in in_epoch if got[s] != ref[s][0]), in_epoch[0])
    return EpochAccount(epoch, in_epoch[0], in_epoch[-1], twice, never, label_of.get(first_diff, ""))


# -- the samples of two runs, step by step ---------------------------------------------------------


def training_batches(batches: Sequence[SampleBatch], dataset: str | None) -> list[SampleBatch]:
    """The batches of the training data in the order drawn: every loader over ``dataset`` (a
    job may build a new DataLoader per epoch), default the dataset the most batches came from."""
    if dataset is None:
        counts: dict[str, int] = {}
        for b in batches:
            counts[b.dataset] = counts.get(b.dataset, 0) + 1
        dataset = max(counts, key=lambda d: counts[d]) if counts else None
    return [b for b in batches if b.dataset == dataset]


def global_batches(samples: Mapping[int, Sequence[SampleBatch]], *, first_step: int, steps: int,
                   dataset: str | None = None) -> dict[int, tuple[Any, ...]]:
    """Step -> the sorted indices all ranks drew together for it, for a run that trained steps
    ``first_step``..``steps`` (the batches of ``dataset``, default the one most batches came
    from). Batches per step follow from the count (gradient accumulation draws several)."""
    per_rank = {rank: training_batches(b, dataset) for rank, b in samples.items()}
    per_rank = {rank: b for rank, b in per_rank.items() if b}
    count = steps - first_step + 1
    if not per_rank or count <= 0:
        return {}
    per_step = max(1, round(min(len(b) for b in per_rank.values()) / count))
    out: dict[int, tuple[Any, ...]] = {}
    for i in range(count):
        drawn: list[Any] = []
        for b in per_rank.values():
            for batch in b[i * per_step:(i + 1) * per_step]:
                drawn.extend(batch.indices)
        if not drawn:
            break
        out[first_step + i] = tuple(sorted(drawn, key=repr))
    return out


@dataclass(frozen=True)
class SampleAgreement:
    """Whether the resumed ranks together drew the samples the reference ranks drew per step."""

    compared_steps: int
    first_different_step: int | None = None
    #: the reference step whose samples the first different resumed step drew (None: none)
    matched_step: int | None = None
    resumed_size: int = 0
    reference_size: int = 0

    @property
    def same(self) -> bool:
        return self.first_different_step is None

    def sentence(self, n: int, m: int, *, resumed: bool = True) -> str:
        """What the ``m`` ranks drew against the ``n`` reference ranks; ``resumed``: the ``m``
        ranks resumed a run (reshard), else they ran from the start (parallel)."""
        them = f"the {m} {'resumed ' if resumed else ''}rank(s)"
        if self.same:
            return (f"{them} drew the same samples per step as the {n} reference "
                    f"rank(s) on all {self.compared_steps} steps compared")
        step = self.first_different_step
        if self.resumed_size != self.reference_size:
            return (f"at step {step} {them} drew {self.resumed_size} samples together, "
                    f"the {n} reference rank(s) {self.reference_size}: the global batch changed")
        if self.matched_step is not None:
            why = "the data position was restored as a different offset" if resumed else "their data run ahead or behind"
            return f"at step {step} {them} drew the samples of the reference's step {self.matched_step}: {why}"
        return (f"at step {step} {them} drew samples that no step of the {n}-rank "
                "reference drew together: the data order depends on the world size")


def sample_agreement(reference: Mapping[int, tuple[Any, ...]],
                     resumed: Mapping[int, tuple[Any, ...]]) -> SampleAgreement | None:
    """Compare the global batches of the resumed run with the reference's step by step."""
    ref = dict(reference)
    steps = [s for s in sorted(resumed) if s in ref]
    if not steps:
        return None
    for s in steps:
        if resumed[s] != ref[s]:
            matched = next((t for t, b in ref.items() if b == resumed[s]), None)
            return SampleAgreement(len(steps), s, matched, len(resumed[s]), len(ref[s]))
    return SampleAgreement(len(steps))


def batch_order_difference(one: Mapping[int, Sequence[SampleBatch]], many: Mapping[int, Sequence[SampleBatch]],
                           *, steps: int, dataset: str | None = None) -> tuple[int, int] | None:
    """(the first batch, batches per printed step) at which ``many`` ranks together drew other
    samples than ``one`` rank did, batch by batch: the i-th global batch of the ranks is the
    union of each rank's i-th. Only where a printed step spans several batches of both runs
    (None otherwise, or when every batch agrees): the samples of a step can agree while their
    order within it does not."""
    single = [training_batches(b, dataset) for b in one.values()]
    ranks = [training_batches(b, dataset) for b in many.values()]
    single, ranks = [b for b in single if b], [b for b in ranks if b]
    if len(single) != 1 or not ranks or steps <= 0:
        return None
    count = min(len(single[0]), *(len(b) for b in ranks))
    per_step = round(count / steps)
    if per_step < 2:
        return None
    for i in range(count):
        alone = sorted(single[0][i].indices, key=repr)
        together = sorted((x for b in ranks for x in b[i].indices), key=repr)
        if len(alone) == len(together) and alone != together:
            return i + 1, per_step
    return None
