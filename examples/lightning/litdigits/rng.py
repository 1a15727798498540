"""Every RNG a training step may draw from (torch, numpy, python), captured as plain tensors so
that a checkpoint holding them loads with ``torch.load(weights_only=True)``."""

from __future__ import annotations

import random

import numpy as np
import torch


def capture_rng() -> dict[str, torch.Tensor]:
    """This process's torch, numpy and python RNG states as plain tensors (loadable with
    ``weights_only=True``)."""
    _, keys, pos, has_gauss, cached = np.random.get_state()
    version, internal, gauss = random.getstate()
    return {
        "torch": torch.get_rng_state(),
        "numpy_keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
        "numpy_rest": torch.tensor([pos, has_gauss], dtype=torch.int64),
        "numpy_cached": torch.tensor(cached, dtype=torch.float64),
        "python_internal": torch.tensor(internal, dtype=torch.int64),
        "python_version": torch.tensor(version, dtype=torch.int64),
        # (has a cached gauss, its value): no NaN for "none", so equal states compare equal
        "python_gauss": torch.tensor(
            [gauss is not None, 0.0 if gauss is None else gauss], dtype=torch.float64
        ),
    }


def restore_rng(state: dict[str, torch.Tensor]) -> None:
    """Put back what :func:`capture_rng` took."""
    torch.set_rng_state(state["torch"])
    pos, has_gauss = state["numpy_rest"].tolist()
    keys = state["numpy_keys"].numpy().astype(np.uint32)
    np.random.set_state(("MT19937", keys, pos, has_gauss, state["numpy_cached"].item()))
    has_gauss_py, gauss = state["python_gauss"].tolist()
    random.setstate(
        (
            int(state["python_version"]),
            tuple(state["python_internal"].tolist()),
            gauss if has_gauss_py else None,
        )
    )
