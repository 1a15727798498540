"""``torch.distributed.checkpoint`` directories read as data: the ``.metadata`` unpickled with an
explicit list of exact globals, every entry it names checked against the files there, then the
state rebuilt in this process without a process group.

The ``.metadata`` is a pickle. :class:`_MetadataUnpickler` admits only the ``(module, name)``
pairs of :data:`DCP_GLOBALS` (what real saves of DDP, FSDP2/DTensor and ``dcp.async_save``
state name; ``tests/unit/test_dcp_saves.py`` checks the list against them), never a dotted name
(protocol 4 resolves ``a.b.c`` attribute chains, which lead from any module to ``os.system``),
and refuses a ``BUILD`` that would set attributes on a class or a function.
"""

from __future__ import annotations

import io
import pickle
import re
import types
from pathlib import Path
from typing import Any, ClassVar

from trainguard._internal.readers import (
    Deadline,
    OverLimit,
    ReadLimits,
    Unreadable,
    active_limits,
    contained,
    read_bytes,
    regular_size,
    shown_name,
)

__all__ = ["DCP_GLOBALS", "MAX_METADATA_BYTES", "numpy_safe_globals", "read_dcp", "read_dcp_metadata"]

_META = "torch.distributed.checkpoint.metadata"

#: torch dtypes by the name a pickle gives them (``torch.float32`` pickles as ``torch``, ``float32``)
_DTYPE_NAMES = (
    "bfloat16", "bool", "complex128", "complex32", "complex64", "float16", "float32", "float64",
    "float4_e2m1fn_x2", "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz",
    "float8_e8m0fnu", "int16", "int32", "int64", "int8", "qint32", "qint8", "quint2x4",
    "quint4x2", "quint8", "uint16", "uint32", "uint64", "uint8", "bits16", "bits1x8", "bits2x4",
    "bits4x2", "bits8", "int1", "int2", "int3", "int4", "int5", "int6", "int7", "uint1", "uint2",
    "uint3", "uint4", "uint5", "uint6", "uint7",
)
_MEMORY_FORMATS = ("contiguous_format", "channels_last", "channels_last_3d", "preserve_format")

#: every global a DCP ``.metadata`` may name, as exact ``(module, name)`` pairs; anything else
#: (and any dotted name) is refused before it is looked up
DCP_GLOBALS: frozenset[tuple[str, str]] = frozenset({
    (_META, "Metadata"), (_META, "MetadataIndex"), (_META, "StorageMeta"),
    (_META, "TensorStorageMetadata"), (_META, "BytesStorageMetadata"),
    (_META, "ChunkStorageMetadata"), (_META, "TensorProperties"), (_META, "_MEM_FORMAT_ENCODING"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),  # a layout by its name, from a dict of torch's own
    ("torch", "Size"),
    ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"),
    ("pathlib", "PurePosixPath"), ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
    ("builtins", "set"), ("builtins", "frozenset"), ("builtins", "slice"),
    *(("torch", name) for name in (*_DTYPE_NAMES, *_MEMORY_FORMATS)),
})

#: the largest ``.metadata`` read (it describes the entries; the data is in the ``.distcp`` files)
MAX_METADATA_BYTES = 256 * 1024**2

_BUILD = pickle.BUILD[0]


class _DeadlineBytes(io.BytesIO):
    """The metadata's bytes, checking the read's deadline every few thousand reads."""

    def __init__(self, data: bytes, deadline: Deadline) -> None:
        super().__init__(data)
        self._deadline = deadline
        self._reads = 0

    def read(self, size: int | None = -1) -> bytes:
        self._reads += 1
        if not self._reads % 4096:
            self._deadline.check()
        return super().read(size)


class _MetadataUnpickler(pickle._Unpickler):
    """Unpickles a DCP ``.metadata`` and nothing else: the globals of :data:`DCP_GLOBALS`, by
    exact name. The pure-Python unpickler, so that ``BUILD`` can be checked too."""

    dispatch: ClassVar[dict[int, Any]] = dict(pickle._Unpickler.dispatch)  # type: ignore[attr-defined]

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in DCP_GLOBALS:
            raise pickle.UnpicklingError(
                f"the global {shown_name(module)}.{shown_name(name)} has no place in a "
                "torch.distributed.checkpoint metadata file; refused, nothing from the file ran")
        found = super().find_class(module, name)
        if module == "torch" and name not in ("Size",):
            import torch

            if not isinstance(found, (torch.dtype, torch.memory_format)):
                raise pickle.UnpicklingError(f"torch.{name} is not a dtype in this torch; refused")
        return found

    def load_build(self) -> None:
        stack: list[Any] = self.stack  # type: ignore[attr-defined]
        target = stack[-2] if len(stack) > 1 else None
        if isinstance(target, (type, types.FunctionType, types.BuiltinFunctionType, types.ModuleType)):
            raise pickle.UnpicklingError(
                f"the file sets attributes of {getattr(target, '__name__', 'a class')}, which no "
                "torch.distributed.checkpoint metadata does; refused")
        super().load_build()  # type: ignore[misc]

    dispatch[_BUILD] = load_build


