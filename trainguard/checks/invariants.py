"""The invariants every correct data-parallel training step keeps, checked on one run's records.

Two runs that differ show a defect to the equivalence checks; the costliest ones show in no
comparison: ranks whose replicas drift apart, a sampler that replays one order every epoch. Each
of those breaks something a correct run keeps at every step, and the run agent's records of a
single run show it (docs/invariants.md):

* **replicas agree** (:func:`replica_findings`): in a data-parallel run every rank holds the same
  parameters (their fingerprints before step N+1 are those after step N), the same optimizer
  state, and, at the optimizer step, the same gradients (after their reduction). A DTensor whose
  placement shards it (``Shard``) is not compared across ranks: only wholly replicated tensors
  are. A tensor whose ranks differ already at its first recorded step is not a replica (a
  tensor-parallel shard of a plain tensor, a model per rank) and is not compared either; the
  result says which.
* **every parameter an optimizer steps gets a gradient** at some step
  (:mod:`trainguard.checks.invariants_training`): one that never does is in the optimizer and never
  trains (a module replaced after the optimizer was built, a layer frozen by mistake);
* **the loss scaler backs off** after a step it skipped (the same module): a scale that does not
  fall after an overflow was never updated;
* **the data** (:mod:`trainguard.checks.invariants_data`): within an epoch no sample is drawn by
  two ranks, and a shuffled loader does not replay its previous epoch's order;
* from the agent's param-group, model, mode and clip records
  (:mod:`trainguard.checks.invariants_steps`): every trainable parameter the forward uses is in one
  optimizer's param group, an fp32 parameter's updates change it, gradients start from zero at
  each step, no dropout or batch norm runs in eval mode while training nor in training mode in a
  validation, and gradients are clipped after the loss scaler's ``unscale_``.

:func:`check_invariants` runs them all and returns :class:`Invariants`: the findings (each names
the invariant, the step, the ranks, the tensor or loader, what was observed and the fix, with the
setting that declares an intended exception) and what was compared, so a result that compared
nothing is never read as a pass.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from trainguard.checks.invariants_data import data_findings
from trainguard.checks.invariants_records import (
    NOTHING_ALLOWED,
    Allowed,
    Coverage,
    Finding,
    Invariant,
    Invariants,
    matches,
)
from trainguard.checks.invariants_steps import step_field_findings
from trainguard.checks.invariants_training import gradient_findings, scaler_findings
from trainguard.launch.samples import SampleBatch
from trainguard.launch.step_fields import ParamsRecord
from trainguard.launch.steps import Fingerprint, StepRecord, StepRecords

__all__ = ["MAX_FINDINGS", "check_invariants", "dp_groups", "replica_findings", "replicated", "shard_groups"]

#: findings kept per invariant and step kind (a drift spreads to every tensor within a step or two)
MAX_FINDINGS = 20


def check_invariants(steps: StepRecords, samples: Mapping[int, Sequence[SampleBatch]], *,
                     allowed: Allowed = NOTHING_ALLOWED) -> Invariants:
    """Every invariant today's records can show, on one run's step records (:func:`read_steps`)
    and sample records (:func:`~trainguard.launch.samples.read_samples`)."""
    replicas, replica_cover = replica_findings(steps, allowed=allowed)
    gradients, gradient_cover = gradient_findings(steps, allowed=allowed)
    scaler, scaler_cover = scaler_findings(steps)
    data, data_cover = data_findings(samples, allowed=allowed)
    fields = step_field_findings(steps, allowed=allowed)
    return Invariants((*replicas, *gradients, *scaler, *data, *(f for found, _ in fields for f in found)),
                      (replica_cover, gradient_cover, scaler_cover, data_cover, *(c for _, c in fields)),
                      tuple(steps.notes()))


# -- replicas agree -------------------------------------------------------------------------------


def replicated(placement: str | None) -> bool:
    """Whether a tensor of this placement is whole on every rank: no placement (a plain tensor),
    or every mesh dimension ``Replicate()``."""
    if placement is None:
        return True
    dims = [d.strip() for d in placement.strip("()[] ").split("),") if d.strip()]
    return all(d.startswith("Replicate") for d in dims)


#: the quantities compared, in the order a step is read: what the step started from, then its gradients
_KINDS = (("parameter", "param"), ("optimizer state", "optim"), ("gradient", "grad"))


@dataclass(frozen=True)
class _Split:
    """A tensor whose ranks disagree at a step: rank -> its fingerprint (None: absent)."""

    kind: str
    name: str
    values: Mapping[int, Fingerprint | None]

    def minority(self) -> tuple[tuple[int, ...], bool]:
        """(the ranks outside the largest group of equal values, True) when one group is the
        largest; else (every rank, False)."""
        groups: dict[Fingerprint | None, list[int]] = {}
        for rank, value in self.values.items():
            groups.setdefault(value, []).append(rank)
        sizes = sorted((len(g) for g in groups.values()), reverse=True)
        if len(sizes) > 1 and sizes[0] > sizes[1]:
            largest = max(groups.values(), key=len)
            return tuple(sorted(r for r in self.values if r not in largest)), True
        return tuple(sorted(self.values)), False

    def observation(self) -> str:
        shown = ", ".join(f"rank {r}: {'absent' if v is None else v}" for r, v in sorted(self.values.items()))
        ranks, majority = self.minority()
        who = (f"rank(s) {', '.join(map(str, ranks))} differ from the others" if majority
               else "no majority tells which rank drifted")
        return f"the {self.kind} differs across replicas ({who}): {shown}"


def replica_findings(steps: StepRecords, *, allowed: Allowed = NOTHING_ALLOWED) -> tuple[list[Finding], Coverage]:
    """The first step at which the ranks' replicas of a tensor differ, per optimizer: each tensor
    that differs there is a finding (parameters and optimizer state before the update first, then
    the gradients at the step); the coverage counts the tensors compared at each step."""
    ranks = {r: rank for r, rank in steps.ranks.items() if rank.steps}
    if len(ranks) < 2:
        reason = ("one rank recorded steps: replicas need two or more" if ranks else "no rank recorded a step")
        return [], Coverage(Invariant.REPLICAS, 0, "", reason)
    findings: list[Finding] = []
    compared = 0
    not_replicas: set[str] = set()
    sharded: set[str] = set()
    grouped: set[str] = set()
    in_dp: set[str] = set()
    dp_seen: set[tuple[int, ...]] = set()
    optimizers = sorted({o for rank in ranks.values() for o in rank.optimizers})
    for opt in optimizers:
        by_rank = {r: rank.of(opt) for r, rank in ranks.items()}
        common = sorted(set.intersection(*(set(s) for s in by_rank.values())))
        if not common:
            continue
        first = {r: s[common[0]] for r, s in by_rank.items()}
        lines = _params_lines(steps, opt)
        dp = dp_groups({r: line.dp_ranks for r, line in lines.items()}, first)
        peers = _replica_names(first, allowed, not_replicas, sharded, {r: line.mesh for r, line in lines.items()}, dp)
        grouped.update(name for name, groups in peers.items()
                       if groups != [tuple(sorted(first))] and not all(replicated(s.placement.get(name))
                                                                      for s in first.values()))
        in_dp.update(name for name, groups in peers.items() if dp and groups == dp
                     and all(replicated(s.placement.get(name)) for s in first.values()))
        dp_seen.update(dp)
        for n in common:
            at = {r: s[n] for r, s in by_rank.items()}
            splits = _splits(at, peers)
            compared += sum(len(groups) for groups in peers.values())
            if splits:
                findings += _as_findings(splits, n, opt)
                break
    what = f"{compared} tensor-steps compared across {len(ranks)} ranks"
    if grouped:
        what += (f", {len(grouped)} sharded tensor(s) among the ranks holding the same shard (replicas along "
                 f"the Replicate dimensions of their device mesh: {_some(grouped)})")
    if in_dp:
        what += (f", {len(in_dp)} tensor(s) within their data-parallel groups (the process groups of the DDP "
                 f"wrappers: ranks {'; '.join(', '.join(map(str, g)) for g in sorted(dp_seen))}: {_some(in_dp)})")
    left = []
    if sharded:
        left.append(f"{len(sharded)} sharded tensor(s) not compared across ranks (a Shard placement: "
                    f"{_some(sharded)})")
    if not_replicas:
        left.append(f"{len(not_replicas)} tensor(s) differ across ranks at their first step, so are not "
                    f"replicas and were not compared ({_some(not_replicas)})")
    return findings, Coverage(Invariant.REPLICAS, compared, what, "; ".join(left))


def _params_lines(steps: StepRecords, opt: int) -> dict[int, ParamsRecord]:
    """Each rank's last ``params`` line of optimizer ``opt``: its DTensor parameters' mesh
    coordinates (``mesh``) and its DDP wrapper's data-parallel group (``dp_ranks``)."""
    out: dict[int, ParamsRecord] = {}
    for r, rank in steps.ranks.items():
        for record in rank.params:
            if record.opt == opt:
                out[r] = record
    return out


