"""The data invariants, on one run's sample records (:mod:`trainguard.launch.samples`).

The run agent records, in each rank's main process, the dataset indices of every batch a
DataLoader iterator yields: ``loader`` (the k-th DataLoader object of the process), ``iter`` (the
e-th pass over it, an epoch), ``batch`` and ``indices``. It does not record the sampler, so what
a pass is follows from its indices:

* **a pass that repeats an index within one rank** samples with replacement (or by weight): its
  samples may repeat anywhere, so nothing about repeats is said of that loader's pass;
* **a shuffled pass**: its indices are not in ascending order (the last one aside: a
  ``DistributedSampler`` with ``drop_last=False`` pads each rank's share with indices from the
  start). An unshuffled pass (a ``SequentialSampler``, ``DistributedSampler(shuffle=False)``, an
  evaluation every rank runs whole) is not judged: replaying its order is what it does, and every
  rank reading it whole is how evaluation is often run.

Two invariants:

* **no sample drawn by two ranks within an epoch**: the ranks' passes of the same loader and epoch
  share no index, but for the padding a ``DistributedSampler`` adds (at most ``world - 1``
  indices, each the last a rank draws in the epoch, the first of another's);
* **a shuffled loader does not replay the previous epoch's order** in the next (a
  ``DistributedSampler`` whose ``set_epoch`` is never called): the next shuffled pass over the
  same dataset starts with the same indices in the same order, compared on the indices both passes
  drew (at least :data:`MIN_REPLAYED`).
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from trainguard.checks.invariants_records import (
    NOTHING_ALLOWED,
    Allowed,
    Coverage,
    Finding,
    Invariant,
    matches,
)
from trainguard.launch.samples import SampleBatch

__all__ = ["MIN_REPLAYED", "DataPass", "data_findings", "epochs_of", "passes_of", "without_padding"]

#: the fewest indices two passes must share in order to call the second a replay of the first
MIN_REPLAYED = 8


@dataclass
class DataPass:
    """One pass (an epoch) of one DataLoader in one rank: its indices in the order drawn."""

    loader: int
    iter: int
    dataset: str
    indices: list[Hashable] = field(default_factory=list)
    #: the batch each index came in (its number within the pass)
    batch_of: list[int] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"loader {self.loader} ({self.dataset})"

    @property
    def repeats(self) -> bool:
        """Whether an index comes twice within this rank's pass (sampling with replacement)."""
        return len(set(self.indices)) < len(self.indices)

    @property
    def shuffled(self) -> bool:
        """Whether the indices are out of ascending order, the last one aside (padding); a pass
        of fewer than 3 indices cannot tell, and is read as not shuffled."""
        head = self.indices[:-1]
        if len(self.indices) < 3:
            return False
        if not all(isinstance(i, int) for i in head):
            return True
        return any(b <= a for a, b in itertools.pairwise(head))  # type: ignore[operator]


def _key(index: Any) -> Hashable:
    """An index as a set member: ints and strings as themselves, anything else as its JSON."""
    if isinstance(index, (int, str)) and not isinstance(index, bool):
        return index
    return json.dumps(index, sort_keys=True, default=repr)


def passes_of(batches: Sequence[SampleBatch]) -> list[DataPass]:
    """One rank's passes, in the order each started."""
    out: dict[tuple[int, int], DataPass] = {}
    for batch in batches:
        found = out.get((batch.loader, batch.iter))
        if found is None:
            found = out[(batch.loader, batch.iter)] = DataPass(batch.loader, batch.iter, batch.dataset)
        keys = [_key(i) for i in batch.indices]
        found.indices += keys
        found.batch_of += [batch.batch] * len(keys)
    return list(out.values())


def epochs_of(rank_passes: Sequence[DataPass]) -> dict[tuple[int, int], int]:
    """Each pass's epoch: how many passes over its dataset the rank made before it (a loader made
    anew each epoch is at its own pass 0 every epoch; the job is at this number)."""
    over: dict[str, int] = {}
    out = {}
    for p in rank_passes:
        out[(p.loader, p.iter)] = over[p.dataset] = over.get(p.dataset, -1) + 1
    return out


