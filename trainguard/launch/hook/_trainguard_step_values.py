"""The values of the run agent's step records: fingerprints of tensors, parameter names, the
hyperparameters of a param group, what a saved value is (docs/step-records.md).

Standard library only; torch is the job's own, passed in. Loaded by path next to
``_trainguard_step_agent`` (see ``_trainguard_run_agent.sibling``).
"""

from __future__ import annotations

import array
import hashlib
import json
import math
import operator
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


#: significant digits of a sum of squares as written (9 give a float32's value back; the reader
#: compares sums of squares within a relative 1e-3 at the least, fingerprints exactly by ``fp``);
#: fewer digits than Python's shortest repr are several times cheaper to write
SS_DIGITS = 9


def square_sum(value: float) -> float | str:
    """A sum of squares as a record writes it: :data:`SS_DIGITS` significant digits, NaN and
    the infinities as strings."""
    return number(float(f"{value:.{SS_DIGITS}g}"))


def hex64(value: int) -> str:
    return format(value & MASK, "016x")


def sha16(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


def _python_rng_bytes(state: tuple[Any, ...]) -> bytes:
    """What :func:`python_rng_print` hashes: ``random.getstate()``'s 625 words as 32-bit
    integers, then the rest's repr."""
    try:
        words = array.array("I", state[1]).tobytes()
    except (OverflowError, TypeError, IndexError):  # not Mersenne Twister's state
        return repr(state).encode()
    return words + repr((state[0], *state[2:])).encode()


def python_rng_print(state: tuple[Any, ...]) -> str:
    """sha16 of ``random.getstate()``: its 625 words as 32-bit integers, then the rest's repr."""
    return sha16(_python_rng_bytes(state))


#: bytes of numpy's Mersenne Twister state (``mt19937_state``: 624 32-bit words and the position)
_MT19937_BYTES = 624 * 4 + 4
#: CPython's ``_random.Random`` object after its header: ``int index; uint32_t state[624]``
_PY_MT_OFFSET = object.__basicsize__


def numpy_rng_print(np_random: Any) -> str:
    """sha16 of numpy's global generator (:class:`RngPrints`)."""
    return sha16(_numpy_rng_bytes(np_random))


def _numpy_rng_bytes(np_random: Any) -> bytes:
    """numpy's global generator's state: its Mersenne Twister's state read in place through
    the bit generator's documented ``ctypes.state_address`` (``get_state()`` copies it through
    Python objects: 50 µs); ``get_state()`` where the generator is not an MT19937."""
    generator = getattr(getattr(getattr(np_random, "mtrand", None), "_rand", None), "_bit_generator", None)
    if generator is not None and type(generator) is getattr(np_random, "MT19937", None):
        import ctypes  # (loaded by numpy already)

        return ctypes.string_at(generator.ctypes.state_address, _MT19937_BYTES)
    state = np_random.get_state()
    return bytes(state[1].tobytes() + repr(state[2:]).encode())


class RngPrints:
    """The ``rng`` fingerprints of a step (docs/step-records.md#kinds): sha16 of each
    generator's state bytes, hashed again only when the bytes changed since the previous step
    (a generator the job does not draw from keeps its bytes). Python's generator is read in
    place, like numpy's: the bytes ``random.getstate()`` gives, from the Mersenne Twister's
    words in CPython's ``_random.Random`` object, once checked against ``getstate()`` (any
    other layout: ``getstate()`` each time, 625 Python integers made and packed)."""

    def __init__(self) -> None:
        self.last: dict[Any, tuple[bytes, str]] = {}
        self.python_in_place: bool | None = None  # None: not checked yet

    def sha(self, kind: Any, data: bytes) -> str:
        known = self.last.get(kind)
        if known is not None and known[0] == data:
            return known[1]
        digest = sha16(data)
        self.last[kind] = (data, digest)
        return digest

    def python(self, random: Any) -> str:
        inst = getattr(random, "_inst", None)
        if self.python_in_place is None:
            self.python_in_place = inst is not None and self._python_in_place(inst) == _python_rng_bytes(inst.getstate())
        data = self._python_in_place(inst) if self.python_in_place else _python_rng_bytes(random.getstate())
        return self.sha("python", data)

    @staticmethod
    def _python_in_place(inst: Any) -> bytes:
        import ctypes  # (at the first step: loaded by then, by torch)

        raw = ctypes.string_at(id(inst) + _PY_MT_OFFSET, _MT19937_BYTES)
        return raw[4:] + raw[:4] + repr((inst.VERSION, inst.gauss_next)).encode()

    def numpy(self, np_random: Any) -> str:
        return self.sha("numpy", _numpy_rng_bytes(np_random))


def local_shard(t: Any) -> tuple[Any, str | None]:
    """A DTensor's local shard and its placements, else the tensor itself."""
    if type(t).__name__ in _PLAIN:
        return t, None
    if hasattr(t, "to_local") and hasattr(t, "placements"):
        return t.to_local(), str(t.placements)
    return t, None


def storage_key(t: Any) -> tuple[Any, ...] | None:
    """Where ``t``'s (a DTensor's: its local shard's) elements are: its storage, offset, shape and
    dtype; None when it has no storage to read. Two parameter objects with one key are one
    tensor: torch's TP + DDP recipe (``_pre_dp_module_transform``) puts a new ``Parameter``
    over the same local shard in the module at every forward, while the optimizer holds the
    first."""
    t = local_shard(t)[0]
    try:
        return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), str(t.dtype))
    except Exception:  # a tensor without storage (meta, fake, a subclass's)
        return None