def dp_groups(recorded: Mapping[int, Sequence[int]], ranks: Iterable[int]) -> list[tuple[int, ...]]:
    """The data-parallel groups among ``ranks`` (each rank's ``dp_ranks``: its DDP wrapper's
    process group), two ranks or more a group; [] unless every rank recorded a group holding
    itself, and each rank of that group recorded the same one (a partition of the ranks)."""
    among = sorted(ranks)
    groups: set[tuple[int, ...]] = set()
    for r in among:
        group = tuple(sorted(recorded.get(r, ())))
        if r not in group or any(tuple(sorted(recorded.get(m, ()))) != group for m in group if m in among):
            return []
        groups.add(tuple(m for m in group if m in among))
    return sorted(g for g in groups if len(g) > 1)


_PLACEMENT = re.compile(r"(Replicate|_StridedShard|Shard|Partial)\(")


def shard_groups(placement: str | None, coordinates: Mapping[int, tuple[int, ...] | None]) -> list[tuple[int, ...]]:
    """The ranks that hold the same shard of a sharded tensor (HSDP): equal coordinates on every
    mesh dimension that is not ``Replicate()``, two or more ranks a group. [] when a rank's
    coordinates are unknown or do not match the placements' dimensions."""
    kinds = _PLACEMENT.findall(placement or "")
    if not kinds or "Replicate" not in kinds:
        return []
    keys: dict[tuple[int, ...], list[int]] = {}
    for rank, coordinate in coordinates.items():
        if coordinate is None or len(coordinate) != len(kinds):
            return []
        keys.setdefault(tuple(c for c, kind in zip(coordinate, kinds) if kind != "Replicate"), []).append(rank)
    return [tuple(sorted(g)) for _, g in sorted(keys.items()) if len(g) > 1]


