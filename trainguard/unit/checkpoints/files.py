"""Checkpoints on disk: which one is the newest complete one, and reading one into plain values.

A checkpoint is one of

* a Hugging Face Trainer directory ``checkpoint-N/`` (weights as ``model.safetensors`` or shards
  named by ``model.safetensors.index.json``, ``optimizer.pt``, ``scheduler.pt``,
  ``rng_state.pth`` / ``rng_state_{rank}.pth``, ``trainer_state.json``, ``training_args.bin``);
  the Trainer writes ``trainer_state.json`` last, so the directory is complete once it is there
  and every shard its index names is present;
* a ``torch.distributed.checkpoint`` directory: complete once its ``.metadata`` is written (the
  coordinator writes it after every rank's data);
* another directory whose name carries a step (``step-10/``, ``checkpoint_3/``) holding state
  files (accelerate's ``save_state`` layout, say);
* one file: ``.pt``/``.pth``/``.ckpt``/``.bin``/``.tar`` (torch pickles, Lightning's ``.ckpt``)
  or ``.safetensors``.

Temporary names of a write in progress (dot-prefixed, ``*.tmp*``, ``tmp*``, ``*.part``) are never
checkpoints. Everything is read without running code from the files: torch pickles with
``weights_only=True``, the DCP metadata with an unpickler that admits only its own classes.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import re
import struct
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "CHECKPOINT_SUFFIXES",
    "FILE_SUFFIXES",
    "NOT_STATE",
    "Candidate",
    "CheckpointContents",
    "checkpoint_candidates",
    "describe_candidates",
    "find_checkpoints",
    "is_checkpoint_dir",
    "is_temp_name",
    "latest_complete_checkpoint",
    "load_checkpoint",
    "load_safetensors",
    "read_checkpoint",
    "read_dcp",
    "read_dcp_metadata",
    "read_safetensors_file",
    "resolve_checkpoint",
    "step_in_name",
]

#: suffixes of torch checkpoint files (pickles in torch's zip format)
CHECKPOINT_SUFFIXES = (".pt", ".pth", ".ckpt", ".bin", ".tar")
#: suffixes of a checkpoint that is one file
FILE_SUFFIXES = (*CHECKPOINT_SUFFIXES, ".safetensors")
#: files found among checkpoints that are not training state, with why they are not read
NOT_STATE = {
    "training_args.bin": "the Trainer's arguments: a pickled TrainingArguments object (configuration, "
                         "not training state) that loads only with full unpickling",
}

_HF_DIR = re.compile(r"^checkpoint-(\d+)$")
_STEP_DIR = re.compile(r"(?:checkpoint|ckpt|step|steps|iter|iteration|global_step|epoch)[-_=]?\d+",
                       re.IGNORECASE)
_STEP_IN_NAME = re.compile(r"(?:global_step|step|steps|iter|iteration|it|ckpt|checkpoint)[-_=]?0*(\d+)",
                           re.IGNORECASE)
_EPOCH_IN_NAME = re.compile(r"epoch[-_=]?0*(\d+)", re.IGNORECASE)
_LAST_NUMBER = re.compile(r"(\d+)(?!.*\d)")
_DATE_IN_NAME = re.compile(r"(?<!\d)(?:19|20)\d\d-[01]\d-[0-3]\d(?!\d)")
_INDEX_SUFFIX = ".index.json"


def is_temp_name(name: str) -> bool:
    """Whether a file or directory name is a temporary of a write in progress (``.x``,
    ``x.tmp``, ``x.pt.tmp123``, ``tmp-checkpoint-5``, ``tmpab12``, ``x.part``, ``x~``)."""
    lower = name.lower()
    return (name.startswith(".") or ".tmp" in lower or lower.startswith("tmp")
            or lower.endswith(("~", ".part", ".partial", ".incomplete")))


def step_in_name(name: str) -> int | None:
    """The step a checkpoint's name carries: after ``step``/``iter``/``checkpoint``/``ckpt``
    (``epoch=1-step=20.ckpt`` -> 20, ``checkpoint-500`` -> 500), else after ``epoch``, else the
    last number; None for ``last.ckpt``, ``latest.pt`` and names without a number."""
    stem = name[: -len(Path(name).suffix)] if Path(name).suffix in FILE_SUFFIXES else name
    if stem.lower().startswith(("last", "latest")) or _DATE_IN_NAME.search(stem):
        return None  # a date is no step: Ray Train's checkpoint_2026-11-25_13-01-02.123456
    match = _STEP_IN_NAME.search(stem) or _EPOCH_IN_NAME.search(stem) or _LAST_NUMBER.search(stem)
    return int(match.group(1)) if match else None


def find_checkpoints(directory: Path) -> list[Path]:
    """Torch checkpoint files under ``directory``, oldest first (by modification time, then name).

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


