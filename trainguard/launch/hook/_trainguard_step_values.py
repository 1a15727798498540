"""The values of the run agent's step records: fingerprints of tensors, parameter names, the
hyperparameters of a param group, what a saved value is (docs/step-records.md).

Standard library only; torch is the job's own, passed in. Loaded by path next to
``_trainguard_step_agent`` (see ``_trainguard_run_agent.sibling``).
"""

from __future__ import annotations

import hashlib
import math
import os
import struct
import sys
from typing import Any

MASK = (1 << 64) - 1
#: wrapper prefixes dropped from parameter names (DDP, torch.compile and Lightning's strategy
#: wrapper at the start; FSDP's and activation checkpointing's wherever they are)
_LEADING = ("module.", "_orig_mod.", "_forward_module.")
_ANYWHERE = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.")
#: from this many elements on a tensor's bits are summed as 64-bit words
WORDS_FROM = 4096
#: the integer dtype a floating dtype's bits are read as, by element size
_INT_OF_SIZE = {1: "int8", 2: "int16", 4: "int32", 8: "int64"}


def clean_name(name: str) -> str:
    """``name`` without the wrapper prefixes (docs/step-records.md#names)."""
    for part in _ANYWHERE:
        name = name.replace(part, "")
    stripped = True
    while stripped:
        stripped = False
        for prefix in _LEADING:
            if name.startswith(prefix):
                name, stripped = name[len(prefix):], True
    return name


def number(value: float) -> float | str:
    """A float JSON can carry: NaN and the infinities as strings."""
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return value


def hex64(value: int) -> str:
    return format(value & MASK, "016x")


