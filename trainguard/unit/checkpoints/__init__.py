"""Finding, reading and comparing the checkpoints a job leaves behind.

Printed losses are often rounded (4 decimals is common), so equal loss lines do not prove an
exact resume; equal checkpoints do. Checkpoints are read without running code from them: torch
pickles with ``weights_only=True``, safetensors and JSON as data, ``torch.distributed.checkpoint``
metadata with an unpickler that admits only its own classes. A file that needs full unpickling
(``training_args.bin``) is skipped by name, and the rest still read.

* :mod:`~trainguard.unit.checkpoints.files`: the formats, :func:`latest_complete_checkpoint`
  (what ``{latest_checkpoint}`` names), reading one checkpoint;
* :mod:`~trainguard.unit.checkpoints.state`: keys, their :data:`COMPONENTS`
  (:func:`classify_key`), metadata (paths, times), :func:`checkpoint_inventory`;
* :mod:`~trainguard.unit.checkpoints.compare`: :func:`compare_checkpoint_dirs`.
"""

from __future__ import annotations

from trainguard.unit.checkpoints.compare import StateComparison, compare_checkpoint_dirs
from trainguard.unit.checkpoints.files import (
    CHECKPOINT_SUFFIXES,
    describe_candidates,
    find_checkpoints,
    latest_complete_checkpoint,
    load_checkpoint,
    read_checkpoint,
)
from trainguard.unit.checkpoints.state import (
    COMPONENTS,
    OPTIONAL,
    CheckpointInventory,
    checkpoint_inventory,
    classify_key,
)

__all__ = [
    "CHECKPOINT_SUFFIXES",
    "COMPONENTS",
    "OPTIONAL",
    "CheckpointInventory",
    "StateComparison",
    "checkpoint_inventory",
    "classify_key",
    "compare_checkpoint_dirs",
    "describe_candidates",
    "find_checkpoints",
    "latest_complete_checkpoint",
    "load_checkpoint",
    "read_checkpoint",
]
