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
checkpoints. Everything is read without running code from the files (torch pickles with
``weights_only=True``, the DCP metadata with an unpickler that admits an explicit list of exact
globals, :mod:`~trainguard.unit.checkpoints.dcp`), and only through
:mod:`trainguard._internal.readers`: regular files inside the directory named, within
:class:`~trainguard._internal.readers.ReadLimits` (docs/security.md).
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import re
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainguard._internal.readers import (
    Deadline,
    OverLimit,
    ReadLimits,
    Unreadable,
    active_limits,
    contained,
    list_entries,
    open_regular,
    read_json,
    read_json_streaming,
    regular_size,
    shown_name,
)
from trainguard.unit.checkpoints.dcp import numpy_safe_globals, read_dcp
from trainguard.unit.checkpoints.safetensors_file import load_safetensors, safetensors_header

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
    "read_checkpoint",
    "resolve_checkpoint",
    "step_in_name",
]

#: suffixes of torch checkpoint files (pickles in torch's zip format)
CHECKPOINT_SUFFIXES = (".pt", ".pth", ".ckpt", ".bin", ".tar")
#: suffixes of a checkpoint that is one file
FILE_SUFFIXES = (*CHECKPOINT_SUFFIXES, ".safetensors")
#: read too when inside a checkpoint directory (never a checkpoint by itself): accelerate's
#: ``random_states_{rank}.pkl`` is a torch file under another name
IN_DIR_SUFFIXES = (".pkl",)
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

    Temp files of an in-progress write (:func:`is_temp_name`: ``.x``, ``x.tmp``, ``x.pt.tmp123``,
    ``tmp*``, ...) are ignored.
    """
    if not directory.is_dir():
        return []
    files = [p for p in directory.rglob("*")
             if p.is_file() and p.suffix in CHECKPOINT_SUFFIXES and not is_temp_name(p.name)]
    return sorted(files, key=lambda p: (p.stat().st_mtime, p.name))


def _refusal(exc: Exception) -> str:
    """What torch's weights_only loader refused, in a few words: the global or the opcode it
    would not run. Torch's own message ends in advice to load with ``weights_only=False``, which
    would run the file's code; it is never repeated."""
    text = str(exc)
    refused = re.search(r"Unsupported global: GLOBAL (\S+)", text)
    if refused:
        return f"the global {refused.group(1)}, which loading would call"
    operand = re.search(r"Unsupported operand (\S+)", text)
    if operand:
        return f"the pickle opcode {operand.group(1)}, which only a full unpickler runs"
    first = next((line.strip() for line in text.splitlines()
                  if line.strip() and "weights_only" not in line and "trust" not in line), "")
    return first[:200] or "an object the safe loader does not rebuild"


def load_checkpoint(path: Path, limits: ReadLimits | None = None) -> Any:
    """``torch.load(path, weights_only=True, map_location="cpu")`` (numpy arrays allowed, as
    RNG states hold them) of a regular file within ``limits``; raises ValueError
    (:class:`~trainguard._internal.readers.Unreadable`) naming what was refused when the file
    needs full unpickling, and why when it is not a torch checkpoint."""
    limits = limits or active_limits()
    import torch

    try:
        with open_regular(path, limits) as handle, torch.serialization.safe_globals(numpy_safe_globals()):
            return torch.load(handle, map_location="cpu", weights_only=True)
    except Unreadable:
        raise
    except pickle.UnpicklingError as exc:
        raise Unreadable(
            f"{shown_name(path)} is refused: it holds {_refusal(exc)}, not only tensors and plain "
            "containers, and trainguard never runs code from a file. Save plain state dicts "
            "(tensors, numbers, strings, lists, dicts; e.g. vars(args) instead of args)"
        ) from None
    except RecursionError:
        raise Unreadable(f"{shown_name(path)} nests too deep to load") from None
    except Exception as exc:  # torch raises many kinds for a malformed file
        raise Unreadable(f"{shown_name(path)} is not a loadable torch checkpoint: "
                         f"{type(exc).__name__}: {_refusal(exc)}") from None


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
    return [p for p in _files_in(directory) if not is_temp_name(p.name)
            and (p.suffix in FILE_SUFFIXES or p.name.endswith(_INDEX_SUFFIX))]


