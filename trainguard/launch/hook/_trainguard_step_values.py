"""The values of the run agent's step records: fingerprints of tensors, parameter names, the
hyperparameters of a param group, what a saved value is (docs/step-records.md).

Standard library only; torch is the job's own, passed in. Loaded by path next to
``_trainguard_step_agent`` (see ``_trainguard_run_agent.sibling``).
"""

from __future__ import annotations

import array
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
#: tensor types that are no DTensor (their own shard)
_PLAIN = frozenset({"Tensor", "Parameter"})
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


def python_rng_print(state: tuple[Any, ...]) -> str:
    """sha16 of ``random.getstate()``: its 625 words as 32-bit integers, then the rest's repr."""
    try:
        words = array.array("I", state[1]).tobytes()
    except (OverflowError, TypeError, IndexError):  # not Mersenne Twister's state
        return sha16(repr(state).encode())
    return sha16(words + repr((state[0], *state[2:])).encode())


#: bytes of numpy's Mersenne Twister state (``mt19937_state``: 624 32-bit words and the position)
_MT19937_BYTES = 624 * 4 + 4


def numpy_rng_print(np_random: Any) -> str:
    """sha16 of numpy's global generator: its Mersenne Twister's state read in place through
    the bit generator's documented ``ctypes.state_address`` (``get_state()`` copies it through
    Python objects: 50 µs); ``get_state()`` where the generator is not an MT19937."""
    generator = getattr(getattr(getattr(np_random, "mtrand", None), "_rand", None), "_bit_generator", None)
    if generator is not None and type(generator) is getattr(np_random, "MT19937", None):
        import ctypes

        return sha16(ctypes.string_at(generator.ctypes.state_address, _MT19937_BYTES))
    state = np_random.get_state()
    return sha16(state[1].tobytes() + repr(state[2:]).encode())