def names_by_storage(modules: list[Any], missing: list[Any]) -> dict[int, str]:
    """id(parameter) -> the name of the module's parameter, or tensor attribute, over the same
    elements (:func:`storage_key`), for ``missing``: the optimizer's parameters no module holds by
    identity. torch's TP + DDP recipe (``_pre_dp_module_transform``) leaves in the module, from
    its first forward on, DTensors over the optimizer's parameters as plain attributes. The root
    modules (held by no other) only."""
    wanted: dict[tuple[Any, ...], int] = {}
    for p in missing:
        key = storage_key(p)
        if key is not None:
            wanted.setdefault(key, id(p))
    inner = {id(c) for m in modules for c in m.children()}
    out: dict[int, str] = {}
    for m in modules:
        if id(m) in inner:
            continue
        for name, q in _tensors_of(m):
            key = storage_key(q)
            found = wanted.get(key) if key is not None else None
            if found is not None:
                out.setdefault(found, clean_name(name))
    return out


def _tensors_of(module: Any) -> list[tuple[str, Any]]:
    """``module``'s parameters, then its submodules' public tensor attributes, by name."""
    out: list[tuple[str, Any]] = list(module.named_parameters())
    for prefix, sub in module.named_modules():
        out += [(f"{prefix}.{attr}" if prefix else attr, value) for attr, value in vars(sub).items()
                if not attr.startswith("_") and hasattr(value, "untyped_storage") and hasattr(value, "shape")]
    return out


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
    return [(fp & MASK, ss) for fp, ss in zip(values[:n], squares)]


