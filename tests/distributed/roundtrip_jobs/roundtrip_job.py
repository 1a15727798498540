"""A tiny training job for ``assert_state_roundtrip``, with planted checkpoint defects.

Its state has every kind of component a real job resumes: a model with dropout (so the next
step draws from the global torch RNG), AdamW, a StepLR schedule, a GradScaler, a data position
that reshuffles every epoch from the global RNG, and the global RNGs themselves.

``save_without_scheduler`` forgets the scheduler; ``save_without_rng`` forgets the RNGs;
``load_saved`` restores whatever the checkpoint holds. The clean case uses trainguard's default
save/load.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from trainguard.unit.seeding import rng_state, set_rng_state

# fixed data, independent of the global RNG (which belongs to the training state under test)
_DATA = torch.Generator().manual_seed(1234)
X = torch.randn(8, 4, generator=_DATA)
Y = torch.randn(8, 1, generator=_DATA)
BATCH = 4


class DataPosition:
    """Where the data stream is: the epoch, the next index and this epoch's shuffled order."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.epoch = -1
        self.index = size  # the first call starts epoch 0
        self.order = torch.arange(size)

    def next_indices(self) -> torch.Tensor:
        if self.index >= self.size:
            self.epoch += 1
            self.index = 0
            self.order = torch.randperm(self.size)  # draws from the global RNG
        picked = self.order[self.index : self.index + BATCH]
        self.index += BATCH
        return picked

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "index": self.index, "order": self.order.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.index, self.order = state["epoch"], state["index"], state["order"].clone()


def build() -> dict[str, Any]:
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Dropout(0.5), nn.Linear(8, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    return {
        "model": model,
        "optimizer": optimizer,
        "scheduler": torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5),
        "scaler": torch.amp.GradScaler("cpu", init_scale=2.0**8),
        "data": DataPosition(len(X)),
        "rng": None,
    }


def step(c: dict[str, Any]) -> torch.Tensor:
    idx = c["data"].next_indices()
    loss = nn.functional.mse_loss(c["model"](X[idx]), Y[idx])
    c["optimizer"].zero_grad()
    c["scaler"].scale(loss).backward()
    c["scaler"].step(c["optimizer"])
    c["scaler"].update()
    c["scheduler"].step()
    return loss.detach()


def _save(c: dict[str, Any], path: str, names: tuple[str, ...], with_rng: bool) -> None:
    state: dict[str, Any] = {name: c[name].state_dict() for name in names}
    if with_rng:
        state["rng"] = rng_state()
    torch.save(state, path)


def save_without_scheduler(c: dict[str, Any], path: str) -> None:
    _save(c, path, ("model", "optimizer", "scaler", "data"), with_rng=True)


def save_without_rng(c: dict[str, Any], path: str) -> None:
    _save(c, path, ("model", "optimizer", "scheduler", "scaler", "data"), with_rng=False)


def load_saved(c: dict[str, Any], path: str) -> None:
    state = torch.load(path, weights_only=True)
    for name, value in state.items():
        if name != "rng":
            c[name].load_state_dict(value)
    if "rng" in state:
        set_rng_state(state["rng"])