def _numpy_safe_globals() -> list[Any]:
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


def load_checkpoint(path: Path) -> Any:
    """``torch.load(path, weights_only=True, map_location="cpu")`` (numpy arrays allowed, as
    RNG states hold them); raises ValueError with a clear message when the file needs full
    unpickling or is not a torch checkpoint."""
    import torch

    try:
        with torch.serialization.safe_globals(_numpy_safe_globals()):
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
    except (RuntimeError, OSError, EOFError, ValueError) as exc:
        raise ValueError(f"{path} is not a loadable torch checkpoint: {exc}") from None


# --------------------------------------------------------------------------------------------
# safetensors
# --------------------------------------------------------------------------------------------

_ST_DTYPES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8",
    "U64": "uint64", "U32": "uint32", "U16": "uint16", "U8": "uint8", "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
}


def _safetensors_header(path: Path) -> tuple[int, dict[str, Any]]:
    """(header length, header) of a safetensors file; ValueError when it is not one or is
    shorter than its header says (a torn write)."""
    size = path.stat().st_size
    with open(path, "rb") as handle:
        head = handle.read(8)
        if len(head) < 8:
            raise ValueError(f"{path} is not a safetensors file: {size} bytes, no header")
        (length,) = struct.unpack("<Q", head)
        if length > size - 8:
            raise ValueError(f"{path} is truncated: its header says {length} bytes, the file has {size}")
        try:
            header = json.loads(handle.read(length))
        except ValueError:
            raise ValueError(f"{path} is not a safetensors file: its header is not JSON") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path} is not a safetensors file: its header is not a JSON object")
    end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
    if 8 + length + end > size:
        raise ValueError(f"{path} is truncated: its tensors end at byte {8 + length + end}, the file "
                         f"has {size}")
    return length, header


def read_safetensors_file(path: Path) -> dict[str, Any]:
    """The tensors of a safetensors file, read by trainguard itself (an 8-byte little-endian
    header length, a JSON header of name -> dtype, shape, byte offsets, then the raw bytes)."""
    import torch

    length, header = _safetensors_header(path)
    data = path.read_bytes()[8 + length:]
    tensors: dict[str, Any] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = getattr(torch, _ST_DTYPES.get(info["dtype"], ""), None)
        if dtype is None:
            raise ValueError(f"{path}: tensor {name} has dtype {info['dtype']}, which this torch lacks")
        start, end = (int(x) for x in info["data_offsets"])
        shape = [int(x) for x in info["shape"]]
        chunk = bytearray(data[start:end])
        tensor = torch.frombuffer(chunk, dtype=dtype) if chunk else torch.empty(0, dtype=dtype)
        tensors[name] = tensor.reshape(shape)
    return tensors


def load_safetensors(path: Path) -> dict[str, Any]:
    """The tensors of a safetensors file: with the ``safetensors`` package when it is installed
    (it comes with transformers), else :func:`read_safetensors_file`."""
    _safetensors_header(path)  # a clear error for a torn file, whichever reader follows
    try:
        from safetensors.torch import load_file
    except ImportError:
        return read_safetensors_file(path)
    return dict(load_file(str(path), device="cpu"))