def is_checkpoint_dir(directory: Path) -> bool:
    """Whether ``directory`` is itself one checkpoint (a Trainer ``checkpoint-N``, a DCP
    directory, or a step-named directory of state files) rather than a folder of checkpoints."""
    if (directory / "trainer_state.json").is_file() or (directory / ".metadata").is_file():
        return True
    if _HF_DIR.match(directory.name) or any(p.suffix == ".distcp" for p in _files_in(directory)):
        return True
    # a step-named directory too large to list is one too: reading it says "over the limit"
    return bool(_STEP_DIR.search(directory.name)) and (bool(_state_files(directory)) or _over_limit(directory))


def _over_limit(directory: Path) -> bool:
    try:
        list_entries(directory)
    except OverLimit:
        return True
    except Unreadable:
        return False
    return False


def _files_in(directory: Path) -> list[Path]:
    """The regular files of ``directory`` (links to one count; FIFOs and devices do not), sorted;
    none when it cannot be listed or holds more entries than the default limit."""
    try:
        return [directory / e.name for e in list_entries(directory) if _is_file(e)]
    except Unreadable:
        return []


def _is_file(entry: os.DirEntry[str]) -> bool:
    try:
        return entry.is_file()
    except OSError:
        return False


def _file_problem(path: Path, root: Path | None = None) -> str:
    """Why a state file is torn, empty or not to be read; empty when it looks whole (cheap:
    headers only). ``root``: the directory it must stay inside."""
    try:
        size = regular_size(contained(root, path) if root is not None else path)
        if size == 0:
            return f"{shown_name(path.name)} is empty"
        if path.suffix == ".safetensors":
            safetensors_header(path)
        elif path.suffix in (*CHECKPOINT_SUFFIXES, *IN_DIR_SUFFIXES):
            with open_regular(path) as handle:
                zipped = handle.read(2) == b"PK"
                if zipped and not zipfile.is_zipfile(handle):
                    return f"{shown_name(path.name)} is truncated (a torch zip file without its end record)"
    except Unreadable as exc:
        return _short_reason(exc, path)
    return ""


def _weight_map(index: Path, limits: ReadLimits | None = None) -> dict[str, str]:
    """The ``weight_map`` of a shard index (tensor -> shard file name); Unreadable when the
    file is not JSON or the map is not names to names."""
    limits = limits or active_limits()
    document = read_json(index, limits)
    weight_map = document.get("weight_map") if isinstance(document, dict) else None
    if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
        raise Unreadable(f"{shown_name(index.name)} is not a JSON index with a weight_map of "
                         "tensor names to shard file names")
    return weight_map


def _index_problem(directory: Path) -> str:
    for index in (p for p in _files_in(directory) if p.name.endswith(_INDEX_SUFFIX)):
        try:
            weight_map = _weight_map(index)
        except Unreadable as exc:
            return str(exc)
        missing = sorted(set(weight_map.values()) - {p.name for p in _files_in(directory)})
        if missing:
            return f"{index.name} names {', '.join(missing[:3])}, which {'is' if len(missing) == 1 else 'are'} missing"
    return ""


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:  # a dangling link, or deleted meanwhile
        return 0.0


def _json_problem(path: Path, root: Path) -> str:
    """Why a JSON file the Trainer writes last is not complete: not a regular file in ``root``,
    or not a whole object (it must start with ``{`` and end with ``}``). Only its ends are read,
    so a large ``trainer_state.json`` costs nothing here."""
    try:
        with open_regular(path, root=root) as handle:
            size = os.fstat(handle.fileno()).st_size
            head = handle.read(64).lstrip()
            handle.seek(max(0, size - 64))
            tail = handle.read(64).rstrip()
    except Unreadable as exc:
        return str(exc)
    if not head.startswith(b"{") or not tail.endswith(b"}"):
        return f"{path.name} is not complete JSON"
    return ""


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
            why = _json_problem(state, path)
    why = why or _index_problem(path)
    if not why:
        why = next((p for p in (_file_problem(f, path) for f in _state_files(path)) if p), "")
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
        if len(dirs) + len(files) > active_limits().max_files:
            dirs[:] = []
            continue  # over the limit; read_checkpoint says so when it is asked to read it
        for name in sorted(dirs):
            path = here / name
            if not _inside(directory, path):
                continue
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
            if not mtime or not _inside(directory, path):
                continue  # a dangling link, deleted meanwhile, or a link out of the directory
            if is_temp_name(name):
                found.append(Candidate(path, "temporary", None, mtime, "a temporary file of a save in progress"))
            else:
                found.append(Candidate(path, "file", step_in_name(name), mtime, _file_problem(path, directory)))
    return _mark_cut_short(found)


