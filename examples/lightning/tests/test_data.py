"""The resumable data path of the Lightning example, without Lightning (these import torch only).

What --resumable-data promises, checked directly: N ranks' batches together are the batch one rank
draws; a resumed epoch continues after the batches already trained on; the loader's state is the
trained position; the RNG state comes back bit for bit.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from torch.utils.data import TensorDataset

from litdigits.data import DataPosition, ShardedShuffle, resumable_loader
from litdigits.rng import capture_rng, restore_rng

LENGTH, GLOBAL_BATCH, SEED = 200, 16, 3


def epoch_batches(world_size: int, epoch: int = 0) -> list[list[int]]:
    """The global batches of an epoch: rank r's micro-batch k, concatenated over the ranks."""
    per_rank = []
    for rank in range(world_size):
        sampler = ShardedShuffle(LENGTH, GLOBAL_BATCH, SEED, rank, world_size)
        sampler.set_epoch(epoch)
        order = list(sampler)
        step = GLOBAL_BATCH // world_size
        per_rank.append([order[i : i + step] for i in range(0, len(order), step)])
    return [sorted(i for batches in per_rank for i in batches[k]) for k in range(len(per_rank[0]))]


@pytest.mark.parametrize("world_size", [2, 4])
def test_ranks_together_train_on_the_batches_of_one_rank(world_size: int) -> None:
    assert epoch_batches(world_size) == epoch_batches(1)
    assert epoch_batches(world_size, epoch=1) == epoch_batches(1, epoch=1)


def test_every_epoch_is_a_new_permutation_of_whole_batches() -> None:
    first, second = epoch_batches(1, 0), epoch_batches(1, 1)
    assert first != second
    assert len(first) == LENGTH // GLOBAL_BATCH
    flat = [i for batch in first for i in batch]
    assert len(set(flat)) == len(flat)


def test_a_resumed_epoch_continues_after_the_trained_batches() -> None:
    uninterrupted = list(ShardedShuffle(LENGTH, GLOBAL_BATCH, SEED))
    resumed = ShardedShuffle(LENGTH, GLOBAL_BATCH, SEED)
    resumed.resume_at(epoch=0, start=3 * GLOBAL_BATCH)
    assert list(resumed) == uninterrupted[3 * GLOBAL_BATCH :]
    # only once: the next pass over the epoch is whole again
    assert list(resumed) == uninterrupted


def test_the_loader_state_is_the_trained_position() -> None:
    data = TensorDataset(torch.arange(LENGTH))
    position = DataPosition()
    loader = resumable_loader(data, GLOBAL_BATCH, SEED, rank=0, world_size=1, position=position)
    batches = [b[0].tolist() for b in loader]
    position.batches = 5  # what training_step counted
    state = loader.state_dict()
    assert state == {"epoch": 0, "batches": 5}

    fresh = resumable_loader(data, GLOBAL_BATCH, SEED, rank=0, world_size=1,
                             position=DataPosition())
    fresh.load_state_dict(state)
    assert [b[0].tolist() for b in fresh] == batches[5:]


def test_the_plain_variant_of_the_resumable_loader_has_no_state() -> None:
    data = TensorDataset(torch.arange(LENGTH))
    loader = resumable_loader(data, GLOBAL_BATCH, SEED, 0, 1, DataPosition(), stateful=False)
    assert not hasattr(loader, "state_dict")


def test_rng_state_round_trips_exactly() -> None:
    random.gauss(0, 1)  # leaves a cached gauss in python's generator
    np.random.randn()
    state = capture_rng()
    draws = (random.random(), random.gauss(0, 1), np.random.rand(), np.random.randn(), torch.rand(3))
    restore_rng(state)
    again = (random.random(), random.gauss(0, 1), np.random.rand(), np.random.randn(), torch.rand(3))
    assert draws[:4] == again[:4] and torch.equal(draws[4], again[4])
    # the captured state is plain tensors (a checkpoint loads it with weights_only=True)
    assert all(isinstance(v, torch.Tensor) for v in state.values())