# --------------------------------------------------------------------------------------------
# torch.distributed.checkpoint
# --------------------------------------------------------------------------------------------

#: what a DCP ``.metadata`` pickle may name besides the classes of
#: ``torch.distributed.checkpoint.metadata``
_DCP_GLOBALS = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),
    ("torch", "Size"),
    ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"),
    ("pathlib", "PurePosixPath"), ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
    ("builtins", "set"), ("builtins", "frozenset"), ("builtins", "slice"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles a DCP ``.metadata`` file and nothing else: its dataclasses, torch dtypes and
    sizes, paths; any other global is refused (no code from the file runs)."""

    def find_class(self, module: str, name: str) -> Any:
        import torch

        if module == "torch.distributed.checkpoint.metadata" or (module, name) in _DCP_GLOBALS:
            found = super().find_class(module, name)
            if isinstance(found, type) or (module, name) in _DCP_GLOBALS:
                return found
        if module == "torch" and isinstance(getattr(torch, name, None),
                                            (torch.dtype, torch.layout, torch.memory_format)):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} has no place in a torch.distributed.checkpoint "
                                     "metadata file; not unpickled")


def read_dcp_metadata(directory: Path) -> Any:
    """The ``.metadata`` of a DCP directory (its ``Metadata`` object), unpickled with nothing
    but its own classes admitted; ValueError naming the file otherwise."""
    path = directory / ".metadata"
    try:
        with open(path, "rb") as handle:
            return _MetadataUnpickler(handle).load()
    except (OSError, pickle.UnpicklingError, EOFError, AttributeError, ImportError, TypeError,
            ValueError) as exc:
        raise ValueError(f"{path} is not a torch.distributed.checkpoint metadata file this torch "
                         f"reads: {exc}") from None


def read_dcp(directory: Path) -> tuple[dict[str, Any], dict[str, str]]:
    """The whole state of a ``torch.distributed.checkpoint`` directory, rebuilt in this process
    without a process group: ``(state, skipped)``, where ``skipped`` names the non-tensor
    entries that load only with full unpickling (they read as a marker string instead).
    ValueError when the directory cannot be read."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.metadata import StorageMeta

    metadata = read_dcp_metadata(directory)
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
                with torch.serialization.safe_globals(_numpy_safe_globals()):
                    obj = torch.load(value, map_location="cpu", weights_only=True)
            except Exception as exc:
                refused = re.search(r"Unsupported global: GLOBAL (\S+)", str(exc))
                skipped[fqn] = (f"needs full unpickling (a pickled {refused.group(1)})" if refused
                                else f"does not load with weights_only=True: {str(exc).splitlines()[0]}")
                obj = "<not read: needs full unpickling>"
            # the planner places the value; it only ever sees what the safe load produced
            safe = io.BytesIO()
            torch.save(obj, safe)
            safe.seek(0)
            super().load_bytes(read_item, safe)

    state: dict[str, Any] = {}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # deprecated name; "assuming a single process"
            dcp.load_state_dict(state, storage_reader=SafeReader(str(directory)),
                                planner=SafePlanner(), no_dist=True)
    except (CheckpointException, Exception) as exc:
        lines = [line for line in str(exc).splitlines() if line.strip()]
        raise ValueError(f"{directory} does not read as a torch.distributed.checkpoint: "
                         f"{lines[-1] if lines else type(exc).__name__}") from None
    return state, skipped


# --------------------------------------------------------------------------------------------
# Finding the newest complete checkpoint
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Candidate:
    """One checkpoint found under a directory: its kind (``huggingface``, ``dcp``, ``directory``,
    ``file``), the step in its name, when it was last written, and why it is incomplete (empty
    when complete)."""

    path: Path
    kind: str
    step: int | None
    mtime: float
    incomplete: str = ""

    @property
    def complete(self) -> bool:
        return not self.incomplete


def _state_files(directory: Path) -> list[Path]:
    try:
        return sorted(p for p in directory.iterdir() if p.is_file() and not is_temp_name(p.name)
                      and (p.suffix in FILE_SUFFIXES or p.name.endswith(_INDEX_SUFFIX)))
    except OSError:
        return []


def is_checkpoint_dir(directory: Path) -> bool:
    """Whether ``directory`` is itself one checkpoint (a Trainer ``checkpoint-N``, a DCP
    directory, or a step-named directory of state files) rather than a folder of checkpoints."""
    if (directory / "trainer_state.json").is_file() or (directory / ".metadata").is_file():
        return True
    if _HF_DIR.match(directory.name) or any(p.suffix == ".distcp" for p in _files_in(directory)):
        return True
    return bool(_STEP_DIR.search(directory.name)) and bool(_state_files(directory))


def _files_in(directory: Path) -> list[Path]:
    try:
        return [p for p in directory.iterdir() if p.is_file()]
    except OSError:
        return []


def _file_problem(path: Path) -> str:
    """Why a state file is torn or empty; empty when it looks whole (cheap: headers only)."""
    try:
        size = path.stat().st_size
    except OSError as exc:
        return f"{path.name} cannot be read: {exc.strerror}"
    if size == 0:
        return f"{path.name} is empty"
    if path.suffix == ".safetensors":
        try:
            _safetensors_header(path)
        except ValueError as exc:
            return str(exc).replace(str(path), path.name)
        return ""
    if path.suffix in CHECKPOINT_SUFFIXES:
        with open(path, "rb") as handle:
            zipped = handle.read(2) == b"PK"
        if zipped and not zipfile.is_zipfile(path):
            return f"{path.name} is truncated (a torch zip file without its end record)"
    return ""


def _index_problem(directory: Path) -> str:
    for index in sorted(directory.glob(f"*{_INDEX_SUFFIX}")):
        try:
            weight_map = json.loads(index.read_text()).get("weight_map", {})
        except (OSError, ValueError, AttributeError):
            return f"{index.name} is not a JSON index"
        missing = sorted({str(f) for f in weight_map.values()} - {p.name for p in _files_in(directory)})
        if missing:
            return f"{index.name} names {', '.join(missing[:3])}, which {'is' if len(missing) == 1 else 'are'} missing"
    return ""


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:  # a dangling link, or deleted meanwhile
        return 0.0


def _dir_candidate(path: Path) -> Candidate | None:
    files = _files_in(path)
    mtime = max([_mtime(path), *map(_mtime, files)])
    step = step_in_name(path.name)
    if (path / ".metadata").is_file() or any(p.suffix == ".distcp" for p in files):
        why = "" if (path / ".metadata").is_file() else "no .metadata (the save did not finish)"
        return Candidate(path, "dcp", step, mtime, why)
    hf = _HF_DIR.match(path.name) or (path / "trainer_state.json").exists()
    if not hf and not (_STEP_DIR.search(path.name) and _state_files(path)):
        return None
    why = ""
    if hf:
        state = path / "trainer_state.json"
        if not state.is_file():
            why = "no trainer_state.json (the Trainer writes it last)"
        else:
            try:
                json.loads(state.read_text())
            except (OSError, ValueError):
                why = "trainer_state.json is not complete JSON"
    why = why or _index_problem(path)
    if not why:
        why = next((p for p in map(_file_problem, _state_files(path)) if p), "")
    return Candidate(path, "huggingface" if hf else "directory", step, mtime, why)


def checkpoint_candidates(directory: Path) -> list[Candidate]:
    """Every checkpoint under ``directory`` (complete or not; temporaries as incomplete ones),
    not looking inside a checkpoint directory."""
    found: list[Candidate] = []
    if not directory.is_dir():
        return found
    for root, dirs, files in os.walk(directory):
        here = Path(root)
        descend = []
        for name in sorted(dirs):
            path = here / name
            if is_temp_name(name):
                found.append(Candidate(path, "temporary", step_in_name(name), _mtime(path),
                                       "a temporary directory of a save in progress"))
                continue
            candidate = _dir_candidate(path)
            if candidate is None:
                descend.append(name)
            else:
                found.append(candidate)
        dirs[:] = descend
        for name in sorted(files):
            path = here / name
            if Path(name).suffix not in FILE_SUFFIXES or name in NOT_STATE:
                continue
            mtime = _mtime(path)
            if not mtime:
                continue  # a dangling link, or deleted meanwhile
            if is_temp_name(name):
                found.append(Candidate(path, "temporary", None, mtime, "a temporary file of a save in progress"))
            else:
                found.append(Candidate(path, "file", step_in_name(name), mtime, _file_problem(path)))
    return found


def _newest(candidates: list[Candidate]) -> Candidate | None:
    """Highest step in the name, then the latest write; ``last.ckpt``/``latest.pt`` (no step)
    win when written no earlier than the highest-step one."""
    complete = [c for c in candidates if c.complete]
    stepped = [c for c in complete if c.step is not None]
    best = max(stepped, key=lambda c: (c.step, c.mtime), default=None)
    unstepped = [c for c in complete if c.step is None]
    if best is None:
        return max(unstepped, key=lambda c: c.mtime, default=None)
    lasts = [c for c in unstepped if c.path.name.lower().startswith(("last", "latest")) and c.mtime >= best.mtime]
    return max(lasts, key=lambda c: c.mtime) if lasts else best


def latest_complete_checkpoint(directory: Path) -> Path | None:
    """The newest complete checkpoint under ``directory`` (a directory or a file), or None.

    Newest: the highest step in its name, then the latest write (``last.ckpt`` when written no
    earlier than the highest-step one). Incomplete ones are skipped: a ``checkpoint-N`` without
    ``trainer_state.json`` or missing a shard its index names, a DCP directory without
    ``.metadata``, a truncated file, temporaries."""
    best = _newest(checkpoint_candidates(directory))
    return best.path if best is not None else None


def describe_candidates(directory: Path, limit: int = 6) -> str:
    """What is under ``directory`` checkpoint-wise, newest first, for messages:
    ``checkpoint-20/ (incomplete: no trainer_state.json), checkpoint-10/``; "nothing" when empty."""
    found = sorted(checkpoint_candidates(directory), key=lambda c: (c.step or -1, c.mtime), reverse=True)
    if not found:
        names = sorted(p.name for p in directory.iterdir())[:limit] if directory.is_dir() else []
        return "no checkpoint" + (f" (only {', '.join(names)})" if names else "")
    parts = []
    for c in found[:limit]:
        name = c.path.relative_to(directory).as_posix() + ("/" if c.path.is_dir() else "")
        parts.append(name + (f" (incomplete: {c.incomplete})" if c.incomplete else ""))
    more = f", and {len(found) - limit} more" if len(found) > limit else ""
    return ", ".join(parts) + more


def resolve_checkpoint(path: Path) -> Path | None:
    """``path`` itself when it is a checkpoint (a file, or a checkpoint directory), else the
    newest complete checkpoint under it; None when there is none."""
    if path.is_file() or (path.is_dir() and is_checkpoint_dir(path)):
        return path
    return latest_complete_checkpoint(path)


# --------------------------------------------------------------------------------------------
# Reading one checkpoint
# --------------------------------------------------------------------------------------------


@dataclass
class CheckpointContents:
    """A checkpoint read into plain values: ``parts`` maps a part name to its loaded state (""
    for a one-file checkpoint or a DCP directory; in a directory, each file's relative path,
    shards under the name of the file they split, e.g. ``model.safetensors``), ``skipped`` the
    files (or DCP entries) not read and why."""

    path: Path
    parts: dict[str, Any] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)

    @property
    def files(self) -> list[str]:
        """The parts that were read."""
        return list(self.parts)