def numpy_safe_globals() -> list[Any]:
    """numpy arrays and dtypes: what RNG states saved as ``np.random.get_state()`` hold (plain
    data; weights_only still refuses everything else)."""
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy is a dependency
        return []
    core = getattr(np, "_core", None) or np.core
    allowed: list[Any] = [core.multiarray._reconstruct, core.multiarray.scalar, np.ndarray, np.dtype]
    for code in ("u1", "u2", "u4", "u8", "i1", "i2", "i4", "i8", "f2", "f4", "f8", "b1"):
        allowed.append(type(np.dtype(code)))
    return allowed


def read_dcp_metadata(directory: Path, limits: ReadLimits | None = None) -> Any:
    """The ``.metadata`` of a DCP directory (its ``Metadata`` object), unpickled with nothing but
    :data:`DCP_GLOBALS` admitted and every entry checked against the files it names:
    :class:`~trainguard._internal.readers.Unreadable` naming the file and why otherwise
    (:class:`~trainguard._internal.readers.OverLimit` when over a limit)."""
    limits = limits or active_limits()
    path = directory / ".metadata"
    deadline = Deadline(limits, f"{shown_name(directory.name)}/.metadata")
    metadata_limits = ReadLimits(min(limits.max_bytes, MAX_METADATA_BYTES), limits.max_files, limits.seconds)
    data = read_bytes(path, metadata_limits, root=directory)
    try:
        metadata = _MetadataUnpickler(_DeadlineBytes(data, deadline)).load()
    except OverLimit:
        raise
    except RecursionError:
        raise Unreadable(f"{shown_name(path.name)} nests too deep to unpickle") from None
    except Exception as exc:  # whatever the allowed constructors raise on odd arguments
        raise Unreadable(f"{shown_name(path.name)} is not a torch.distributed.checkpoint metadata "
                         f"file this torch reads: {type(exc).__name__}: {str(exc)[:300]}") from None
    _check_metadata(metadata, directory, limits, deadline)
    return metadata


