"""The invariants of one run's records (trainguard.checks.invariants, docs/invariants.md): each
with a planted defect it must name (step, ranks, tensor or loader) and a clean twin it must pass.

The step records are written in the agent's format (tests/steplines.py) and read back with
``read_steps``; the sample records are the indices torch's own samplers draw."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch.utils.data import DistributedSampler, RandomSampler, SequentialSampler

from tests.steplines import PARAMS, Step, params_line, trajectory, write_rank, write_samples
from trainguard.checks.invariants import check_invariants, dp_groups, replica_findings, replicated
from trainguard.checks.invariants_data import data_findings
from trainguard.checks.invariants_records import Allowed, Invariant
from trainguard.checks.invariants_training import gradient_findings, scaler_findings
from trainguard.launch.samples import SampleBatch, read_samples
from trainguard.launch.step_fields import params_record
from trainguard.launch.steps import read_steps

# -- replicas ---------------------------------------------------------------------------------------


def _ranks(tmp_path: Path, per_rank: dict[int, list[Step]]) -> Path:
    for rank, steps in per_rank.items():
        write_rank(tmp_path, rank, steps)
    return tmp_path


def _drifted(steps: list[Step], first: int, name: str, seed: int) -> list[Step]:
    """``steps`` with parameter ``name`` other from step ``first`` on (a change one rank made)."""
    return [replace(s, param_of={name: seed + s.n}) if s.n >= first else s for s in steps]


def test_replicas_that_agree_at_every_step_are_no_finding(tmp_path: Path) -> None:
    run = _ranks(tmp_path, {r: trajectory(1, 8) for r in range(3)})
    findings, cover = replica_findings(read_steps(run))
    assert findings == []
    assert cover.compared == 8 * len(PARAMS) and "3 ranks" in cover.what and not cover.reason


def test_a_parameter_one_rank_changed_is_named_at_the_first_step_with_the_minority_rank(tmp_path: Path) -> None:
    steps = trajectory(1, 8)
    run = _ranks(tmp_path, {0: steps, 1: _drifted(steps, 5, "fc1.bias", 77_000), 2: steps})
    findings, _ = replica_findings(read_steps(run))
    (found,) = findings
    assert (found.invariant, found.step, found.ranks, found.name) == (Invariant.REPLICAS, 5, (1,), "fc1.bias")
    assert "the parameter differs across replicas (rank(s) 1 differ from the others)" in found.observation
    assert "allow.per_rank" in found.fix and "'fc1.bias'" in found.fix


def test_two_ranks_that_part_name_both_for_no_majority_tells(tmp_path: Path) -> None:
    steps = trajectory(1, 6)
    run = _ranks(tmp_path, {0: steps, 1: _drifted(steps, 4, "fc2.weight", 5_000)})
    (found,) = replica_findings(read_steps(run))[0]
    assert (found.step, found.ranks, found.name) == (4, (0, 1), "fc2.weight")
    assert "no majority tells which rank drifted" in found.observation


def test_a_gradient_one_rank_did_not_reduce_is_named(tmp_path: Path) -> None:
    steps = trajectory(1, 6)
    bypassed = [replace(s, grad_of={"fc1.weight": 99}) if s.n == 3 else s for s in steps]
    run = _ranks(tmp_path, {0: steps, 1: steps, 2: bypassed})
    (found,) = replica_findings(read_steps(run))[0]
    assert (found.step, found.ranks, found.name) == (3, (2,), "fc1.weight")
    assert found.observation.startswith("the gradient differs") and "backward" in found.fix


def test_optimizer_state_is_compared_where_ranks_hold_it(tmp_path: Path) -> None:
    # a ZeroRedundancyOptimizer: each rank holds the state of its own part of the parameters
    steps = trajectory(1, 4)
    part = [replace(s, no_optim=True) for s in steps]
    assert replica_findings(read_steps(_ranks(tmp_path / "zero", {0: steps, 1: part, 2: steps})))[0] == []
    other = [replace(s, optim_of={"fc1.bias": 9_000 + s.n}) if s.n >= 3 else s for s in steps]
    (found,) = replica_findings(read_steps(_ranks(tmp_path / "drift", {0: steps, 1: part, 2: other})))[0]
    assert (found.step, found.ranks, found.name) == (3, (0, 2), "fc1.bias")
    assert found.observation.startswith("the optimizer state differs") and "rank 1" not in found.observation


def test_a_declared_per_rank_tensor_is_not_compared(tmp_path: Path) -> None:
    steps = trajectory(1, 6)
    run = _ranks(tmp_path, {0: steps, 1: _drifted(steps, 2, "fc1.bias", 3_000)})
    findings, cover = replica_findings(read_steps(run), allowed=Allowed(per_rank=("*.bias",)))
    assert findings == [] and cover.compared == 6 * (len(PARAMS) - 1)


def test_sharded_dtensors_are_not_compared_and_replicated_ones_are(tmp_path: Path) -> None:
    placement = {"fc1.weight": "(Shard(dim=0),)", "fc1.bias": "(Replicate(),)", "fc2.weight": "(Replicate(), Shard(dim=0))"}
    steps = [replace(s, placement=placement) for s in trajectory(1, 4)]
    # each rank holds its own shard of the sharded tensors: they differ from the first step
    shards = [replace(s, param_of={"fc1.weight": 10 + s.n, "fc2.weight": 20 + s.n}) for s in steps]
    findings, cover = replica_findings(read_steps(_ranks(tmp_path / "clean", {0: steps, 1: shards})))
    assert findings == [] and cover.compared == 4 and "2 sharded tensor(s)" in cover.reason
    drift = _drifted(shards, 3, "fc1.bias", 4_000)
    (found,) = replica_findings(read_steps(_ranks(tmp_path / "drift", {0: steps, 1: drift})))[0]
    assert (found.step, found.name) == (3, "fc1.bias")
    assert replicated(None) and replicated("(Replicate(), Replicate())") and not replicated("(Partial(sum),)")


def test_tensors_that_differ_from_the_first_step_are_no_replicas_and_said_so(tmp_path: Path) -> None:
    steps = trajectory(1, 4)
    other = [replace(s, param_of={"fc2.weight": 500 + s.n}) for s in steps]  # a per-rank head, a TP shard
    findings, cover = replica_findings(read_steps(_ranks(tmp_path, {0: steps, 1: other})))
    assert findings == [] and "differ across ranks at their first step" in cover.reason
    assert "fc2.weight" in cover.reason


def test_one_rank_compares_nothing_and_says_why(tmp_path: Path) -> None:
    findings, cover = replica_findings(read_steps(_ranks(tmp_path, {0: trajectory(1, 4)})))
    assert findings == [] and cover.compared == 0 and "one rank" in cover.reason


# -- every parameter an optimizer steps gets a gradient ---------------------------------------------


def test_parameters_with_a_gradient_at_some_step_are_no_finding(tmp_path: Path) -> None:
    # an expert a batch did not route to has none at some steps
    steps = [replace(s, no_grad=("fc2.weight",)) if s.n % 2 else s for s in trajectory(1, 6)]
    findings, cover = gradient_findings(read_steps(_ranks(tmp_path, {0: steps, 1: steps})))
    assert findings == [] and cover.compared == 2 * len(PARAMS) and cover.invariant is Invariant.TRAINS


def test_a_parameter_the_optimizer_steps_that_never_gets_a_gradient_is_named(tmp_path: Path) -> None:
    # a layer frozen by mistake after the optimizer was built: in it, never a gradient
    steps = [replace(s, no_grad=("fc1.bias",)) for s in trajectory(1, 4)]
    findings, _ = gradient_findings(read_steps(_ranks(tmp_path / "frozen", {0: steps, 1: steps})))
    (found,) = findings
    assert (found.invariant, found.step, found.ranks, found.name) == (Invariant.TRAINS, 1, (0, 1), "fc1.bias")
    assert "no gradient at any of its 4 recorded steps" in found.observation and "allow.frozen" in found.fix
    assert gradient_findings(read_steps(tmp_path / "frozen"), allowed=Allowed(frozen=("fc1.*",)))[0] == []
    # one step is too few to say
    findings, cover = gradient_findings(read_steps(_ranks(tmp_path / "short", {0: steps[:1]})))
    assert findings == [] and cover.compared == 0 and "fewer than 2 steps" in cover.reason


def test_the_parameters_of_a_module_replaced_after_the_optimizer_was_built_are_named_so(tmp_path: Path) -> None:
    # the agent names a parameter no module holds by its place in the optimizer
    path = write_rank(tmp_path, 0, [replace(s, no_grad=("fc2.weight",)) for s in trajectory(1, 3)])
    path.write_text(path.read_text().replace('"fc2.weight"', '"group0.2"'))
    (found,) = gradient_findings(read_steps(tmp_path))[0]
    assert found.name == "group0.2" and "replaced after the optimizer was built" in found.observation


# -- the loss scaler ---------------------------------------------------------------------------------


def _scaled(scales: list[float], skipped: set[int]) -> list[Step]:
    return [replace(s, scale=scales[s.n - 1], skipped=s.n in skipped) for s in trajectory(1, len(scales))]


def test_a_scaler_that_backs_off_after_a_skipped_step_is_no_finding(tmp_path: Path) -> None:
    steps = _scaled([65536.0, 32768.0, 32768.0, 16384.0, 16384.0], {1, 3})
    findings, cover = scaler_findings(read_steps(_ranks(tmp_path, {0: steps})))
    assert findings == [] and cover.compared == 2
    findings, cover = scaler_findings(read_steps(_ranks(tmp_path / "none", {0: trajectory(1, 3)})))
    assert findings == [] and cover.compared == 0 and "no step skipped" in cover.reason


def test_a_scaler_never_updated_is_named_at_the_skipped_step(tmp_path: Path) -> None:
    # scaler.update() missing: the scale that overflowed stays, and the next steps skip too
    steps = _scaled([65536.0] * 5, {2, 3, 4, 5})
    (found,) = scaler_findings(read_steps(_ranks(tmp_path, {0: steps, 1: steps})))[0]
    assert (found.invariant, found.step, found.ranks, found.name) == (Invariant.SCALER, 2, (0, 1), "optimizer 0's loss scaler")
    assert "did not back off" in found.observation and "scaler.update()" in found.fix


# -- data -------------------------------------------------------------------------------------------

N = 50


def _batches(per_epoch: list[list[int]], batch: int = 4, loader: int = 0) -> list[SampleBatch]:
    out = []
    for epoch, indices in enumerate(per_epoch):
        for b, start in enumerate(range(0, len(indices), batch)):
            out.append(SampleBatch(loader, f"TensorDataset({N})", epoch, b, indices[start:start + batch]))
    return out


def _distributed(world: int, epochs: int, *, set_epoch: bool = True, drop_last: bool = False) -> dict[int, list[SampleBatch]]:
    data = list(range(N))
    out = {}
    for rank in range(world):
        sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=3, drop_last=drop_last)
        drawn = []
        for epoch in range(epochs):
            if set_epoch:
                sampler.set_epoch(epoch)
            drawn.append(list(sampler))
        out[rank] = _batches(drawn)
    return out


def test_a_distributed_sampler_with_set_epoch_and_its_padding_is_no_finding() -> None:
    for world, drop_last in ((3, False), (4, False), (2, True)):  # 50 = 3 * 17 - 1 = 4 * 13 - 2: padding
        findings, cover = data_findings(_distributed(world, 3, drop_last=drop_last))
        assert findings == [], (world, findings)
        assert cover.compared == 3 + 2 * world, (world, cover)


def test_a_sampler_whose_set_epoch_is_never_called_is_named_at_the_next_epoch() -> None:
    findings, _ = data_findings(_distributed(2, 3, set_epoch=False))
    (found,) = findings
    assert (found.invariant, found.epoch, found.ranks, found.name) == (Invariant.DATA, 1, (0, 1), f"loader 0 (TensorDataset({N}))")
    assert "same order as epoch 0" in found.observation and "set_epoch" in found.fix
    assert data_findings(_distributed(2, 3, set_epoch=False), allowed=Allowed(same_order=("TensorDataset(*)",)))[0] == []


def test_ranks_that_read_the_same_shuffled_data_are_named() -> None:
    # no DistributedSampler: each rank shuffles the whole dataset (the same seed, or its own)
    for seeds in ((7, 7), (7, 8)):
        samples = {rank: _batches([list(RandomSampler(range(N), generator=torch.Generator().manual_seed(s)))])
                   for rank, s in enumerate(seeds)}
        (found,) = data_findings(samples)[0]
        assert (found.epoch, found.ranks) == (0, (0, 1)) and f"{N} sample(s) drawn by more than one rank" in found.observation
        assert "DistributedSampler" in found.fix and "allow.shared_samples" in found.fix
    assert data_findings(samples, allowed=Allowed(shared_samples=(f"TensorDataset({N})",)))[0] == []


def test_replacement_and_unshuffled_loaders_are_not_judged_and_said_so() -> None:
    with_replacement = {rank: _batches([list(RandomSampler(range(N), replacement=True,
                                                           generator=torch.Generator().manual_seed(rank)))
                                        for _ in range(2)]) for rank in range(2)}
    findings, cover = data_findings(with_replacement)
    assert findings == [] and "sampling with replacement" in cover.reason
    # every rank evaluates the whole set in order, every epoch
    unshuffled = {rank: _batches([list(SequentialSampler(range(N)))] * 2) for rank in range(2)}
    findings, cover = data_findings(unshuffled)
    assert findings == [] and cover.compared == 0 and "unshuffled" in cover.reason


def test_a_loader_made_anew_each_epoch_still_shows_the_replay() -> None:
    order = list(RandomSampler(range(N), generator=torch.Generator().manual_seed(1)))
    samples = {0: _batches([order], loader=0) + _batches([order], loader=1)}
    (found,) = data_findings(samples)[0]
    assert found.name == f"loader 1 (TensorDataset({N}))" and "loader 0" in found.observation
    # the job's epoch 1 (the second pass over the data), not the new loader's own first pass
    assert found.epoch == 1, found


def _accelerate_lines(tmp_path: Path, *, world: int = 2, epochs: int = 3, reseed: bool = True,
                      rank_of: tuple[int, ...] = (0, 1)) -> dict[int, list[SampleBatch]]:
    """The sample lines of a loop on ``accelerator.prepare(DataLoader(..., shuffle=True))`` over 65
    blocks, batches of 8, at 2 ranks: accelerate's own ``BatchSamplerShard`` (``even_batches``:
    the short last batches filled from the epoch's first ones), a seeded sampler reseeded each
    epoch (or not), each rank the shard ``rank_of[rank]``; written as the agent writes them and
    read back."""
    from accelerate.data_loader import BatchSamplerShard
    from torch.utils.data import BatchSampler

    from trainguard.launch.hook import SAMPLES_DIR

    folder = tmp_path / SAMPLES_DIR
    folder.mkdir(parents=True)
    for rank in range(world):
        lines = []
        for epoch in range(epochs):
            sampler = RandomSampler(range(65), generator=torch.Generator().manual_seed(42 + (epoch if reseed else 0)))
            shard = BatchSamplerShard(BatchSampler(sampler, 8, drop_last=False), num_processes=world,
                                      process_index=rank_of[rank])
            lines += [json.dumps({"loader": 0, "dataset": "ConcatDataset(65)", "iter": epoch, "batch": b,
                                  "indices": list(batch)}) + "\n" for b, batch in enumerate(shard)]
        (folder / f"rank{rank}.jsonl").write_text("".join(lines))
    return read_samples(tmp_path)


def test_accelerates_tail_padding_is_no_sampling_with_replacement_and_the_epoch_is_judged(tmp_path: Path) -> None:
    """accelerate fills the ranks' short last batches (65 = 4 x 16 + 1 samples at 2 x 8) from the
    epoch's first batches: each rank draws 7 of its own first indices again, rank 1 also one of rank 0's first batch.
    Read without that tail, every epoch is compared (no sample drawn twice) and so is each pair of
    epochs (no replay); a shard given the same rank on both ranks, and a sampler not reseeded, are
    still named."""
    findings, cover = data_findings(_accelerate_lines(tmp_path / "clean"))
    assert findings == [], findings
    assert cover.compared == 3 + 2 * 2 and "accelerate's even_batches padding" in cover.what, cover
    assert not cover.reason, cover
    (found,) = data_findings(_accelerate_lines(tmp_path / "same_rank", rank_of=(0, 0)))[0]
    assert (found.epoch, found.ranks, found.name) == (0, (0, 1), "loader 0 (ConcatDataset(65))"), found
    (found,) = data_findings(_accelerate_lines(tmp_path / "not_reseeded", reseed=False))[0]
    assert (found.epoch, found.ranks) == (1, (0, 1)) and "same order as epoch 0" in found.observation, found


# -- both, from the files ---------------------------------------------------------------------------


def test_check_invariants_reads_both_records_of_a_run(tmp_path: Path) -> None:
    steps = trajectory(1, 6)
    _ranks(tmp_path, {0: steps, 1: _drifted(steps, 6, "fc1.weight", 1_000)})
    order = list(RandomSampler(range(64), generator=torch.Generator().manual_seed(2)))
    for rank in range(2):
        write_samples(tmp_path, rank, [order[rank * 32 + i: rank * 32 + i + 8] for i in range(0, 32, 8)])
    result = check_invariants(read_steps(tmp_path), read_samples(tmp_path))
    assert [(f.invariant, f.step, f.name) for f in result.findings] == [(Invariant.REPLICAS, 6, "fc1.weight")]
    assert [c.invariant for c in result.coverage] == [Invariant.REPLICAS, Invariant.TRAINS, Invariant.SCALER,
                                                      Invariant.DATA, Invariant.TRAINS, Invariant.TRAINS, Invariant.ZERO_GRADS,
                                                      Invariant.MODES, Invariant.SCALER, Invariant.SCALER]
    assert result.coverage[3].compared == 1 and result.compared == 5 * len(PARAMS) + 3 + 2 * len(PARAMS) + 1


def test_hsdp_shards_are_compared_among_the_ranks_holding_the_same_shard(tmp_path: Path) -> None:
    """HSDP (a 2 x 2 mesh, replicate x shard): ranks 0 and 2 hold shard 0, ranks 1 and 3 shard 1.
    With the mesh coordinates of the ``params`` line each shard is compared along the Replicate
    dimension; a drift on one replica is named with its peer; without them nothing is compared."""
    placement = dict.fromkeys(PARAMS, "(Replicate(), Shard(dim=0))")
    coordinates = {0: [0, 0], 1: [0, 1], 2: [1, 0], 3: [1, 1]}

    def shard(r: int, steps: list[Step]) -> list[Step]:  # shard 1's values differ from shard 0's
        return [replace(s, placement=placement, param_of=dict.fromkeys(PARAMS, 7_000 + s.n) if r % 2 else {})
                for s in steps]

    def run(where: Path, per_rank: dict[int, list[Step]], mesh: bool = True) -> Path:
        for r, steps in per_rank.items():
            line = {**params_line(), "mesh": dict.fromkeys(PARAMS, coordinates[r])} if mesh else params_line()
            write_rank(where, r, steps, before=[line])
        return where

    clean = {r: shard(r, trajectory(1, 5)) for r in range(4)}
    findings, cover = replica_findings(read_steps(run(tmp_path / "clean", clean)))
    assert findings == [] and cover.compared == 5 * len(PARAMS) * 2, cover  # 2 replica groups a tensor
    assert f"{len(PARAMS)} sharded tensor(s) among the ranks holding the same shard" in cover.what, cover.what
    drift = {**clean, 2: [replace(s, param_of={"fc1.weight": 9_000 + s.n}) if s.n >= 3 else s for s in clean[2]]}
    (found,) = replica_findings(read_steps(run(tmp_path / "drift", drift)))[0]
    assert (found.step, found.name, found.ranks) == (3, "fc1.weight", (0, 2)), found
    assert "the parameter differs across replicas" in found.observation
    # an agent that wrote no mesh: the shards are not compared, and said so
    findings, cover = replica_findings(read_steps(run(tmp_path / "old", drift, mesh=False)))
    assert findings == [] and cover.compared == 0 and f"{len(PARAMS)} sharded tensor(s)" in cover.reason
    # a mesh of the wrong shape makes the line malformed (the reader counts it), never a traceback
    assert params_record({**params_line(), "mesh": {"fc1.weight": [0, 1]}}).mesh == {"fc1.weight": (0, 1)}
    with pytest.raises(ValueError, match="mesh must map names to lists of mesh coordinates"):
        params_record({**params_line(), "mesh": {"fc1.weight": "0,1"}})


def test_plain_tensor_shards_are_compared_within_the_data_parallel_groups_ddp_was_given(tmp_path: Path) -> None:
    """Megatron's layout at 4 ranks (2 tensor-parallel x 2 data-parallel, plain tensors): ranks 0
    and 1 hold other shards of ``fc1``, ranks 0 and 2 the same; ``fc2.weight`` was initialized
    alike on every rank (a zero bias shard) and parts by tensor-parallel rank from its first gradient. With each
    rank's DDP group (the ``params`` line's ``dp_ranks``) every tensor is compared within the
    groups, no finding on the clean run; a drift on rank 3's shard is named with its replica, rank 1.
    Without the groups the shards are no replicas (not compared) and ``fc2.weight`` is a false finding."""
    groups = {0: [0, 2], 1: [1, 3], 2: [0, 2], 3: [1, 3]}

    def shard(r: int, steps: list[Step]) -> list[Step]:  # tensor-parallel rank 1's values
        if r % 2 == 0:
            return steps
        return [replace(s, param_of={"fc1.weight": 7_000 + s.n, "fc1.bias": 8_000 + s.n,
                                     **({"fc2.weight": 9_000 + s.n} if s.n > 1 else {})},
                        grad_of={"fc1.weight": 7_100 + s.n, "fc1.bias": 8_100 + s.n, "fc2.weight": 9_100 + s.n},
                        optim_of={"fc1.weight": 7_200 + s.n, "fc1.bias": 8_200 + s.n, "fc2.weight": 9_200 + s.n})
                for s in steps]

    def run(where: Path, per_rank: dict[int, list[Step]], dp: bool = True) -> Path:
        for r, steps in per_rank.items():
            write_rank(where, r, steps, before=[{**params_line(), "dp_ranks": groups[r]} if dp else params_line()])
        return where

    clean = {r: shard(r, trajectory(1, 5)) for r in range(4)}
    findings, cover = replica_findings(read_steps(run(tmp_path / "clean", clean)))
    assert findings == [] and cover.compared == 5 * len(PARAMS) * 2, cover
    assert "within their data-parallel groups (the process groups of the DDP wrappers: ranks 0, 2; 1, 3" in cover.what
    drift = {**clean, 3: [replace(s, param_of={**s.param_of, "fc1.weight": 5_000 + s.n}) if s.n >= 3 else s
                          for s in clean[3]]}
    (found,) = replica_findings(read_steps(run(tmp_path / "drift", drift)))[0]
    assert (found.step, found.name, found.ranks) == (3, "fc1.weight", (1, 3)), found
    # without the groups: the shards are left out, and fc2.weight (alike at step 1) parts
    findings, cover = replica_findings(read_steps(run(tmp_path / "old", clean, dp=False)))
    assert {(f.step, f.name) for f in findings} == {(1, "fc2.weight")}  # its state and gradient at step 1
    assert "2 tensor(s) differ across ranks at their first step" in cover.reason, cover


def test_data_parallel_groups_count_only_when_they_partition_the_ranks() -> None:
    assert dp_groups({0: [0, 2], 1: [1, 3], 2: [0, 2], 3: [1, 3]}, range(4)) == [(0, 2), (1, 3)]
    assert dp_groups({0: [0, 2], 1: [1, 3], 2: [0, 2]}, range(4)) == []  # rank 3 recorded none
    assert dp_groups({0: [0, 2], 1: [1, 3], 2: [2, 3], 3: [1, 3]}, range(4)) == []  # rank 2 disagrees
    assert dp_groups({0: [1, 2], 1: [1, 2], 2: [1, 2]}, range(3)) == []  # rank 0 outside its own group
    assert dp_groups({0: [0, 1], 1: [0, 1], 2: [2], 3: [3]}, range(4)) == [(0, 1)]  # alone: nothing to compare
    assert params_record({**params_line(), "dp_ranks": [0, 2]}).dp_ranks == (0, 2)
    assert params_record(params_line()).dp_ranks == ()
    with pytest.raises(ValueError, match="dp_ranks must be a list of distinct ranks"):
        params_record({**params_line(), "dp_ranks": [0, 0]})