#: from this many elements on a float32/float64 CPU tensor is read where it is, not copied (two
#: numpy reductions over the tensor cost more than copying it into the batch below this size) ...
DIRECT_FROM = 1 << 16
#: ... and any such tensor once the batch of a layout holds this many bytes (a bound on its copy)
BATCH_BYTES = 16 << 20
#: the dtypes whose CPU tensors are fingerprinted in one batch, by name
_BATCHED = {"float32", "float64", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool"}
#: bytes of one row of a batch buffer (each tensor starts a row)
_ROW_BYTES = 512
#: layouts kept (one per distinct list of tensor shapes: an optimizer's parameters, gradients and state)
_MAX_LAYOUTS = 16


class _Rows:
    """The CPU tensors of one dtype copied into one zeroed buffer of rows of ``_ROW_BYTES``, each
    tensor from a row's start on, row-major (the bytes after it to its last row's end stay zero):
    ``fp`` of each is a numpy sum by segment of the buffer's 64-bit words, ``ss`` the sum by
    segment of the rows' squared norms (one torch reduction over all rows, float64 from there
    on), whatever the number of tensors."""

    def __init__(self, torch: Any, np: Any, dtype: Any, sizes: list[int]) -> None:
        width = _ROW_BYTES // dtype.itemsize  # elements per row
        starts, rows = [], 0
        for n in sizes:
            starts.append(rows)
            rows += -(-n // width)
        self.tensor = torch.zeros(rows * width, dtype=dtype)
        self.views = [self.tensor[a * width:a * width + n] for a, n in zip(starts, sizes)]
        self.words = _bits(torch, self.tensor).numpy().view(np.int64)
        self.word_starts = np.array(starts, dtype=np.intp) * (_ROW_BYTES // 8)
        self.row_starts = np.array(starts, dtype=np.intp)
        self.rows = self.tensor.view(rows, width)
        self.half = dtype in (torch.float16, torch.bfloat16)

    def prints(self, torch: Any, np: Any) -> tuple[list[int], list[float]]:
        fps = np.add.reduceat(self.words, self.word_starts)
        if self.rows.is_floating_point():
            norms = torch.linalg.vector_norm(self.rows, dim=1, dtype=torch.float32 if self.half else None)
            squares = np.square(norms.numpy(), dtype=np.float64)
        else:
            squares = np.square(self.rows.numpy(), dtype=np.float64).sum(axis=1)
        return fps.view(np.uint64).tolist(), np.add.reduceat(squares, self.row_starts).tolist()


class _Layout:
    """Where each CPU tensor of a list goes, for lists of the same shapes and dtypes (an
    optimizer's tensors, step after step): the large float32/float64 ones, and those past the
    batch's bound, are read in place (two numpy reductions each: one read of the tensor
    apiece), the others copied by one ``_foreach_copy_`` into :class:`_Rows` per dtype."""

    def __init__(self, torch: Any, np: Any, group: list[Any]) -> None:
        self.left: list[int] = []  # positions fingerprinted one by one with torch (empty, complex, ...)
        self.direct: list[int] = []  # positions read in place
        members: dict[Any, list[int]] = {}
        batched = 0  # bytes
        for j, t in enumerate(group):
            n = t.numel()
            size = n * t.dtype.itemsize
            if (t.dtype in (torch.float32, torch.float64) and size % 8 == 0
                    and (n >= DIRECT_FROM or batched + size > BATCH_BYTES)):
                self.direct.append(j)
            elif n and str(t.dtype)[6:] in _BATCHED:
                members.setdefault(t.dtype, []).append(j)
                batched += size
            else:
                self.left.append(j)
        self.buffers = [(_Rows(torch, np, dtype, [group[j].numel() for j in js]), js) for dtype, js in members.items()]
        self.sources = [j for _, js in self.buffers for j in js]
        self.targets = [v.view(group[j].shape) for buffer, js in self.buffers for v, j in zip(buffer.views, js)]
        #: the whole group is one buffer in order: its results are the group's
        self.whole = len(self.buffers) == 1 and self.sources == list(range(len(group)))


def _in_place(np: Any, t: Any) -> tuple[int, float]:
    """(fp, ss) of a float32/float64 CPU tensor of whole 64-bit words, read where it is."""
    values = (t.detach() if t.requires_grad else t).numpy()
    if not values.flags.c_contiguous:
        values = np.ascontiguousarray(values)
    values = values.reshape(-1)
    return int(np.add.reduce(values.view(np.int64))) & MASK, float(np.dot(values, values))


_layouts: dict[tuple[Any, ...], _Layout] = {}


def _batched(torch: Any, np: Any, group: list[Any], fps: list[int], squares: list[float],
             indices: list[int]) -> list[int]:
    """Fingerprint the CPU tensors of ``group`` that a :class:`_Layout` takes into ``fps`` and
    ``squares`` (at their ``indices``); the positions in ``group`` of those left for
    :func:`_per_tensor`."""
    key = tuple([(t.dtype, t.shape) for t in group])
    layout = _layouts.get(key)
    if layout is None:
        if len(_layouts) >= _MAX_LAYOUTS:
            _layouts.clear()
        layout = _layouts[key] = _Layout(torch, np, group)
    if layout.sources:
        torch._foreach_copy_(layout.targets, [group[j] for j in layout.sources])
    if layout.whole and len(indices) == len(fps):
        fps[:], squares[:] = layout.buffers[0][0].prints(torch, np)
        return []
    for buffer, js in layout.buffers:
        for j, fp, ss in zip(js, *buffer.prints(torch, np)):
            fps[indices[j]], squares[indices[j]] = fp, ss
    for j in layout.direct:
        fps[indices[j]], squares[indices[j]] = _in_place(np, group[j])
    return layout.left


def raw_prints(torch: Any, tensors: list[Any], numpy: Any = None, *,
               cpu: bool = False) -> tuple[list[int], list[float]]:
    """The ``fp`` (an integer in [0, 2**64)) and ``ss`` (a float, NaN and the infinities as they
    are) of each tensor (docs/step-records.md#fingerprints). CPU tensors of the common dtypes in
    one batch per dtype when ``numpy`` (the job's own) is given; the others with torch ops on
    their device, a reduction per tensor and one copy to the host per device. Either way the same
    ``fp``. ``cpu``: the caller knows they were all on the CPU when it laid them out (one that
    moved since still gets its values: copied into the batch, or an error where it would have
    been read in place)."""
    by_device: dict[Any, list[int]] = {}
    if cpu or all(t.is_cpu for t in tensors):
        by_device[None] = list(range(len(tensors)))
    else:
        for i, t in enumerate(tensors):
            by_device.setdefault(t.device, []).append(i)
    fps: list[int] = [0] * len(tensors)
    squares: list[float] = [0.0] * len(tensors)
    grad_was = torch.is_grad_enabled()  # (no autograd bookkeeping for any of these ops; not
    torch._C._set_grad_enabled(False)  # torch.no_grad(): its Python costs 4x the calls)
    try:
        for device, indices in by_device.items():
            group = [tensors[i] for i in indices] if device is not None else tensors
            left = list(range(len(group)))
            if numpy is not None and (device is None or device.type == "cpu"):
                left = _batched(torch, numpy, group, fps, squares, indices)
            if left:
                for j, (fp, ss) in zip(left, _per_tensor(torch, [group[j] for j in left])):
                    fps[indices[j]], squares[indices[j]] = fp, ss
    finally:
        torch._C._set_grad_enabled(grad_was)
    return fps, squares


def fingerprints(torch: Any, tensors: list[Any], numpy: Any = None) -> list[list[Any]]:
    """``[fp, ss]`` of each tensor as a record writes them (:func:`raw_prints`)."""
    return [[format(fp, "016x"), square_sum(ss)] for fp, ss in zip(*raw_prints(torch, tensors, numpy))]


def scalar_fingerprint(value: float) -> tuple[int, float]:
    """A Python number in the optimizer state, fingerprinted as a float64."""
    return struct.unpack("<q", struct.pack("<d", float(value)))[0], float(value) ** 2


def hyperparameters(group: dict[str, Any]) -> dict[str, Any]:
    """A param group's numbers, bools and lists of numbers (``params`` left out)."""
    out: dict[str, Any] = {}
    isfinite = math.isfinite
    for key, value in group.items():
        kind = type(value)
        if kind is float:  # (the common types first: this runs at every step)
            out[key] = value if isfinite(value) else number(value)
        elif kind is bool or kind is int:
            out[key] = value
        elif value is None or kind is str or key == "params":
            continue
        elif (kind is tuple or kind is list) and all([type(v) is float and isfinite(v) for v in value]) and value:
            out[key] = list(value)  # (betas)
        elif isinstance(value, bool):
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


#: torch's classes whose objects saved whole are an owner's (found once: :func:`_owner_classes`)
_OWNER_CLASSES: list[tuple[type, str]] = []


def _owner_classes(torch: Any) -> list[tuple[type, str]]:
    if not _OWNER_CLASSES:
        for cls_path, owner in (("nn.Module", "model"), ("optim.Optimizer", "optimizer"),
                                ("optim.lr_scheduler.LRScheduler", "scheduler"), ("amp.GradScaler", "scaler")):
            cls: Any = torch
            for part in cls_path.split("."):
                cls = getattr(cls, part, None)
            if isinstance(cls, type):
                _OWNER_CLASSES.append((cls, owner))
    return _OWNER_CLASSES


def owner_of(value: Any) -> str:
    """What a saved value looks like (docs/step-records.md#kinds)."""
    torch = sys.modules.get("torch")
    if torch is not None:
        for cls, owner in _owner_classes(torch):
            if isinstance(value, cls):
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


def _sum(squares: list[float] | tuple[float, ...]) -> float:
    """The exact sum of a parameter's state tensors' ``ss`` (NaN where infinities of both signs
    meet, an infinity where it overflows)."""
    try:
        return math.fsum(squares)
    except ValueError:
        return math.nan
    except OverflowError:
        return math.copysign(math.inf, sum(squares))


def combined(parts: list[tuple[str, int, Any]]) -> list[Any]:
    """One fingerprint of a parameter's optimizer state from its tensors' ``(key, fp, ss)``:
    fp = the sum over the keys in sorted order of fp * (i + 1) mod 2**64, ss = the sum."""
    fp = 0
    squares: list[float] = []
    for i, (_, value, ss) in enumerate(sorted(parts)):
        fp += value * (i + 1)
        squares.append(ss if type(ss) is float else float(ss))  # ("nan", "inf" too)
    return [format(fp & MASK, "016x"), square_sum(_sum(squares))]


class Raw(str):
    """A record's value as JSON text, written as it is (``StepAgent`` splices it into the line)."""


#: a parameter without optimizer state
_NO_STATE: dict[Any, Any] = {}
#: one fingerprint in a :class:`StepPlan`'s text: fp as 16 hex digits, ss with :data:`SS_DIGITS` digits
_SLOT = f'["%016x",%.{SS_DIGITS}g]'


class StepPlan:
    """The ``param``, ``grad`` and ``optim`` of one optimizer's step records, laid out once: the
    tensors to fingerprint in one list (its parameters, their gradients, each parameter's state
    tensors in sorted key order) and the JSON text of each of the three with a slot per
    fingerprint, filled by one ``%`` formatting: no per-tensor Python beyond gathering the list.
    :meth:`tensors` says None when the layout no longer fits (another parameter, a gradient
    present or absent, a state key more or less): the caller makes a new plan. Only for plain
    tensors with tensor-only state (``usable``): DTensors and Python numbers in the state take
    the agent's general way."""

    def __init__(self, optimizer: Any, named: list[tuple[str, Any]]) -> None:
        self.named = named
        self.names = [name for name, _ in named]
        self.params = [p for _, p in named]
        self.has_grad = [p.grad is not None for p in self.params]
        states = [optimizer.state.get(p, _NO_STATE) for p in self.params]
        self.keys = [tuple(sorted(state, key=str)) for state in states]
        self.state_count = sum(map(len, states))
        self.usable = all(type(p).__name__ in _PLAIN for p in self.params) and all(
            hasattr(value, "detach") for state in states for value in state.values())
        self.sizes = (len(self.params), sum(self.has_grad))
        counts = {len(keys) for keys in self.keys if keys}
        self.uniform = counts.pop() if len(counts) == 1 else 0  # the key count of each with state
        self.weights = range(1, max(map(len, self.keys), default=0) + 1)
        self.cpu = all(p.is_cpu for p in self.params) and all(
            value.is_cpu for state in states for value in state.values() if hasattr(value, "is_cpu"))
        texts = [json.dumps(name).replace("%", "%%") for name in self.names]
        self.param_text = "{" + ",".join(f"{n}:{_SLOT}" for n in texts) + "}"
        self.grad_text = "{" + ",".join(f"{n}:{_SLOT if g else 'null'}" for n, g in zip(texts, self.has_grad)) + "}"
        self.optim_text = "{" + ",".join(f"{n}:{_SLOT}" for n, k in zip(texts, self.keys) if k) + "}"

    def fits(self, params: list[Any]) -> bool:
        """Whether ``params`` (the optimizer's now, in group order) are the plan's."""
        return len(params) == len(self.params) and all(map(operator.is_, params, self.params))

    def tensors(self, optimizer: Any, state: bool = True) -> list[Any] | None:
        """The tensors to fingerprint now, in the plan's order (without the optimizer state's
        unless ``state``); None: the plan no longer fits."""
        params = self.params
        grads = [p.grad for p in params]
        if [g is not None for g in grads] != self.has_grad:
            return None
        if not state:
            return [*params, *[g for g in grads if g is not None]]
        held_by = optimizer.state
        states = [held_by.get(p, _NO_STATE) for p in params]
        if sum(map(len, states)) != self.state_count:
            return None
        try:
            held = [s[k] for s, keys in zip(states, self.keys) for k in keys]
        except KeyError:
            return None
        return [*params, *[g for g in grads if g is not None], *held]

    def texts(self, fps: list[int], squares: list[float], state: bool = True) -> dict[str, Any]:
        """``param``, ``grad`` and ``optim`` of the record from the fingerprints of
        :meth:`tensors` (``optim`` an empty dict when no parameter has state yet, None when
        not ``state``: not read at this step)."""
        n = self.sizes[0] + self.sizes[1]
        if not state:
            held_fp, held_ss = [], []
        elif self.uniform:  # (each parameter with state has the same keys: Adam, SGD with momentum)
            k = self.uniform
            columns = [fps[n + i::k] for i in range(k)]
            held_fp = [sum(map(operator.mul, values, self.weights)) & MASK for values in zip(*columns)]
            held_ss = [_sum(values) for values in zip(*[squares[n + i::k] for i in range(k)])]
        else:
            held_fp, held_ss, i = [], [], n
            for keys in self.keys:
                if keys:
                    held_fp.append(sum(map(operator.mul, fps[i:i + len(keys)], self.weights)) & MASK)
                    held_ss.append(_sum(squares[i:i + len(keys)]))
                    i += len(keys)
        out_ss = [*squares[:n], *held_ss]
        total = sum(out_ss)
        if total - total != 0:  # a NaN or an infinity: JSON carries them as strings
            slots: list[Any] = [[hex64(fp), square_sum(ss)] for fp, ss in zip([*fps[:n], *held_fp], out_ss)]
            return {**self._dicts(slots), **({} if state else {"optim": None})}
        values: list[Any] = [0] * (2 * len(out_ss))
        values[0::2] = [*fps[:n], *held_fp]
        values[1::2] = out_ss
        a, b = 2 * self.sizes[0], 2 * n
        return {"param": Raw(self.param_text % tuple(values[:a])), "grad": Raw(self.grad_text % tuple(values[a:b])),
                "optim": Raw(self.optim_text % tuple(values[b:])) if held_fp else {} if state else None}

    def _dicts(self, slots: list[Any]) -> dict[str, Any]:
        grads = iter(slots[self.sizes[0]:])
        held = iter(slots[self.sizes[0] + self.sizes[1]:])
        return {"param": dict(zip(self.names, slots)),
                "grad": {n: next(grads) if g else None for n, g in zip(self.names, self.has_grad)},
                "optim": {n: next(held) for n, k in zip(self.names, self.keys) if k}}


__all__ = ["DIRECT_FROM", "MASK", "Raw", "RngPrints", "StepPlan", "bit_sum", "clean_name", "combined", "fingerprints", "hex64",
           "hyperparameters", "local_shard", "names_by_storage", "number", "numpy_rng_print", "owner_of", "path_text",
           "python_rng_print", "raw_prints", "scalar_fingerprint", "sha16", "square_sum", "storage_key"]