def local_shard(t: Any) -> tuple[Any, str | None]:
    """A DTensor's local shard and its placements, else the tensor itself."""
    if type(t).__name__ in _PLAIN:
        return t, None
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
    mod 2**64, of its row-major bytes read as 64-bit little-endian words, the last word padded
    with zero bytes (a 64-bit reduction reads memory several times faster than a widening one)."""
    flat = _bits(torch, t).reshape(-1)  # a copy only for a non-contiguous tensor
    per = 8 // flat.element_size()
    rest = flat.numel() % per
    if rest:
        flat = torch.cat([flat, flat.new_zeros(per - rest)])
    try:
        return flat.view(torch.int64).sum()
    except RuntimeError:  # a view at an offset that is no whole word: copied
        return flat.clone().view(torch.int64).sum()


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


def _per_tensor(torch: Any, group: list[Any]) -> list[tuple[int, float]]:
    """(fp, ss) of each of ``group`` (tensors of one device): a reduction per tensor, one copy
    to the host."""
    sums = torch.stack([bit_sum(torch, t) for t in group])
    values = torch.cat([sums, _squares(torch, group).view(torch.int64)]).tolist()
    n = len(group)
    squares = struct.unpack(f"<{n}d", struct.pack(f"<{n}q", *values[n:]))
    return list(zip(values[:n], squares))


#: from this many elements on a float32/float64 CPU tensor is fingerprinted where it is, not copied
DIRECT_FROM = 8192
#: the dtypes whose CPU tensors are fingerprinted in one batch through numpy, by name
_BATCHED = {"float32", "float64", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool"}
#: layouts kept (one per distinct list of tensor shapes: an optimizer's parameters, gradients and state)
_MAX_LAYOUTS = 16


class _Buffer:
    """The CPU tensors of one dtype copied into one zeroed buffer, row-major, each from a whole
    64-bit word on (the bytes between stay zero): ``fp`` of each is the sum of its words, ``ss``
    the sum of its squared elements, each a numpy reduction by segment over the whole buffer."""

    def __init__(self, torch: Any, np: Any, dtype: Any, sizes: list[int]) -> None:
        per = 8 // dtype.itemsize  # elements per word
        starts, end = [], 0
        for n in sizes:
            starts.append(end)
            end += -(-n // per) * per
        self.tensor = torch.zeros(end, dtype=dtype)
        self.views = [self.tensor[a:a + n] for a, n in zip(starts, sizes)]
        self.words = _bits(torch, self.tensor).numpy().view(np.int64)
        self.word_starts = np.array([a // per for a in starts], dtype=np.intp)
        self.starts = np.array(starts, dtype=np.intp)
        self.floats = self.tensor.numpy() if dtype in (torch.float32, torch.float64) else None
        self.squares = None if self.floats is None else np.empty_like(self.floats)

    def prints(self, torch: Any, np: Any) -> tuple[list[int], list[float]]:
        fps = np.add.reduceat(self.words, self.word_starts).tolist()
        if self.squares is not None:
            squares = np.square(self.floats, out=self.squares)
        elif self.tensor.is_floating_point():
            squares = np.square(self.tensor.float().numpy())
        else:
            squares = np.square(self.tensor.numpy().astype(np.float64))
        return fps, np.add.reduceat(squares, self.starts, dtype=np.float64).tolist()


class _Layout:
    """Where each CPU tensor of a list goes, for lists of the same shapes and dtypes (an
    optimizer's tensors, step after step): the large float32/float64 ones are read in place (two
    numpy reductions each: one read of the tensor apiece), the others copied by one
    ``_foreach_copy_`` into a :class:`_Buffer` per dtype."""

    def __init__(self, torch: Any, np: Any, group: list[Any]) -> None:
        self.left: list[int] = []  # positions fingerprinted one by one with torch (empty, complex, ...)
        self.direct: list[int] = []  # positions read in place
        members: dict[Any, list[int]] = {}
        for j, t in enumerate(group):
            n = t.numel()
            if n >= DIRECT_FROM and t.dtype in (torch.float32, torch.float64) and n * t.dtype.itemsize % 8 == 0:
                self.direct.append(j)
            elif n and str(t.dtype)[6:] in _BATCHED:
                members.setdefault(t.dtype, []).append(j)
            else:
                self.left.append(j)
        self.buffers = [(_Buffer(torch, np, dtype, [group[j].numel() for j in js]), js) for dtype, js in members.items()]
        self.sources = [j for _, js in self.buffers for j in js]
        self.targets = [v.view(group[j].shape) for buffer, js in self.buffers for v, j in zip(buffer.views, js)]


def _in_place(np: Any, t: Any) -> tuple[int, float]:
    """(fp, ss) of a float32/float64 CPU tensor of whole 64-bit words, read where it is."""
    values = t.detach().numpy()
    if not values.flags.c_contiguous:
        values = np.ascontiguousarray(values)
    values = values.reshape(-1)
    return int(np.add.reduce(values.view(np.int64))), float(np.dot(values, values))


_layouts: dict[tuple[Any, ...], _Layout] = {}


def _batched(torch: Any, np: Any, group: list[Any], out: list[Any], indices: list[int]) -> list[int]:
    """Fingerprint the CPU tensors of ``group`` that a :class:`_Layout` takes into ``out`` (at
    their ``indices``); the positions in ``group`` of those left for :func:`_per_tensor`."""
    key = tuple([(t.dtype, t.shape) for t in group])
    layout = _layouts.get(key)
    if layout is None:
        if len(_layouts) >= _MAX_LAYOUTS:
            _layouts.clear()
        layout = _layouts[key] = _Layout(torch, np, group)
    for j in layout.direct:
        fp, ss = _in_place(np, group[j])
        out[indices[j]] = [format(fp & MASK, "016x"), ss if math.isfinite(ss) else number(ss)]
    if layout.sources:
        torch._foreach_copy_(layout.targets, [group[j] for j in layout.sources])
    for buffer, js in layout.buffers:
        fps, squares = buffer.prints(torch, np)
        for j, fp, ss in zip(js, fps, squares):
            out[indices[j]] = [format(fp & MASK, "016x"), ss if math.isfinite(ss) else number(ss)]
    return layout.left


def fingerprints(torch: Any, tensors: list[Any], numpy: Any = None) -> list[list[Any]]:
    """``[fp, ss]`` of each tensor (docs/step-records.md#fingerprints). CPU tensors of the
    common dtypes in one batch per dtype when ``numpy`` (the job's own) is given; the others
    with torch ops on their device, a reduction per tensor and one copy to the host per device.
    Either way the same values."""
    by_device: dict[Any, list[int]] = {}
    if all(t.is_cpu for t in tensors):
        by_device[None] = list(range(len(tensors)))
    else:
        for i, t in enumerate(tensors):
            by_device.setdefault(t.device, []).append(i)
    out: list[list[Any]] = [[]] * len(tensors)
    with torch.no_grad():  # (no autograd bookkeeping for any of these ops)
        for device, indices in by_device.items():
            group = [tensors[i] for i in indices]
            left = list(range(len(group)))
            if numpy is not None and (device is None or device.type == "cpu"):
                left = _batched(torch, numpy, group, out, indices)
            if left:
                for j, (fp, ss) in zip(left, _per_tensor(torch, [group[j] for j in left])):
                    out[indices[j]] = [hex64(fp), number(ss)]
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
    fp = 0
    squares: list[float] = []
    for i, (_, value, ss) in enumerate(sorted(parts)):
        fp += value * (i + 1)
        squares.append(ss if type(ss) is float else float(ss))  # ("nan", "inf" too)
    return [format(fp & MASK, "016x"), number(math.fsum(squares))]


__all__ = ["DIRECT_FROM", "MASK", "bit_sum", "clean_name", "combined", "fingerprints", "hex64", "hyperparameters", "local_shard",
           "number", "numpy_rng_print", "owner_of", "path_text", "python_rng_print", "scalar_fingerprint", "sha16"]