def _check_metadata(metadata: Any, directory: Path, limits: ReadLimits, deadline: Deadline) -> None:
    """Every entry's file inside ``directory``, regular, and long enough for its offset and
    length; every tensor's size within the byte limit (torch allocates it before reading)."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorStorageMetadata,
    )

    where = f"{shown_name(directory.name)}/.metadata"
    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict):
        raise Unreadable(f"{where} holds a {type(metadata).__name__}, not DCP Metadata")
    storage = metadata.storage_data if isinstance(metadata.storage_data, dict) else None
    if storage is None:
        raise Unreadable(f"{where} names no storage entries")
    sizes: dict[str, int] = {}
    for index, info in storage.items():
        deadline.check()
        if not isinstance(index, MetadataIndex) or not isinstance(info, _StorageInfo):
            raise Unreadable(f"{where}: a storage entry is a {type(info).__name__}, not _StorageInfo")
        name = info.relative_path
        if not isinstance(name, str) or not isinstance(info.offset, int) or not isinstance(info.length, int):
            raise Unreadable(f"{where}: the entry of {shown_name(str(index.fqn))} has no file name, offset or length")
        if name not in sizes:
            if Path(name).is_absolute() or ".." in Path(name).parts:
                raise Unreadable(f"{where}: the entry of {shown_name(str(index.fqn))} names "
                                 f"{shown_name(name)}, outside the checkpoint; refused")
            sizes[name] = regular_size(contained(directory, directory / name), limits)
        if info.offset < 0 or info.length < 0 or info.offset + info.length > sizes[name]:
            raise Unreadable(f"{where}: the entry of {shown_name(str(index.fqn))} asks for bytes "
                             f"{info.offset}..{info.offset + info.length} of {shown_name(name)}, "
                             f"which has {sizes[name]}")
    total = 0
    for fqn, md in metadata.state_dict_metadata.items():
        deadline.check()
        if isinstance(md, BytesStorageMetadata):
            continue
        if not isinstance(md, TensorStorageMetadata):
            raise Unreadable(f"{where}: {shown_name(str(fqn))} is described by a {type(md).__name__}")
        total += _tensor_bytes(md, f"{where}: {shown_name(str(fqn))}")
        if total > limits.max_bytes:
            raise OverLimit(f"{where}: its tensors need more than {limits.max_bytes} bytes, over "
                            "the limit (setting read_max_mb)")


def _tensor_bytes(md: Any, where: str) -> int:
    import torch

    dtype = getattr(md.properties, "dtype", None)
    if not isinstance(dtype, torch.dtype) or not all(isinstance(n, int) and n >= 0 for n in md.size):
        raise Unreadable(f"{where} has no valid dtype and size")
    numel = 1
    for n in md.size:
        numel *= n
    for chunk in md.chunks:
        if len(chunk.offsets) != len(md.size) or len(chunk.sizes) != len(md.size) or any(
                not isinstance(o, int) or not isinstance(s, int) or o < 0 or s < 0 or o + s > n
                for o, s, n in zip(chunk.offsets, chunk.sizes, md.size)):
            raise Unreadable(f"{where}: a chunk lies outside the tensor's size {list(md.size)}")
    return numel * dtype.itemsize


def read_dcp(directory: Path, limits: ReadLimits | None = None) -> tuple[dict[str, Any], dict[str, str]]:
    """The whole state of a ``torch.distributed.checkpoint`` directory, rebuilt in this process
    without a process group: ``(state, skipped)``, where ``skipped`` names the non-tensor
    entries that load only with full unpickling (they read as a marker string instead).
    :class:`~trainguard._internal.readers.Unreadable` when the directory cannot be read."""
    limits = limits or active_limits()
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.metadata import StorageMeta

    metadata = read_dcp_metadata(directory, limits)
    skipped: dict[str, str] = {}

    class SafeReader(dcp.FileSystemReader):
        # no **kwargs: torch then reads no per-rank metadata (there is none to read)
        def read_metadata(self, *args: Any) -> Any:  # type: ignore[override]
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    class SafePlanner(_EmptyStateDictLoadPlanner):
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            fqn = read_item.dest_index.fqn
            try:
                with torch.serialization.safe_globals(numpy_safe_globals()):
                    obj = torch.load(value, map_location="cpu", weights_only=True)
            except Exception as exc:
                refused = re.search(r"Unsupported global: GLOBAL (\S+)", str(exc))
                skipped[fqn] = (f"needs full unpickling (a pickled {refused.group(1)}); not loaded"
                                if refused else f"does not load as data: {str(exc).splitlines()[0][:200]}")
                obj = "<not read: needs full unpickling>"
            # the planner places the value; it only ever sees what the safe load produced
            safe = io.BytesIO()
            torch.save(obj, safe)
            safe.seek(0)
            super().load_bytes(read_item, safe)

    state: dict[str, Any] = {}
    try:
        with warnings.catch_warnings(), _QuietTorchLogs():
            warnings.simplefilter("ignore")  # deprecated name; "assuming a single process"
            dcp.load_state_dict(state, storage_reader=SafeReader(str(directory)),
                                planner=SafePlanner(), no_dist=True)
    except Exception as exc:  # torch raises many kinds for a torn directory
        lines = [line for line in str(exc).splitlines() if line.strip()]
        raise Unreadable(f"{shown_name(directory.name)} does not read as a torch.distributed.checkpoint: "
                         f"{lines[-1][:300] if lines else type(exc).__name__}") from None
    return state, skipped


class _QuietTorchLogs:
    """Torch's DCP loggers print a traceback of a failed load to stderr; trainguard reports the
    reason in words instead, so they are silenced for the load."""

    def __enter__(self) -> None:
        import logging

        self._loggers = [logging.getLogger(n) for n in ("torch.distributed.checkpoint",
                                                        "torch.distributed.checkpoint.logger",
                                                        "torch.distributed.checkpoint.utils")]
        self._levels = [lg.level for lg in self._loggers]
        for lg in self._loggers:
            lg.setLevel(logging.CRITICAL + 1)

    def __exit__(self, *exc: object) -> None:
        for lg, level in zip(self._loggers, self._levels):
            lg.setLevel(level)
