"""The safetensors format, read as data: the header checked against the file's real size, the
tensors read by trainguard itself or by the ``safetensors`` package when it is installed."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict

from trainguard._internal.readers import (
    ReadLimits,
    Unreadable,
    active_limits,
    open_regular,
    read_bytes,
    shown_name,
)

if TYPE_CHECKING:
    import torch

__all__ = ["MAX_SAFETENSORS_HEADER", "TensorInfo", "load_safetensors", "read_safetensors_file",
           "safetensors_header"]


class TensorInfo(TypedDict):
    """One tensor's entry in a safetensors header (JSON), checked by :func:`safetensors_header`."""

    dtype: str
    shape: list[int]
    #: [start, end) in the data after the header
    data_offsets: list[int]


_ST_DTYPES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8",
    "U64": "uint64", "U32": "uint32", "U16": "uint16", "U8": "uint8", "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
}
_ST_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
                "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
#: the largest safetensors header (the format's own limit is 100 MB)
MAX_SAFETENSORS_HEADER = 100 * 1024**2


def _check_tensor_info(path: Path, name: str, info: Any, data_size: int) -> None:
    """One header entry: a known dtype, a shape of non-negative integers, offsets inside the
    data whose span is the shape's bytes; Unreadable naming the tensor otherwise."""
    where = f"{shown_name(path.name)}: tensor {shown_name(str(name))[:80]}"
    if not isinstance(info, dict) or not isinstance(info.get("dtype"), str):
        raise Unreadable(f"{where} has no dtype")
    shape, offsets = info.get("shape"), info.get("data_offsets")
    if not isinstance(shape, list) or not all(type(n) is int and n >= 0 for n in shape):
        raise Unreadable(f"{where} has a shape that is not a list of non-negative integers")
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(type(n) is int for n in offsets)
            or not 0 <= offsets[0] <= offsets[1]):
        raise Unreadable(f"{where} has data offsets {str(offsets)[:60]}, not [start, end]")
    if offsets[1] > data_size:
        raise Unreadable(f"{shown_name(path)} is truncated: tensor {shown_name(str(name))[:80]} ends "
                         f"at data byte {offsets[1]}, the file has {data_size} after its header")
    itemsize = _ST_ITEMSIZE.get(info["dtype"])
    if itemsize is not None:
        numel = 1
        for n in shape:
            numel *= n
        if numel * itemsize != offsets[1] - offsets[0]:
            raise Unreadable(f"{where}: its shape {shape[:8]} needs {numel * itemsize} bytes, its "
                             f"offsets span {offsets[1] - offsets[0]}")


def safetensors_header(path: Path, limits: ReadLimits | None = None) -> tuple[int, dict[str, TensorInfo]]:
    """(header length, the header's tensor entries by name) of a safetensors file, every entry
    checked against the file's real size (its ``__metadata__`` is left out); Unreadable when it
    is not one, is malformed or is shorter than its header says."""
    limits = limits or active_limits()
    with open_regular(path, limits) as handle:
        size = os.fstat(handle.fileno()).st_size
        head = handle.read(8)
        if len(head) < 8:
            raise Unreadable(f"{shown_name(path)} is not a safetensors file: {size} bytes, no header")
        (length,) = struct.unpack("<Q", head)
        if length > size - 8:
            raise Unreadable(f"{shown_name(path)} is truncated: its header says {length} bytes, the file has {size}")
        if length > MAX_SAFETENSORS_HEADER:
            raise Unreadable(f"{shown_name(path)}: its header of {length} bytes is over the format's "
                             f"limit of {MAX_SAFETENSORS_HEADER}")
        try:
            header = json.loads(handle.read(length))
        except (ValueError, RecursionError):
            raise Unreadable(f"{shown_name(path)} is not a safetensors file: its header is not JSON") from None
    if not isinstance(header, dict):
        raise Unreadable(f"{shown_name(path)} is not a safetensors file: its header is not a JSON object")
    data_size = size - 8 - length
    entries: dict[str, TensorInfo] = {}
    for name, info in header.items():
        if name != "__metadata__":
            _check_tensor_info(path, name, info, data_size)
            entries[name] = info
    return length, entries


def read_safetensors_file(path: Path, limits: ReadLimits | None = None) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file, read by trainguard itself (an 8-byte little-endian
    header length, a JSON header of name -> dtype, shape, byte offsets, then the raw bytes)."""
    limits = limits or active_limits()
    import torch

    length, header = safetensors_header(path, limits)
    data = read_bytes(path, limits)[8 + length:]
    tensors: dict[str, torch.Tensor] = {}
    for name, info in header.items():
        dtype = getattr(torch, _ST_DTYPES.get(info["dtype"], ""), None)
        if dtype is None:
            raise Unreadable(f"{shown_name(path)}: tensor {name} has dtype {info['dtype']}, which this torch lacks")
        start, end = info["data_offsets"]
        chunk = bytearray(data[start:end])
        tensor = torch.frombuffer(chunk, dtype=dtype) if chunk else torch.empty(0, dtype=dtype)
        tensors[name] = tensor.reshape(info["shape"])
    return tensors


def load_safetensors(path: Path, limits: ReadLimits | None = None) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file, its header checked first: with the ``safetensors``
    package when it is installed (it comes with transformers), else :func:`read_safetensors_file`."""
    limits = limits or active_limits()
    safetensors_header(path, limits)  # a clear error for a torn or malformed file, whichever reader follows
    try:
        from safetensors.torch import load_file
    except ImportError:
        return read_safetensors_file(path, limits)
    try:
        return dict(load_file(str(path), device="cpu"))
    except Exception as exc:  # the package's own errors for what the check let by
        raise Unreadable(f"{shown_name(path)} is not a readable safetensors file: {str(exc)[:200]}") from None
