"""The LightningModule: an MLP classifier of 8x8 digits, its optimizer and LR schedule, its data,
and (with ``--resumable-data``) the state Lightning does not checkpoint by itself."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.optim.lr_scheduler import LambdaLR
from torch.utils.data import DataLoader

from litdigits.data import (
    DataPosition,
    DigitsSplit,
    load_digits_split,
    plain_loader,
    resumable_loader,
)
from litdigits.rng import capture_rng, restore_rng


def warmup_cosine(
    warmup_steps: int, total_steps: int, min_ratio: float = 0.1
) -> Callable[[int], float]:
    """LR multiplier: linear warmup to 1, then cosine decay to ``min_ratio`` at ``total_steps``."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


class DigitsClassifier(pl.LightningModule):
    """Linear -> GELU -> Dropout, twice, then a linear head over the 64 pixels.

    ``resumable_data``: the data come from a loader that Lightning checkpoints (its position in the
    epoch) and every rank's RNG state goes into the checkpoint (``rng_states``) and comes back
    right before the first resumed step, so a resumed run continues exactly. Without it: a
    shuffled DataLoader and no RNG state, as most Lightning scripts are.
    """

    def __init__(
        self,
        hidden: int = 128,
        dropout: float = 0.1,
        lr: float = 1e-2,
        weight_decay: float = 0.01,
        warmup_steps: int = 10,
        total_steps: int = 600,
        batch_size: int = 64,
        seed: int = 0,
        resumable_data: bool = False,
        plant: str | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(
            nn.Linear(64, hidden), nn.GELU(), nn.Dropout(dropout),
            nn.Linear(hidden, hidden), nn.GELU(), nn.Dropout(dropout),
            nn.Linear(hidden, 10),
        )
        self.position = DataPosition()
        self._split: DigitsSplit | None = None
        self._rng_to_restore: dict[str, torch.Tensor] | None = None
        self._resumed = False

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """Logits ``[batch, 10]`` of images ``[batch, 64]`` (or ``[batch, 8, 8]``)."""
        return self.net(images.flatten(1))

    # ---- data -------------------------------------------------------------------------------
    def _data(self) -> DigitsSplit:
        if self._split is None:
            self._split = load_digits_split()
        return self._split

    def train_dataloader(self) -> DataLoader:
        """Plain: this rank's batch of a shuffled DataLoader (Lightning adds a DistributedSampler
        under DDP). Resumable: this rank's slice of the global batch, with its position."""
        hp = self.hparams
        world_size, rank = self.trainer.world_size, self.trainer.global_rank
        if not hp.resumable_data:
            return plain_loader(self._data().train, hp.batch_size // world_size)
        return resumable_loader(
            self._data().train, hp.batch_size, hp.seed, rank, world_size, self.position,
            stateful=hp.plant != "data_position_not_saved",
        )

    def val_dataloader(self) -> DataLoader:
        """The 297 held-out images in one batch, in order (every rank evaluates all of them)."""
        return DataLoader(self._data().val, batch_size=len(self._data().val),
                          generator=torch.Generator().manual_seed(0))

    # ---- training ---------------------------------------------------------------------------
    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        """Cross-entropy on this rank's micro-batch, logged as ``loss``."""
        images, labels = batch
        loss = F.cross_entropy(self(images), labels)
        self.position.batches += 1
        self.log("loss", loss)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        """Loss and accuracy on the validation set (``val_loss``, ``val_acc``)."""
        images, labels = batch
        logits = self(images)
        self.log("val_loss", F.cross_entropy(logits, labels))
        self.log("val_acc", (logits.argmax(1) == labels).float().mean())

    def configure_optimizers(self) -> dict[str, Any]:
        """AdamW with linear warmup then cosine decay, stepped every optimizer step."""
        hp = self.hparams
        optimizer = torch.optim.AdamW(self.parameters(), lr=hp.lr, weight_decay=hp.weight_decay)
        schedule = warmup_cosine(min(hp.warmup_steps, hp.total_steps), hp.total_steps)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": LambdaLR(optimizer, schedule), "interval": "step"},
        }

    def on_train_epoch_start(self) -> None:
        """A new epoch starts its batch count from 0 (a resumed one keeps its count)."""
        self.position.start_epoch(self.current_epoch)

    # ---- checkpointed state beyond Lightning's own ------------------------------------------
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Resumable: every rank's RNG state (all ranks call this together; rank 0 writes)."""
        if not self.hparams.resumable_data or self.hparams.plant == "rng_not_saved":
            return
        state = capture_rng()
        if dist.is_available() and dist.is_initialized():
            gathered: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, state)
        else:
            gathered = [state]
        checkpoint["rng_states"] = gathered

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Keep this rank's RNG state for the first resumed step."""
        self._resumed = True
        states = checkpoint.get("rng_states")
        if self.hparams.resumable_data and states:
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
            if len(states) == (dist.get_world_size() if dist.is_initialized() else 1):
                self._rng_to_restore = states[rank]

    def on_train_start(self) -> None:
        """The planted restore defects act here, right after Lightning restored everything."""
        if not self._resumed:
            return
        if self.hparams.plant == "optimizer_not_restored":
            for optimizer in self.trainer.optimizers:
                optimizer.state.clear()
        if self.hparams.plant == "scheduler_not_restored":
            for config in self.trainer.lr_scheduler_configs:
                config.scheduler.last_epoch = -1
                config.scheduler.step()  # step 0 of the schedule: the first warmup LR

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """The RNG state goes back as late as possible: right before the first resumed step."""
        if self._rng_to_restore is not None:
            restore_rng(self._rng_to_restore)
            self._rng_to_restore = None