def sha16(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


def local_shard(t: Any) -> tuple[Any, str | None]:
    """A DTensor's local shard and its placements, else the tensor itself."""
    if hasattr(t, "to_local") and hasattr(t, "placements"):
        return t.to_local(), str(t.placements)
    return t, None


def _bits(torch: Any, t: Any) -> Any:
    """``t``'s elements' bit patterns as integers of their width (a view, no copy)."""
    if t.is_complex():
        t = torch.view_as_real(t)
    if t.dtype == torch.bool:
        return t.view(torch.uint8)
    if t.is_floating_point():
        return t.view(getattr(torch, _INT_OF_SIZE[t.element_size()]))
    return t


def bit_sum(torch: Any, t: Any) -> Any:
    """The 0-dim int64 ``fp`` of ``t`` (docs/step-records.md#fingerprints): the sum, wrapping
    mod 2**64, of its elements' bit patterns; from ``WORDS_FROM`` elements on, of its row-major
    elements packed into 64-bit words (a 64-bit reduction reads them several times faster than a
    widening one), the last elements that fill no word added as themselves."""
    bits = _bits(torch, t)
    per = 8 // bits.element_size()
    if per == 1 or bits.numel() < WORDS_FROM:
        return bits.sum(dtype=torch.int64)
    flat = bits.reshape(-1)  # a copy only for a non-contiguous tensor
    whole = flat.numel() - flat.numel() % per
    try:
        total = flat[:whole].view(torch.int64).sum()
    except RuntimeError:  # a view at an offset that is no whole word: copied
        total = flat[:whole].clone().view(torch.int64).sum()
    if whole < flat.numel():
        total = total + flat[whole:].sum(dtype=torch.int64)
    return total


def _squares(torch: Any, group: list[Any]) -> Any:
    """float64 sums of squares of ``group`` (one ``_foreach_norm`` per accumulating dtype)."""
    squares: list[Any] = [None] * len(group)
    floats: dict[Any, list[int]] = {}
    for j, t in enumerate(group):
        if t.is_floating_point():
            floats.setdefault(torch.float64 if t.dtype == torch.float64 else torch.float32, []).append(j)
    for wide, members in floats.items():
        norms = torch.stack(torch._foreach_norm([group[j] for j in members], 2, dtype=wide)).double()
        for j, square in zip(members, norms.square().unbind()):
            squares[j] = square
    for j, t in enumerate(group):
        if squares[j] is None:
            squares[j] = (t.abs().double() if t.is_complex() else t.double()).square().sum()
    return torch.stack(squares)


def fingerprints(torch: Any, tensors: list[Any]) -> list[list[Any]]:
    """``[fp, ss]`` of each tensor (torch ops on each tensor's device, one device-to-host copy
    per device): see the module docstring."""
    by_device: dict[Any, list[int]] = {}
    for i, t in enumerate(tensors):
        by_device.setdefault(t.device, []).append(i)
    out: list[list[Any]] = [[]] * len(tensors)
    with torch.no_grad():  # (no autograd bookkeeping for any of these ops)
        for indices in by_device.values():
            group = [tensors[i] for i in indices]
            # a reduction per tensor (a few microseconds each; concatenating the small ones and
            # summing by segments was slower on CPU), then one copy to the host for all values
            sums = torch.stack([bit_sum(torch, t) for t in group])
            values = torch.cat([sums, _squares(torch, group).view(torch.int64)]).tolist()
            n = len(group)
            squares = struct.unpack(f"<{n}d", struct.pack(f"<{n}q", *values[n:]))
            for j, i in enumerate(indices):
                out[i] = [hex64(values[j]), number(squares[j])]
    return out


def scalar_fingerprint(value: float) -> tuple[int, float]:
    """A Python number in the optimizer state, fingerprinted as a float64."""
    return struct.unpack("<q", struct.pack("<d", float(value)))[0], float(value) ** 2


def hyperparameters(group: dict[str, Any]) -> dict[str, Any]:
    """A param group's numbers, bools and lists of numbers (``params`` left out)."""
    out: dict[str, Any] = {}
    for key, value in group.items():
        if key == "params":
            continue
        if isinstance(value, bool):
            out[key] = value
        elif isinstance(value, (int, float)):
            out[key] = number(float(value)) if isinstance(value, float) else value
        elif hasattr(value, "numel") and value.numel() == 1:  # a tensor lr
            out[key] = number(float(value))
        elif isinstance(value, (list, tuple)) and value and all(
                isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
            out[key] = [number(float(v)) if isinstance(v, float) else v for v in value]
    return out


def path_text(path: Any) -> str:
    if isinstance(path, (str, bytes, os.PathLike)):
        return os.fsdecode(path)
    name = getattr(path, "name", None)
    return name if isinstance(name, str) else f"<{type(path).__name__}>"


_LOADER_KEYS = ("_num_yielded", "_sampler_iter_yielded", "sampler_iter_state", "_iterator_finished",
                "_index_sampler_state", "dataset_state")
_RNG_KEYS = ("cpu_rng_state", "rng_state", "torch_rng_state", "cuda_rng_state", "numpy_rng_state",
             "python_rng_state", "torch", "cuda", "numpy", "python", "random", "cpu", "torch.cuda")


def owner_of(value: Any) -> str:
    """What a saved value looks like (docs/step-records.md#kinds)."""
    torch = sys.modules.get("torch")
    if torch is not None:
        for cls_path, owner in (("nn.Module", "model"), ("optim.Optimizer", "optimizer"),
                                ("optim.lr_scheduler.LRScheduler", "scheduler"), ("amp.GradScaler", "scaler")):
            cls: Any = torch
            for part in cls_path.split("."):
                cls = getattr(cls, part, None)
            if isinstance(cls, type) and isinstance(value, cls):
                return owner
        if isinstance(value, torch.Tensor):
            return "rng" if value.dtype == torch.uint8 and value.dim() == 1 and value.numel() >= 16 else "value"
    if type(value).__name__ == "StatefulDataLoader":
        return "loader"
    if isinstance(value, tuple) and len(value) in (3, 5) and (
            (len(value) == 3 and isinstance(value[1], tuple) and len(value[1]) > 600)
            or (len(value) == 5 and value[0] == "MT19937")):
        return "rng"  # random.getstate() / numpy's get_state()
    if isinstance(value, (list, tuple)) and value and len(value) <= 4096 and all(isinstance(v, dict) for v in value):
        # one RNG state per rank, gathered (the digits example's "rng"); Lightning's
        # "optimizer_states" and "lr_schedulers": one state dict per optimizer, per scheduler
        owners = {owner_of(v) for v in value}
        if len(owners) == 1 and owners <= {"rng", "optimizer", "scheduler", "scaler"}:
            return owners.pop()
    if isinstance(value, dict):
        return _owner_of_dict(value, torch)
    return "value"


def _owner_of_dict(value: dict[Any, Any], torch: Any) -> str:
    """What a saved mapping looks like: a state dict of one of the owners, RNG states, weights."""
    keys = {str(k) for k in value}
    if {"state", "param_groups"} <= keys:
        return "optimizer"
    if "last_epoch" in keys or "base_lrs" in keys:
        return "scheduler"
    if "scale" in keys and ("growth_factor" in keys or "_growth_tracker" in keys):
        return "scaler"
    if keys & set(_LOADER_KEYS) or {"epoch", "start_index"} <= keys:
        return "loader"
    if keys and (keys & set(_RNG_KEYS)) == keys:
        return "rng"
    if value and torch is not None and all(isinstance(v, torch.Tensor) for v in value.values()):
        return "model"
    return "value"


def combined(parts: list[tuple[str, int, Any]]) -> list[Any]:
    """One fingerprint of a parameter's optimizer state from its tensors' ``(key, fp, ss)``:
    fp = the sum over the keys in sorted order of fp * (i + 1) mod 2**64, ss = the sum."""
    parts = sorted(parts, key=lambda part: part[0])
    fp = sum(v * (i + 1) for i, (_, v, _) in enumerate(parts)) & MASK
    return [hex64(fp), number(math.fsum(float(ss) for _, _, ss in parts))]  # ("nan", "inf" too)


__all__ = ["MASK", "WORDS_FROM", "bit_sum", "clean_name", "combined", "fingerprints", "hex64", "hyperparameters", "local_shard",
           "number", "owner_of", "path_text", "scalar_fingerprint", "sha16"]