def _read_file(path: Path) -> Any:
    """One state file by its format; ValueError with the reason when it cannot be read safely."""
    problem = _file_problem(path)
    if problem:
        raise ValueError(problem)
    if path.suffix == ".safetensors":
        return load_safetensors(path)
    if path.suffix == ".json":
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"not readable JSON: {exc}") from None
    return load_checkpoint(path)


def _short_reason(exc: Exception, path: Path) -> str:
    return str(exc).replace(f"{path} ", "", 1).replace(str(path), path.name)


def _read_shards(directory: Path, contents: CheckpointContents, consumed: set[Path]) -> None:
    """Shards named by an index (``model.safetensors.index.json``) read as one part named after
    the file they split (``model.safetensors``), so a sharded save compares with an unsharded one."""
    for index in sorted(directory.glob(f"*{_INDEX_SUFFIX}")):
        consumed.add(index)
        rel = index.relative_to(contents.path).as_posix()
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError):
            contents.skipped[rel] = "not a JSON index with a weight_map"
            continue
        merged: dict[str, Any] = {}
        for shard_name in sorted({str(f) for f in weight_map.values()}):
            shard = directory / shard_name
            consumed.add(shard)
            try:
                merged.update(_read_file(shard))
            except (ValueError, OSError) as exc:
                contents.skipped[rel] = f"shard {shard_name}: {_short_reason(exc, shard)}"
                merged = {}
                break
        if merged:
            contents.parts[rel[: -len(_INDEX_SUFFIX)]] = merged


