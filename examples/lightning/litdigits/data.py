"""The digits data and the two ways train.py feeds it.

``plain_loader``: a shuffled ``DataLoader``, as most Lightning scripts have it. Under DDP
Lightning swaps in a ``DistributedSampler``. Nothing of its position or its RNG is checkpointed,
so a run resumed mid-epoch starts the epoch's order again (Lightning warns that "your dataloader
is not resumable").

``resumable_loader`` (``--resumable-data``): a sampler that shuffles by (seed, epoch) with its own
generator and hands each rank an interleaved slice of one permutation (so N ranks together train on
the batches 1 rank would), and a loader whose ``state_dict``/``load_state_dict`` carry the
position in the epoch. Lightning stores that in the checkpoint and hands it back on resume.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader, Sampler, TensorDataset

TRAIN_SAMPLES = 1500  # of 1797; the other 297 validate


@dataclass
class DigitsSplit:
    """Standardised images (``[N, 64]`` float) and labels, split once, the same for every run."""

    train: TensorDataset
    val: TensorDataset


def load_digits_split() -> DigitsSplit:
    """scikit-learn's digits (shipped with scikit-learn, not downloaded), standardised with the
    training part's statistics, in a fixed shuffled split."""
    from sklearn.datasets import load_digits

    images, labels = load_digits(return_X_y=True)
    x = torch.tensor(images, dtype=torch.float32)
    y = torch.tensor(labels, dtype=torch.long)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(20240611))
    x, y = x[order], y[order]
    mean, std = x[:TRAIN_SAMPLES].mean(), x[:TRAIN_SAMPLES].std()
    x = (x - mean) / std
    return DigitsSplit(
        train=TensorDataset(x[:TRAIN_SAMPLES], y[:TRAIN_SAMPLES]),
        val=TensorDataset(x[TRAIN_SAMPLES:], y[TRAIN_SAMPLES:]),
    )


def plain_loader(dataset: TensorDataset, batch_size: int) -> DataLoader:
    """The usual loader: reshuffled every epoch from the global RNG, no state of its own."""
    return DataLoader(dataset, batch_size=batch_size, shuffle=True, drop_last=True)


class ShardedShuffle(Sampler[int]):
    """A permutation of the data set per epoch, drawn from (seed, epoch) alone; rank r of N takes
    positions r, r+N, r+2N, ... of it, so that with a per-rank batch of B/N the ranks' batches
    together are the batch of B one rank would draw. Drops the tail that does not fill a whole
    global batch. ``start`` skips that many of this rank's samples once (a resumed epoch)."""

    def __init__(
        self, length: int, global_batch: int, seed: int, rank: int = 0, world_size: int = 1
    ) -> None:
        if global_batch % world_size:
            raise ValueError(f"the global batch {global_batch} must be a multiple of {world_size} ranks")
        self.length, self.seed, self.rank, self.world_size = length, seed, rank, world_size
        self.per_rank = length // global_batch * global_batch // world_size
        self.epoch = 0
        self._resume: tuple[int, int] | None = None  # (epoch, samples of this rank to skip)

    def set_epoch(self, epoch: int) -> None:
        """Called by Lightning at the start of every epoch."""
        self.epoch = epoch

    def resume_at(self, epoch: int, start: int) -> None:
        """Make epoch ``epoch``'s iteration begin at this rank's sample ``start``."""
        self.epoch, self._resume = epoch, (epoch, start)

    def __len__(self) -> int:
        return self.per_rank

    def __iter__(self) -> Iterator[int]:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        order = torch.randperm(self.length, generator=generator)
        mine = order[self.rank : self.per_rank * self.world_size : self.world_size].tolist()
        start = 0
        if self._resume is not None and self._resume[0] == self.epoch:
            start, self._resume = self._resume[1], None
        yield from mine[start:]


class DataPosition:
    """How many batches of which epoch the model has trained on: counted by the module's
    ``training_step`` (not by the loader, which Lightning reads one batch ahead)."""

    def __init__(self) -> None:
        self.epoch = 0
        self.batches = 0

    def start_epoch(self, epoch: int) -> None:
        """A new epoch begins (a resumed epoch keeps its count)."""
        if epoch != self.epoch:
            self.epoch, self.batches = epoch, 0


class ResumableLoader(DataLoader):
    """A ``DataLoader`` over a :class:`ShardedShuffle` whose ``state_dict`` is the trained
    position: Lightning saves it with every checkpoint and restores it before the resumed epoch."""

    def __init__(self, dataset: TensorDataset, sampler: ShardedShuffle, batch_size: int,
                 position: DataPosition, seed: int) -> None:
        super().__init__(
            dataset,
            batch_size=batch_size,
            sampler=sampler,
            drop_last=True,
            # its own generator: creating an iterator never draws from the global RNG
            generator=torch.Generator().manual_seed(seed),
        )
        self.position = position

    def state_dict(self) -> dict[str, Any]:
        """The position the next batch continues from."""
        return {"epoch": self.position.epoch, "batches": self.position.batches}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue ``state["epoch"]`` after its first ``state["batches"]`` batches."""
        self.position.epoch, self.position.batches = state["epoch"], state["batches"]
        assert isinstance(self.sampler, ShardedShuffle) and self.batch_size is not None
        self.sampler.resume_at(state["epoch"], state["batches"] * self.batch_size)


def resumable_loader(
    dataset: TensorDataset, global_batch: int, seed: int, rank: int, world_size: int,
    position: DataPosition, stateful: bool = True,
) -> DataLoader:
    """The resumable loader for this rank (``stateful=False``: the same sampler in a plain
    ``DataLoader``, whose position is not saved: the planted ``data_position_not_saved``)."""
    sampler = ShardedShuffle(len(dataset), global_batch, seed, rank, world_size)
    batch = global_batch // world_size
    if stateful:
        return ResumableLoader(dataset, sampler, batch, position, seed)
    return DataLoader(dataset, batch_size=batch, sampler=sampler, drop_last=True,
                      generator=torch.Generator().manual_seed(seed))
