"""Checkpoints: atomic writes, a checksum, keep-last-N, and RNG states stored as plain tensors.

Everything saved loads with ``torch.load(weights_only=True)``: numpy's and Python's RNG states
are converted to tensors, lists and numbers first. Each checkpoint is serialised in memory and
written in one call (slow storage then costs one write, not one per tensor), with its SHA-256
in a hidden file beside it (``.ckpt_000020.pt.sha256``): ``torch.load`` reads a flipped byte in
a tensor without complaint, so a resume checks the sum and falls back to the previous
checkpoint when it does not match.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import random
import re
from typing import Any

import numpy as np
import torch

log = logging.getLogger(__name__)

_NAME = re.compile(r"^ckpt_(\d{6,})\.pt$")
REQUIRED_KEYS = ("model", "optimizer", "scheduler", "step", "epoch", "batch_in_epoch", "rng")


def checkpoint_path(ckpt_dir: str, step: int) -> str:
    """The file name of the checkpoint taken after ``step``."""
    return os.path.join(ckpt_dir, f"ckpt_{step:06d}.pt")


def list_checkpoints(ckpt_dir: str) -> list[tuple[int, str]]:
    """(step, path) of every checkpoint file in ``ckpt_dir``, oldest first."""
    if not os.path.isdir(ckpt_dir):
        return []
    found = []
    for name in os.listdir(ckpt_dir):
        match = _NAME.match(name)
        if match:
            found.append((int(match.group(1)), os.path.join(ckpt_dir, name)))
    return sorted(found)


def checksum_path(path: str) -> str:
    """The hidden file beside a checkpoint that holds its SHA-256."""
    return os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.sha256")


def _write_atomically(final: str, data: bytes) -> None:
    tmp = os.path.join(os.path.dirname(final), f".{os.path.basename(final)}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(state: dict[str, Any], ckpt_dir: str, step: int, keep_last: int) -> str:
    """Write ``state`` atomically as the checkpoint of ``step`` and prune old checkpoints.

    The file is written under a temporary name in the same directory, fsynced, renamed over the
    final name and the directory fsynced: a crash at any moment leaves either the complete new
    checkpoint or none, never a truncated one.
    """
    os.makedirs(ckpt_dir, exist_ok=True)
    final = checkpoint_path(ckpt_dir, step)
    buffer = io.BytesIO()
    torch.save(state, buffer)
    data = buffer.getvalue()
    # the sum first: a checkpoint whose sum is missing (a crash between the two) still loads
    _write_atomically(checksum_path(final), hashlib.sha256(data).hexdigest().encode())
    _write_atomically(final, data)
    _fsync_dir(ckpt_dir)
    _prune(ckpt_dir, step, keep_last)
    return final


def _prune(ckpt_dir: str, step: int, keep_last: int) -> None:
    # Checkpoints newer than this one belong to an abandoned run (a fresh start over an old
    # directory, or a resume from an older checkpoint): a later --resume must not pick them.
    ours = []
    for other_step, path in list_checkpoints(ckpt_dir):
        if other_step > step:
            log.warning("removing %s: it is newer than this run's step %d", path, step)
            _remove(path)
        else:
            ours.append(path)
    for path in ours[:-keep_last] if keep_last > 0 else []:
        _remove(path)


def _remove(path: str) -> None:
    os.unlink(path)
    if os.path.exists(checksum_path(path)):
        os.unlink(checksum_path(path))


def remove_stale_temp_files(ckpt_dir: str) -> None:
    """Delete temporary files left behind by a save that was killed half-way."""
    if not os.path.isdir(ckpt_dir):
        return
    for name in os.listdir(ckpt_dir):
        if name.startswith((".ckpt_", "..ckpt_")) and name.endswith(".tmp"):
            log.info("removing the partial checkpoint %s", name)
            os.unlink(os.path.join(ckpt_dir, name))


def load_checkpoint(path: str) -> dict[str, Any]:
    """Load a checkpoint; raise ValueError when it is unreadable, incomplete or does not match
    its checksum."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise ValueError(f"{path} cannot be read: {exc}") from exc
    try:
        with open(checksum_path(path), "rb") as f:
            expected = f.read().decode().strip()
    except FileNotFoundError:
        expected = None  # written before checksums (or the sum was lost): loaded unverified
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{checksum_path(path)} cannot be read: {exc}") from exc
    if expected is not None and hashlib.sha256(data).hexdigest() != expected:
        raise ValueError(f"{path} does not match its SHA-256 ({checksum_path(path)}): corrupted on disk")
    try:
        state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:
        raise ValueError(f"{path} does not load: {exc}") from exc
    missing = [key for key in REQUIRED_KEYS if key not in state]
    if missing:
        raise ValueError(f"{path} lacks {missing}")
    return state


def latest_valid_checkpoint(ckpt_dir: str) -> str | None:
    """The newest checkpoint in ``ckpt_dir`` that loads, or None when there is none."""
    for step, path in reversed(list_checkpoints(ckpt_dir)):
        try:
            load_checkpoint(path)
        except ValueError as exc:
            log.warning("skipping the checkpoint of step %d: %s", step, exc)
            continue
        return path
    return None


def capture_rng_state(device: torch.device) -> dict[str, Any]:
    """This process's torch, numpy, python (and CUDA) RNG states as checkpoint-safe values."""
    _, keys, pos, has_gauss, cached_gaussian = np.random.get_state()  # type: ignore[misc]
    version, internal, gauss_next = random.getstate()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": {
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian),
        },
        "python": {
            "version": int(version),
            "internal": torch.tensor(internal, dtype=torch.int64),
            "gauss_next": [] if gauss_next is None else [float(gauss_next)],
        },
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def restore_rng_state(state: dict[str, Any], device: torch.device) -> None:
    """Restore the RNG states captured by :func:`capture_rng_state`."""
    torch.set_rng_state(state["torch"])
    np_state = state["numpy"]
    np.random.set_state(
        (
            "MT19937",
            np_state["keys"].numpy().astype(np.uint32),
            np_state["pos"],
            np_state["has_gauss"],
            np_state["cached_gaussian"],
        )
    )
    py_state = state["python"]
    gauss_next = py_state["gauss_next"][0] if py_state["gauss_next"] else None
    random.setstate((py_state["version"], tuple(py_state["internal"].tolist()), gauss_next))
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)