def _read_dcp_part(directory: Path, part: str, contents: CheckpointContents) -> None:
    prefix = f"{part}:" if part else ""
    try:
        state, skipped = read_dcp(directory)
    except ValueError as exc:  # a foreign or torn DCP directory: named, the rest still read
        contents.skipped[f"{part}/.metadata" if part else ".metadata"] = _short_reason(exc, directory)
        return
    contents.parts[part] = state
    contents.skipped.update({f"{prefix}{k}": why for k, why in skipped.items()})


def read_checkpoint(path: Path) -> CheckpointContents:
    """Read a checkpoint (a file or a checkpoint directory) into :class:`CheckpointContents`.

    In a directory: every state file (safetensors, shards via their index, torch pickles loaded
    with ``weights_only=True``, JSON such as ``trainer_state.json``) and DCP subdirectories. A file
    that cannot be read safely is skipped with its reason (``training_args.bin`` by name); the
    rest is still read."""
    contents = CheckpointContents(path)
    if path.is_file():
        try:
            contents.parts[""] = _read_file(path)
        except (ValueError, OSError) as exc:
            contents.skipped[path.name] = _short_reason(exc, path)
        return contents
    if (path / ".metadata").is_file():
        _read_dcp_part(path, "", contents)
        return contents
    for root, dirs, files in os.walk(path):
        here = Path(root)
        consumed: set[Path] = set()
        _read_shards(here, contents, consumed)
        for name in sorted(dirs):
            sub = here / name
            if (sub / ".metadata").is_file() and not is_temp_name(name):
                _read_dcp_part(sub, sub.relative_to(path).as_posix(), contents)
        dirs[:] = sorted(d for d in dirs if not is_temp_name(d) and not (here / d / ".metadata").is_file())
        for name in sorted(files):
            file = here / name
            rel = file.relative_to(path).as_posix()
            if file in consumed or is_temp_name(name) or file.suffix not in (*FILE_SUFFIXES, ".json"):
                continue
            if name in NOT_STATE:
                contents.skipped[rel] = NOT_STATE[name]
                continue
            try:
                contents.parts[rel] = _read_file(file)
            except (ValueError, OSError) as exc:
                contents.skipped[rel] = _short_reason(exc, file)
    return contents