def data_findings(samples: Mapping[int, Sequence[SampleBatch]], *,
                  allowed: Allowed = NOTHING_ALLOWED) -> tuple[list[Finding], Coverage]:
    """Samples drawn by two ranks within an epoch, and shuffled passes that replay the previous
    one's order, with what was compared."""
    passes = {rank: passes_of(batches) for rank, batches in samples.items() if batches}
    if not passes:
        return [], Coverage(Invariant.DATA, 0, "", "no sample records: the job iterated no DataLoader over a "
                                                   "map-style dataset (or job.record_samples is false)")
    passes, padded = without_padding(passes)
    shared, shared_compared, left = _shared_samples(passes, allowed)
    replays, replay_compared = _replays(passes, allowed)
    compared = shared_compared + replay_compared
    what = (f"{shared_compared} epoch(s) of shuffled loaders compared across {len(passes)} rank(s) for samples "
            f"drawn twice; {replay_compared} pair(s) of consecutive shuffled passes compared for a replayed order")
    if padded:
        what += (f" ({len(padded)} pass(es) whose last batch ends with indices of the epoch's first batches, "
                 f"accelerate's even_batches padding, read without them: {', '.join(sorted(padded)[:3])})")
    return shared + replays, Coverage(Invariant.DATA, compared, what if compared else "", "; ".join(left))


def without_padding(passes: Mapping[int, list[DataPass]]) -> tuple[dict[int, list[DataPass]], set[str]]:
    """Each rank's passes without the padding at the end of its last batch: the indices there that
    the epoch's first batches (batch 0 of any rank) drew, up to the first that is not one.
    accelerate (``even_batches``, its default) fills the short last batches of an epoch from the
    first ``world`` batches, the ranks' first ones; a ``DistributedSampler`` pads each rank's
    share with the order's first indices, the same way. Read with the padding, the pass repeats an
    index (read as sampling with replacement: not judged) or two ranks draw one sample. Also the
    ``loader (epoch)`` names of the passes that lost more than one index (a DistributedSampler
    pads one a rank)."""
    epochs: dict[tuple[int, int], dict[int, DataPass]] = {}
    for rank, rank_passes in passes.items():
        for p in rank_passes:
            epochs.setdefault((p.loader, p.iter), {})[rank] = p
    cut: dict[tuple[int, int, int], DataPass] = {}
    padded: set[str] = set()
    for (loader, it), by_rank in epochs.items():
        firsts = {i for p in by_rank.values() for i, b in zip(p.indices, p.batch_of, strict=True) if b == p.batch_of[0]}
        for rank, p in by_rank.items():
            tail = 0
            while (tail < len(p.indices) and p.batch_of[-1 - tail] == p.batch_of[-1] != p.batch_of[0]
                   and p.indices[-1 - tail] in firsts):
                tail += 1
            if tail:
                cut[(rank, loader, it)] = DataPass(loader, it, p.dataset, p.indices[:-tail], p.batch_of[:-tail])
                if tail > 1:
                    padded.add(f"{p.name} (epoch {it})")
    out = {rank: [cut.get((rank, p.loader, p.iter), p) for p in rank_passes] for rank, rank_passes in passes.items()}
    return out, padded


def _shared_samples(passes: Mapping[int, list[DataPass]],
                    allowed: Allowed) -> tuple[list[Finding], int, list[str]]:
    """The epochs in which ranks drew the same samples, beyond a DistributedSampler's padding."""
    if len(passes) < 2:
        return [], 0, ["one rank drew samples: no sample can be drawn by two"]
    epochs: dict[tuple[int, int], dict[int, DataPass]] = {}
    epoch_of: dict[tuple[int, int], int] = {}
    for rank, rank_passes in passes.items():
        epoch_of = {**epochs_of(rank_passes), **epoch_of}
        for p in rank_passes:
            epochs.setdefault((p.loader, p.iter), {})[rank] = p
    findings: list[Finding] = []
    compared = 0
    unshuffled: set[str] = set()
    replacement: set[str] = set()
    for key in sorted(epochs):
        by_rank = epochs[key]
        any_pass = next(iter(by_rank.values()))
        if len(by_rank) < 2 or matches(any_pass.dataset, allowed.shared_samples):
            continue
        if any(p.repeats for p in by_rank.values()):
            replacement.add(any_pass.name)
            continue
        if not any(p.shuffled for p in by_rank.values()):
            unshuffled.add(any_pass.name)
            continue
        compared += 1
        found = _drawn_twice(by_rank, epoch_of[key])
        if found is not None and not any(f.name == found.name for f in findings):  # the first epoch per loader
            findings.append(found)
    left = []
    if replacement:
        left.append(f"{', '.join(sorted(replacement))}: an index repeats within one rank's epoch (sampling with "
                    "replacement): repeats across ranks not judged")
    if unshuffled:
        left.append(f"{', '.join(sorted(unshuffled))}: unshuffled (indices in order): not judged")
    return findings, compared, left