def _file_names(candidate: Candidate) -> set[str]:
    """The names of a checkpoint directory's files, its own step written as ``{step}``."""
    step = candidate.step

    def plain(name: str) -> str:
        return re.sub(r"\d+", lambda m: "{step}" if step is not None and int(m.group()) == step else m.group(), name)

    return {plain(p.name) for p in _files_in(candidate.path) if not is_temp_name(p.name)}


def _mark_cut_short(found: list[Candidate]) -> list[Candidate]:
    """A step directory with no marker of its own (neither a Trainer's ``trainer_state.json``
    nor DCP's ``.metadata``: accelerate's ``save_state``, a job's own folder of files) is written
    file by file. The newest one of a folder that lacks a file its predecessor holds was cut
    short (a kill mid-save) and is not complete: resuming from it loads half a state."""
    by_parent: dict[Path, list[Candidate]] = {}
    for c in found:
        if c.kind == "directory" and c.complete and c.step is not None:
            by_parent.setdefault(c.path.parent, []).append(c)
    for group in by_parent.values():
        if len(group) < 2:
            continue
        newest, before = sorted(group, key=lambda c: (c.step, c.mtime))[-2:][::-1]
        missing = _file_names(before) - _file_names(newest)
        if missing:
            names = ", ".join(sorted(missing)[:3]) + (" ..." if len(missing) > 3 else "")
            cut = dataclasses.replace(newest, incomplete=(
                f"no {names}, which {before.path.name}/ holds (its save was cut short: this kind "
                "of checkpoint has no completion marker)"))
            found = [cut if c is newest else c for c in found]
    return found


