"""Finding and comparing the checkpoints a job leaves behind.

Printed losses are often rounded (4 decimals is common), so equal loss lines do not prove an
exact resume; equal checkpoints do. Checkpoints are loaded with ``weights_only=True`` (no
arbitrary code runs); one that needs full unpickling is reported, not loaded.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "CHECKPOINT_SUFFIXES",
    "StateComparison",
    "compare_checkpoint_dirs",
    "find_checkpoints",
    "load_checkpoint",
]

CHECKPOINT_SUFFIXES = (".pt", ".pth", ".ckpt", ".bin", ".tar")


def find_checkpoints(directory: Path) -> list[Path]:
    """Checkpoint files under ``directory``, oldest first (by modification time, then name).

    Temp files of an in-progress atomic write (dot-prefixed or ``.tmp``) are ignored.
    """
    if not directory.is_dir():
        return []
    files = [
        p
        for p in directory.rglob("*")
        if p.is_file()
        and p.suffix in CHECKPOINT_SUFFIXES
        and not p.name.startswith(".")
        and not p.name.endswith(".tmp")
    ]
    return sorted(files, key=lambda p: (p.stat().st_mtime, p.name))


def load_checkpoint(path: Path) -> Any:
    """``torch.load(path, weights_only=True, map_location="cpu")``; raises ValueError with a
    clear message when the file needs full unpickling or is not a torch checkpoint."""
    import pickle

    import torch

    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        # torch's message is long; the class it refused is what a person needs
        refused = re.search(r"Unsupported global: GLOBAL (\S+)", str(exc))
        what = f"a pickled {refused.group(1)}" if refused else str(exc).splitlines()[0]
        raise ValueError(
            f"{path} cannot be loaded with weights_only=True: it needs full unpickling (it holds "
            f"{what}, not only tensors and plain containers). Save plain state dicts (tensors, "
            "numbers, strings, lists, dicts; e.g. vars(args) instead of args) so checkpoints "
            "load safely"
        ) from None
    except (RuntimeError, OSError, EOFError) as exc:
        raise ValueError(f"{path} is not a loadable torch checkpoint: {exc}") from None


@dataclass
class StateComparison:
    """Result of comparing the final checkpoints of two runs."""

    compared: bool
    reason: str = ""
    files: tuple[str, str] | None = None
    differing: list[tuple[str, str]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.differing

    def as_evidence(self) -> dict[str, Any]:
        return {
            "compared": self.compared,
            "reason": self.reason,
            "files": list(self.files) if self.files else None,
            "differing_keys": [k for k, _ in self.differing][:50],
            "differences": [f"{k}: {what}" for k, what in self.differing][:20],
        }


def compare_checkpoint_dirs(
    actual_dir: Path, expected_dir: Path, *, rtol: float = 0.0, atol: float = 0.0
) -> StateComparison:
    """Compare the newest checkpoint of ``actual_dir`` with the same-named file of
    ``expected_dir`` (else its newest), tensor by tensor, naming every differing key."""
    from trainguard.unit.equivalence import tree_differences

    actual = find_checkpoints(actual_dir)
    expected = find_checkpoints(expected_dir)
    if not actual or not expected:
        which = "resumed" if not actual else "reference"
        return StateComparison(False, f"the {which} run left no checkpoint file to compare")
    a_path = actual[-1]
    same_name = [p for p in expected if p.name == a_path.name]
    e_path = same_name[-1] if same_name else expected[-1]
    try:
        a_state = load_checkpoint(a_path)
        e_state = load_checkpoint(e_path)
    except ValueError as exc:
        return StateComparison(False, str(exc), (str(a_path), str(e_path)))
    differing = tree_differences(
        a_state, e_state, rtol=rtol, atol=atol, labels=("resumed", "reference")
    )
    return StateComparison(True, "", (str(a_path), str(e_path)), differing)
