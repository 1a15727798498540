"""Digits: a small MLP trained on scikit-learn's 8x8 handwritten digits."""

from __future__ import annotations

from digits.data import (
    AugmentedDigits,
    DigitsSplit,
    ResumableDistributedSampler,
    load_split,
    seed_worker,
)
from digits.model import DigitsMLP

__all__ = [
    "AugmentedDigits",
    "DigitsMLP",
    "DigitsSplit",
    "ResumableDistributedSampler",
    "load_split",
    "seed_worker",
]