def _inside(root: Path, path: Path) -> bool:
    try:
        contained(root, path)
    except Unreadable:
        return False
    return True


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
    files (or DCP entries) not read and why: ``unreadable: <why>`` for a malformed or refused
    file, ``skipped: over the limit: <why>`` for one over a :class:`ReadLimits` limit (also
    listed in ``over_limit``: a comparison that skipped one is never equal)."""

    path: Path
    parts: dict[str, Any] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    over_limit: list[str] = field(default_factory=list)

    @property
    def files(self) -> list[str]:
        """The parts that were read."""
        return list(self.parts)

    def refuse(self, part: str, exc: Exception, path: Path | None = None) -> None:
        """Record why ``part`` was not read: over a limit, or unreadable."""
        why = _short_reason(exc, path) if path is not None else str(exc)
        if isinstance(exc, OverLimit):
            self.skipped[part] = f"skipped: over the limit: {why}"
            self.over_limit.append(part)
        else:
            self.skipped[part] = f"unreadable: {why}"


def _read_file(path: Path, limits: ReadLimits | None = None) -> Any:
    """One state file by its format; Unreadable (a ValueError) with the reason when it cannot
    be read safely."""
    limits = limits or active_limits()
    if path.suffix == ".safetensors":
        return load_safetensors(path, limits)
    if path.suffix == ".json":
        if path.name == "trainer_state.json":
            return read_json_streaming(path, "log_history", limits)
        return read_json(path, limits)
    problem = _file_problem(path)
    if problem:
        raise Unreadable(problem)
    return load_checkpoint(path, limits)


def _short_reason(exc: Exception, path: Path) -> str:
    return str(exc).replace(f"{shown_name(path)} ", "", 1).replace(shown_name(path), shown_name(path.name))


def _read_shards(directory: Path, root: Path, contents: CheckpointContents, consumed: set[str],
                 limits: ReadLimits) -> None:
    """Shards named by an index (``model.safetensors.index.json``) read as one part named after
    the file they split (``model.safetensors``), so a sharded save compares with an unsharded one."""
    for index in (p for p in _files_in(directory) if p.name.endswith(_INDEX_SUFFIX)):
        consumed.add(index.name)
        rel = _rel(index, root)
        try:
            weight_map = _weight_map(contained(root, index), limits)
        except Unreadable as exc:
            contents.refuse(rel, exc, index)
            continue
        merged: dict[str, Any] = {}
        for shard_name in sorted(set(weight_map.values())):
            shard = directory / shard_name
            consumed.add(shard_name)
            try:
                merged.update(_read_file(contained(root, shard), limits))
            except Unreadable as exc:
                contents.refuse(rel, Unreadable(f"shard {shown_name(shard_name)}: {_short_reason(exc, shard)}"))
                merged = {}
                break
        if merged:
            contents.parts[rel[: -len(_INDEX_SUFFIX)]] = merged


def _rel(path: Path, root: Path) -> str:
    return shown_name(path.relative_to(root).as_posix())


def _read_dcp_part(directory: Path, part: str, contents: CheckpointContents, limits: ReadLimits) -> None:
    prefix = f"{part}:" if part else ""
    try:
        state, skipped = read_dcp(directory, limits)
    except Unreadable as exc:  # a foreign, torn or hostile DCP directory: named, the rest still read
        contents.refuse(f"{part}/.metadata" if part else ".metadata", exc, directory)
        return
    contents.parts[part] = state
    contents.skipped.update({f"{prefix}{k}": why for k, why in skipped.items()})


def read_checkpoint(path: Path, limits: ReadLimits | None = None) -> CheckpointContents:
    """Read a checkpoint (a file or a checkpoint directory) into :class:`CheckpointContents`.

    In a directory: every state file (safetensors, shards via their index, torch pickles loaded
    with ``weights_only=True``, JSON such as ``trainer_state.json``) and DCP subdirectories. Only
    regular files inside ``path`` are read (links out, FIFOs and devices are refused by name),
    each within ``limits``. A file that cannot be read safely is skipped with its reason
    (``training_args.bin`` by name); the rest is still read."""
    limits = limits or active_limits()
    contents = CheckpointContents(path)
    deadline = Deadline(limits, shown_name(path.name))
    if not path.is_dir():
        try:
            contents.parts[""] = _read_file(path, limits)
        except Unreadable as exc:
            contents.refuse(shown_name(path.name), exc, path)
        return contents
    if (path / ".metadata").exists():
        _read_dcp_part(path, "", contents, limits)
        return contents
    pending = [path]
    while pending:
        here = pending.pop(0)
        try:
            deadline.check()
            _read_directory(here, path, contents, limits, pending, deadline)
        except Unreadable as exc:
            contents.refuse(_rel(here, path) if here != path else ".", exc)
    return contents


def _read_directory(here: Path, root: Path, contents: CheckpointContents, limits: ReadLimits,
                    pending: list[Path], deadline: Deadline) -> None:
    """The files of one directory of a checkpoint; its subdirectories go to ``pending`` (DCP
    ones are read here, as one part each)."""
    entries = list_entries(here, limits)
    consumed: set[str] = set()
    _read_shards(here, root, contents, consumed, limits)
    for entry in entries:
        deadline.check()
        name, child = entry.name, here / entry.name
        if is_temp_name(name) or name in consumed:
            continue
        rel = _rel(child, root)
        if entry.is_dir(follow_symlinks=False):
            if (child / ".metadata").exists():
                _read_dcp_part(child, rel, contents, limits)
            else:
                pending.append(child)
            continue
        if Path(name).suffix not in (*FILE_SUFFIXES, *IN_DIR_SUFFIXES, ".json"):
            continue
        if name in NOT_STATE:
            contents.skipped[rel] = NOT_STATE[name]
            continue
        try:
            contents.parts[rel] = _read_file(contained(root, child), limits)
        except Unreadable as exc:
            contents.refuse(rel, exc, child)