def _drawn_twice(by_rank: Mapping[int, DataPass], epoch: int) -> Finding | None:
    """The finding for one loader's epoch whose ranks drew the same samples, else None."""
    seen: dict[Hashable, list[tuple[int, int]]] = {}
    for rank, p in sorted(by_rank.items()):
        for position, index in enumerate(p.indices):
            seen.setdefault(index, []).append((rank, position))
    last = {rank: len(p.indices) - 1 for rank, p in by_rank.items()}
    twice = {i: where for i, where in seen.items() if len(where) > 1}
    # a DistributedSampler's padding: each repeat the last index of its rank, at most world - 1
    padding = sum(len(w) - 1 for w in twice.values())
    if padding <= len(by_rank) - 1 and all(
            sum(1 for r, pos in w if pos == last[r]) >= len(w) - 1 for w in twice.values()):
        return None
    a_pass = next(iter(by_rank.values()))
    ranks = tuple(sorted({r for w in twice.values() for r, _ in w}))
    shown = []
    for index, where in list(twice.items())[:3]:
        drawn = " and ".join(f"rank {r} (batch {by_rank[r].batch_of[pos]})" for r, pos in where)
        shown.append(f"sample {index} by {drawn}")
    observation = (f"{len(twice)} sample(s) drawn by more than one rank in the epoch, beyond a sampler's padding: "
                   + "; ".join(shown))
    fix = ("shard the data across the ranks (a DistributedSampler with the world size and the rank, or the "
           "framework's); if every rank reads the whole dataset on purpose, add "
           f"{a_pass.dataset!r} to checks.invariants.allow.shared_samples")
    return Finding(Invariant.DATA, None, ranks, a_pass.name, observation, fix, epoch)


def _replays(passes: Mapping[int, list[DataPass]], allowed: Allowed) -> tuple[list[Finding], int]:
    """Shuffled passes that start with the previous shuffled pass's order over the same dataset,
    the first per loader (ranks together). The epoch named is the pass's over its dataset: a
    loader made anew each epoch is at its own pass 0 in every epoch, its pass over the data at the
    job's epoch."""
    hits: dict[tuple[int, int], tuple[DataPass, DataPass, list[int], int]] = {}
    compared = 0
    for rank, rank_passes in sorted(passes.items()):
        previous: dict[str, DataPass] = {}
        epochs = epochs_of(rank_passes)
        for p in rank_passes:
            if not p.shuffled or p.repeats or matches(p.dataset, allowed.same_order):
                continue
            before = previous.get(p.dataset)
            previous[p.dataset] = p
            if before is None:
                continue
            shared = min(len(p.indices), len(before.indices))
            if shared < MIN_REPLAYED:
                continue
            compared += 1
            if p.indices[:shared] == before.indices[:shared]:
                hits.setdefault((p.loader, p.iter), (before, p, [], epochs[(p.loader, p.iter)]))[2].append(rank)
    findings: list[Finding] = []
    for before, again, ranks, epoch in hits.values():
        if any(f.name == again.name for f in findings):
            continue
        since = f"epoch {before.iter}" if before.loader == again.loader else before.name + f"'s epoch {before.iter}"
        observation = (f"this shuffled pass draws the same indices in the same order as {since} "
                       f"(first: {', '.join(map(str, again.indices[:5]))}, ...)")
        fix = ("call sampler.set_epoch(epoch) before each epoch (a DistributedSampler shuffles by seed + epoch), or "
               "give the loader a generator that advances; if the order is the same every epoch on purpose, add "
               f"{again.dataset!r} to checks.invariants.allow.same_order")
        findings.append(Finding(Invariant.DATA, None, tuple(ranks), again.name, observation, fix, epoch))
    return findings, compared
