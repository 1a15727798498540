"""Realistic checkpointing defects, planted on purpose (``train.py --resumable-data --plant NAME``).

They are planted on the resumable variant, whose resume is exact, so that each one alone breaks
it; the tests check that trainguard catches each and names its cause.

==========================  ===============================================================  ====================
``--plant``                 what it does                                                     trainguard should say
==========================  ===============================================================  ====================
``rng_not_saved``           checkpoints keep no RNG state (dropout masks differ on resume)   resume: RNG
``data_position_not_saved`` the same sampler in a plain DataLoader: its position is not      resume: data position
                            checkpointed, a resumed epoch starts again from its first batch
``optimizer_not_restored``  clears AdamW's state (moments, step counts) after the restore     resume: optimizer
``scheduler_not_restored``  puts the LR schedule back to step 0 after the restore            resume: LR schedule
``checkpoint_only_at_exit`` no ModelCheckpoint; ``trainer.save_checkpoint`` after ``fit``     resume: no checkpoint
                                                                                             before the kill
``checkpoint_in_place``     only ``last.ckpt`` (``save_top_k=0``), written by a CheckpointIO  disk_full: torn
                            that ``torch.save``s straight over the previous file             checkpoint
==========================  ===============================================================  ====================
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO

PLANTS = (
    "rng_not_saved",
    "data_position_not_saved",
    "optimizer_not_restored",
    "scheduler_not_restored",
    "checkpoint_only_at_exit",
    "checkpoint_in_place",
)


class InPlaceCheckpointIO(TorchCheckpointIO):
    """``checkpoint_in_place``: writes the checkpoint straight to its path with ``torch.save``.
    Lightning's own TorchCheckpointIO writes a temporary file and moves it into place; this one
    truncates the previous file first, so a save that fails midway leaves a torn checkpoint."""

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        """Overwrite ``path`` in place."""
        torch.save(checkpoint, path)