def _replica_names(first: Mapping[int, StepRecord], allowed: Allowed, not_replicas: set[str],
                   sharded: set[str], meshes: Mapping[int, Mapping[str, tuple[int, ...]]],
                   dp: Sequence[tuple[int, ...]] = ()) -> dict[str, list[tuple[int, ...]]]:
    """The parameters every rank records for this optimizer, not declared per rank, each with the
    groups of ranks holding the same values: every rank for a tensor whole on each (each
    data-parallel group ``dp`` when the ranks' DDP wrappers were given one: beside tensor
    parallelism, a plain tensor is one rank's shard, equal only within its group); for a sharded
    DTensor, the ranks equal on its ``Shard`` mesh dimensions (HSDP's replicas). Kept when each
    group is equal at the first common step."""
    names = set.intersection(*(set(s.param) for s in first.values()))
    out: dict[str, list[tuple[int, ...]]] = {}
    for name in sorted(names):
        if matches(name, allowed.per_rank):
            continue
        if all(replicated(s.placement.get(name)) for s in first.values()):
            groups = list(dp) or [tuple(sorted(first))]
        else:
            placement = next(iter(first.values())).placement.get(name)
            groups = shard_groups(placement, {r: meshes.get(r, {}).get(name) for r in first})
            if not groups or any(first[r].placement.get(name) != placement for r in first):
                sharded.add(name)
                continue
        if any(len({first[r].param[name] for r in group}) > 1 for group in groups):
            not_replicas.add(name)
        else:
            out[name] = groups
    return out


def _splits(at: Mapping[int, StepRecord], peers: Mapping[str, Sequence[tuple[int, ...]]]) -> list[_Split]:
    out = []
    for kind, attr in _KINDS:
        for name, groups in peers.items():
            for group in groups:
                if any(getattr(at[r], attr) is None for r in group):
                    continue  # an optimizer state not read at this step on one of them: not compared
                values = {r: getattr(at[r], attr).get(name) for r in group}
                if kind == "optimizer state":  # held by some ranks only under ZeRO: compared where held
                    values = {r: v for r, v in values.items() if v is not None}
                if len(set(values.values())) > 1:
                    out.append(_Split(kind, name, values))
    return out


def _as_findings(splits: Sequence[_Split], step: int, opt: int) -> list[Finding]:
    out = []
    for split in splits[:MAX_FINDINGS]:
        ranks, _ = split.minority()
        out.append(Finding(Invariant.REPLICAS, step, ranks, split.name, split.observation(), _replica_fix(split), None,
                           opt))
    return out


def _replica_fix(split: _Split) -> str:
    where = ("before this step (what the previous step or code between steps left)" if split.kind != "gradient"
             else "in this step's backward (a forward outside the DDP wrapper, a gradient changed on one rank after "
             "its reduction, clipping or scaling on one rank only)")
    return (f"find what changed {split.name} on one rank only {where}: an in-place change of a parameter outside "
            "the optimizer (param.data, a load on one rank), a rank-dependent branch; if it differs per rank on "
            f"purpose, add {split.name!r} to checks.invariants.allow.per_rank")


def _some(names: Iterable[str], limit: int = 3) -> str:
    listed = sorted(names)
    more = f" and {len(listed) - limit} more" if len(listed) > limit else ""
    return ", ".join(listed[:limit]) + more
