"""The model: a small MLP classifier for 8x8 digit images."""

from __future__ import annotations

import torch
from torch import nn


class DigitsMLP(nn.Module):
    """An MLP with LayerNorm, GELU and dropout after each hidden layer.

    LayerNorm normalises each sample on its own (unlike BatchNorm), so the model's output for a
    sample never depends on the rest of its batch, and N ranks train exactly like 1 rank.

    Args:
        in_features: Pixels per image (8 * 8 for the digits data set).
        hidden: Width of each hidden layer.
        num_classes: Number of output logits.
        depth: Number of hidden layers.
        dropout: Dropout probability after each hidden layer.
    """

    def __init__(
        self,
        in_features: int = 64,
        hidden: int = 128,
        num_classes: int = 10,
        depth: int = 2,
        dropout: float = 0.1,
    ) -> None:
        super().__init__()
        if depth < 1:
            raise ValueError(f"depth must be at least 1, got {depth}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        layers: list[nn.Module] = []
        width = in_features
        for _ in range(depth):
            layers += [
                nn.Linear(width, hidden),
                nn.LayerNorm(hidden),
                nn.GELU(),
                nn.Dropout(dropout),
            ]
            width = hidden
        self.body = nn.Sequential(*layers)
        self.head = nn.Linear(width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return logits ``[batch, num_classes]`` for images ``[batch, 8, 8]`` or ``[batch, 64]``."""
        return self.head(self.body(x.flatten(1)))
