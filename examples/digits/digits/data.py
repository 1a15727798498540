"""The data: a fixed train/val split of scikit-learn's digits and a seeded augmentation."""

from __future__ import annotations

import itertools
import logging
import os
import random
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import Dataset, DistributedSampler

log = logging.getLogger(__name__)

# The split never depends on --seed: every run validates on the same images.
SPLIT_SEED = 0
NUM_VAL = 297  # 1797 images -> 1500 train, 297 val
CACHE_NAME = "digits.npz"


@dataclass(frozen=True)
class DigitsSplit:
    """Train and validation images scaled to [0, 1], and the train set's mean and std."""

    train_images: torch.Tensor  # [N, 8, 8] float32
    train_labels: torch.Tensor  # [N] int64
    val_images: torch.Tensor
    val_labels: torch.Tensor
    mean: float
    std: float

    def normalise(self, images: torch.Tensor) -> torch.Tensor:
        """Standardise images with the train set's statistics."""
        return (images - self.mean) / self.std


def _load_arrays(data_dir: str | None) -> tuple[np.ndarray, np.ndarray]:
    """Return (images [1797, 8, 8] with values 0..16, labels [1797]), cached in ``data_dir``.

    Importing scikit-learn costs more than a short training run, so the arrays are cached after
    the first load. The cache is written atomically, so concurrent ranks may both write it.
    """
    cache = os.path.join(data_dir, CACHE_NAME) if data_dir else None
    if cache and os.path.exists(cache):
        with np.load(cache) as arrays:
            return arrays["images"], arrays["labels"]

    from sklearn.datasets import load_digits  # slow import: only when the cache is missing

    digits = load_digits()
    # The pixels are small integers: uint8 stores them exactly.
    images, labels = digits.images.astype(np.uint8), digits.target.astype(np.uint8)
    if cache:
        tmp = f"{cache}.{os.getpid()}.tmp"
        try:
            os.makedirs(data_dir, exist_ok=True)  # type: ignore[arg-type]
            with open(tmp, "wb") as f:
                np.savez_compressed(f, images=images, labels=labels)
            os.replace(tmp, cache)
        except OSError as exc:  # a read-only checkout still trains, only slower to start
            log.warning("could not cache the digits data in %s: %s", data_dir, exc)
            if os.path.exists(tmp):
                os.unlink(tmp)
    return images, labels


def load_split(data_dir: str | None = None) -> DigitsSplit:
    """Load the digits data set and split it into a fixed train and validation set."""
    images, labels = _load_arrays(data_dir)
    order = np.random.RandomState(SPLIT_SEED).permutation(len(images))
    val_idx, train_idx = order[:NUM_VAL], order[NUM_VAL:]
    scaled = torch.from_numpy(images.astype(np.float32) / 16.0)
    targets = torch.from_numpy(labels.astype(np.int64))
    train = scaled[train_idx]
    return DigitsSplit(
        train_images=train,
        train_labels=targets[train_idx],
        val_images=scaled[val_idx],
        val_labels=targets[val_idx],
        mean=float(train.mean()),
        std=float(train.std()),
    )


_MASK64 = (1 << 64) - 1


def _mix64(x: int) -> int:
    """The splitmix64 finaliser: a bijection on 64-bit ints that scrambles every bit."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _MASK64
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _MASK64
    return x ^ (x >> 31)


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """A well-mixed 64-bit seed for one sample's augmentation in one epoch."""
    x = _mix64((seed + 0x9E3779B97F4A7C15) & _MASK64)
    x = _mix64((x + epoch) & _MASK64)
    return _mix64((x + index) & _MASK64)


class AugmentedDigits(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Standardised digits images, each randomly shifted by up to ``max_shift`` pixels and noised.

    Each sample draws its augmentation from its own generator seeded by (seed, epoch, index),
    so a sample looks the same whichever worker, rank or resumed run loads it.

    Args:
        images: ``[N, 8, 8]`` images scaled to [0, 1].
        labels: ``[N]`` class labels.
        mean, std: Statistics used to standardise the images.
        seed: Base seed of the augmentation.
        noise_std: Std of the additive noise, in [0, 1] pixel units (0 disables it).
        max_shift: Largest shift in pixels along each axis (0 disables it).
    """

    def __init__(
        self,
        images: torch.Tensor,
        labels: torch.Tensor,
        *,
        mean: float,
        std: float,
        seed: int,
        noise_std: float = 0.05,
        max_shift: int = 1,
    ) -> None:
        if max_shift < 0 or noise_std < 0:
            raise ValueError(
                f"max_shift and noise_std must be >= 0, got {max_shift} and {noise_std}"
            )
        # Standardised once, with a border of background pixels: a shifted image is a crop.
        m = max_shift
        self.padded = torch.nn.functional.pad(
            (images - mean) / std, (m, m, m, m), value=-mean / std
        )
        self.labels = labels
        self.size = images.shape[1:]
        self.scaled_noise_std = noise_std / std
        self.seed = seed
        self.max_shift = max_shift
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose augmentation __getitem__ draws (call before iterating)."""
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        m = self.max_shift
        h, w = self.size
        g = torch.Generator().manual_seed(sample_seed(self.seed, self.epoch, index))
        top, left = torch.randint(0, 2 * m + 1, (2,), generator=g).tolist() if m else (0, 0)
        image = self.padded[index, top : top + h, left : left + w]  # shifted by (m - top, m - left)
        if self.scaled_noise_std:
            image = image + self.scaled_noise_std * torch.randn(h, w, generator=g)
        return image.reshape(-1), self.labels[index]


class ResumableDistributedSampler(DistributedSampler):  # type: ignore[type-arg]
    """A DistributedSampler that can start part-way through an epoch.

    A resumed run skips the samples it already trained on at the index level, so no data is
    loaded (or augmented) just to be thrown away.
    """

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self.start_index = 0

    def set_start_index(self, start_index: int) -> None:
        """Skip this rank's first ``start_index`` samples of the current epoch."""
        if not 0 <= start_index <= self.num_samples:
            raise ValueError(f"start_index must be in [0, {self.num_samples}], got {start_index}")
        self.start_index = start_index

    def __iter__(self) -> Iterator[int]:
        return itertools.islice(super().__iter__(), self.start_index, None)

    def __len__(self) -> int:
        return self.num_samples - self.start_index


def seed_worker(worker_id: int) -> None:
    """DataLoader worker_init_fn: seed numpy and random from torch's per-worker seed."""
    worker_seed = torch.initial_seed() % 2**32
    np.random.seed(worker_seed)
    random.seed(worker_seed)
