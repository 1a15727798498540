"""The step records the run agent wrote in a run's ranks, read back as typed records.

The run agent (:mod:`trainguard.launch.hook`) writes ``{run_dir}/trainguard-steps/rank{rank}.jsonl``
from each rank's process: one line per optimizer step (each param group's hyperparameters, an
exact fingerprint of every parameter, its gradient and its optimizer state, the RNG states at
the step's start, the loss scaler), and one per checkpoint save, restore call and seeding
(docs/step-records.md gives the format). :func:`read_steps` reads them back as data:

* a file is read up to ``max_bytes`` (a file over it is read up to it, and said so: the steps
  after the cut are not compared, never called equal);
* every line is checked field by field: a line of the wrong shape is counted as malformed and
  skipped, never trusted; kinds and keys this version does not know are ignored (a newer agent);
* nothing read runs code: JSON only, nested at most as the format is.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from trainguard._internal.readers import Unreadable, list_entries, read_head_lines, shown_name
from trainguard.launch.hook import STEPS_CAP, STEPS_DIR
from trainguard.launch.step_fields import (
    ClipCalls,
    EvalRecord,
    FieldLines,
    ModelRecord,
    ParamsRecord,
    ScalerSettings,
    clip_calls,
    names,
)

__all__ = [
    "DEFAULT_MAX_BYTES",
    "OWN_RNG_SETTERS",
    "RNG_SET_CALLS",
    "CheckpointRead",
    "Fingerprint",
    "GroupParams",
    "RankSteps",
    "RestoreRecord",
    "RngStates",
    "SaveRecord",
    "ScalerState",
    "SeedRecord",
    "StepRecord",
    "StepRecords",
    "checkpoint_read",
    "read_steps",
]

#: what is read of one rank's record: the agent's own cap per rank and attempt, and room for the
#: save and restore lines it still writes after its ``truncated`` line (at most 1000, small)
DEFAULT_MAX_BYTES = STEPS_CAP + 4 * 1024**2
#: the longest line read (a step of a model with thousands of modules); a longer one is malformed
MAX_LINE = 8 * 1024**2

_RANK_FILE = re.compile(r"rank(\d+)\.jsonl")
_HEX = re.compile(r"[0-9a-f]{16}")
_OWNERS = frozenset({"model", "optimizer", "scheduler", "scaler", "loader", "rng", "value"})
_SPECIAL = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


class _Malformed(ValueError):
    """A line whose fields are not of the format's types."""


@dataclass(frozen=True)
class Fingerprint:
    """A tensor's fingerprint: ``fp`` changes when any bit of it changes (the sum of its elements'
    bit patterns mod 2**64), ``ss`` is the sum of squares of its values."""

    fp: int
    ss: float

    def __str__(self) -> str:
        return f"{self.fp:016x} (sum of squares {self.ss:.9g})"


@dataclass(frozen=True)
class GroupParams:
    """One param group's hyperparameters at a step: ``(name, value)`` in the order written."""

    values: tuple[tuple[str, float | bool | tuple[float, ...]], ...]

    def get(self, name: str) -> float | bool | tuple[float, ...] | None:
        return next((v for k, v in self.values if k == name), None)

    @property
    def lr(self) -> float | None:
        value = self.get("lr")
        return float(value) if isinstance(value, (int, float)) else None


@dataclass(frozen=True)
class RngStates:
    """Fingerprints of the generators' states at a step's start (None: not read)."""

    cpu: str | None = None
    cuda: tuple[str, ...] | None = None
    numpy: str | None = None
    python: str | None = None

    def generators(self) -> tuple[tuple[str, str | tuple[str, ...] | None], ...]:
        """(generator, its fingerprint) in a fixed order: torch's CPU generator, CUDA's, numpy's, Python's."""
        return (("torch CPU", self.cpu), ("CUDA", self.cuda), ("numpy", self.numpy), ("Python random", self.python))


@dataclass(frozen=True)
class ScalerState:
    """A loss scaler's scale at a step, and whether it skipped the step (an overflow)."""

    scale: float
    skipped: bool


@dataclass(frozen=True)
class StepRecord:
    """One optimizer step of one process: optimizer ``opt``'s ``n``-th step (from 1)."""

    opt: int
    n: int
    t: float
    groups: tuple[GroupParams, ...]
    #: backward calls since the optimizer's previous step (None: not recorded)
    backward: int | None
    #: the generators' fingerprints at the step's start (None: not read at this step, which the
    #: agent's schedule allows: docs/step-records.md#the-schedule, or its read failed)
    rng: RngStates | None
    #: parameter name -> its fingerprint before the update
    param: Mapping[str, Fingerprint]
    #: parameter name -> its gradient's fingerprint (None: no gradient)
    grad: Mapping[str, Fingerprint | None]
    #: parameter name -> its optimizer state's fingerprint (all its state tensors combined); None:
    #: not read at this step (the agent's schedule), which is not an empty state ({})
    optim: Mapping[str, Fingerprint] | None
    #: parameter name -> its placements, for the local shards of DTensors
    placement: Mapping[str, str]
    scaler: ScalerState | None
    #: the optimizer's parameters whose gradient was not zero at every backward since its previous
    #: step (a missing ``zero_grad``); None: not recorded (an older agent, no backward)
    carried: tuple[str, ...] | None = None
    #: dropout and norm modules called in eval mode with gradients on since the previous step
    eval_in_step: tuple[str, ...] = ()
    #: the gradient clip calls since the previous step (None: none, or not recorded)
    clip: ClipCalls | None = None


@dataclass(frozen=True)
class SaveRecord:
    """A checkpoint save: how, where, and the owner of each top-level key it wrote."""

    t: float
    how: str
    path: str
    #: top-level key -> what its value looks like (model, optimizer, scheduler, scaler, loader, rng, value)
    keys: Mapping[str, str]
    #: the owner of the object saved when it is itself one of those (HF's ``optimizer.pt``)
    whole: str | None

    @property
    def owners(self) -> frozenset[str]:
        """What the save holds: the owners of its keys, and its own when it is one whole."""
        return frozenset(self.keys.values()) | ({self.whole} if self.whole else set())


#: the calls that set a generator's state
RNG_SET_CALLS = frozenset({"torch.set_rng_state", "torch.cuda.set_rng_state", "numpy.random.set_state",
                           "random.setstate"})
#: modules that set the RNG states back to what they read themselves before a block of their own
#: (Lightning's ``isolate_rng`` around its sanity check, its spawn launcher): no resume's restore
OWN_RNG_SETTERS = ("lightning.fabric.utilities.seed", "lightning_fabric.utilities.seed")


@dataclass(frozen=True)
class RestoreRecord:
    """A restore call (``Optimizer.load_state_dict``, ``torch.set_rng_state``, ...), its object's
    type and ``by``, the module that made the call."""

    t: float
    call: str
    target: str
    path: str | None
    by: str = ""

    @property
    def of_a_resume(self) -> bool:
        """Whether the call may be a resume's restore: not a framework's setting back of RNG
        states it read itself around a block of its own (Lightning's ``isolate_rng``, its
        spawn launcher)."""
        return not (self.call in RNG_SET_CALLS and self.by.startswith(OWN_RNG_SETTERS))


@dataclass(frozen=True)
class SeedRecord:
    """A seeding call (``torch.manual_seed``, ``random.seed``, ``numpy.random.seed``): not a restore."""

    t: float
    call: str


@dataclass(frozen=True)
class RankSteps:
    """What one rank's record holds, in the order it was written."""

    rank: int
    steps: tuple[StepRecord, ...] = ()
    saves: tuple[SaveRecord, ...] = ()
    restores: tuple[RestoreRecord, ...] = ()
    seeds: tuple[SeedRecord, ...] = ()
    #: the agent reached its cap and wrote no step after it
    truncated: bool = False
    #: the file was larger than what was read: the steps after the cut are not there
    cut_at: int | None = None
    #: lines skipped for a shape the format does not allow (a line cut short by a kill is one)
    malformed: int = 0
    #: processes that wrote to the file (their ``meta`` lines)
    processes: int = 0
    #: each optimizer's param groups (``params`` lines), the models' parameters (``model``), the
    #: forwards without gradients in training mode (``eval``), loss scalers' settings (``scaler``)
    params: tuple[ParamsRecord, ...] = ()
    models: tuple[ModelRecord, ...] = ()
    evals: tuple[EvalRecord, ...] = ()
    scalers: tuple[ScalerSettings, ...] = ()

    def of(self, opt: int = 0) -> dict[int, StepRecord]:
        """Optimizer ``opt``'s steps by ``n`` (the first record of a number kept)."""
        out: dict[int, StepRecord] = {}
        for step in self.steps:
            if step.opt == opt:
                out.setdefault(step.n, step)
        return out

    @property
    def optimizers(self) -> tuple[int, ...]:
        return tuple(sorted({s.opt for s in self.steps}))


@dataclass(frozen=True)
class StepRecords:
    """Every rank's step records of one run (:func:`read_steps`)."""

    run_dir: str
    ranks: Mapping[int, RankSteps] = field(default_factory=dict)
    #: rank files that could not be read, and why
    unreadable: tuple[str, ...] = ()

    @property
    def has_steps(self) -> bool:
        return any(r.steps for r in self.ranks.values())

    def restore_calls(self) -> frozenset[str]:
        """The restore calls any rank made that may be a resume's (:attr:`RestoreRecord.of_a_resume`)."""
        return frozenset(r.call for rank in self.ranks.values() for r in rank.restores if r.of_a_resume)

    def seed_calls(self) -> frozenset[str]:
        return frozenset(s.call for rank in self.ranks.values() for s in rank.seeds)

    def saves(self) -> tuple[SaveRecord, ...]:
        return tuple(s for rank in self.ranks.values() for s in rank.saves)

    def saved_owners(self) -> frozenset[str] | None:
        """What the run's saves held together (None: no save recorded)."""
        saves = self.saves()
        return frozenset().union(*(s.owners for s in saves)) if saves else None

    def notes(self) -> list[str]:
        """What was not read whole: ranks cut at the reader's or the agent's cap, malformed lines."""
        out = list(self.unreadable)
        for rank in self.ranks.values():
            if rank.cut_at is not None:
                out.append(f"rank {rank.rank}'s record was read up to {rank.cut_at} bytes, its steps after that are not compared")
            if rank.truncated:
                out.append(f"rank {rank.rank}'s agent reached its cap and recorded no step after it")
            if rank.malformed:
                out.append(f"{rank.malformed} malformed line(s) of rank {rank.rank} skipped")
        return out


@dataclass(frozen=True)
class CheckpointRead:
    """What the checkpoint a resumed run read holds (:func:`checkpoint_read`)."""

    #: the owners (model, optimizer, rng, ...) of what it holds
    owners: frozenset[str]
    #: files the saving run saved in the folders the resume loaded from and that are not there
    #: where it loaded them from: (``folder/file``, its owners), in the order saved
    gone: tuple[tuple[str, frozenset[str]], ...] = ()
    #: whether a file the resume loaded is one the saving run saved; else ``owners`` are what
    #: all its saves held (which checkpoint was read is not known)
    matched: bool = False


def _tail(path: str) -> tuple[str, str]:
    """(the folder's name, the file's name) of ``path``: the same file of a checkpoint copied
    elsewhere (a resume loads a kept copy of the folder the saving run wrote)."""
    folder, name = os.path.split(os.path.normpath(path))
    return os.path.basename(folder), name


def checkpoint_read(saved: StepRecords, resumed: StepRecords) -> CheckpointRead | None:
    """What the checkpoint ``resumed`` loaded holds, from the saving run's save records and the
    resumed run's restore records (their paths): the saves it loaded, and the other saves of the
    folders it loaded them from where those files are still there (a file written and removed
    since, or never copied, is ``gone``: the checkpoint read does not hold it). None when the
    saving run recorded no save."""
    saves = sorted(saved.saves(), key=lambda s: s.t)
    if not saves:
        return None
    loaded = {_tail(r.path): r.path for rank in resumed.ranks.values() for r in rank.restores
              if r.path and not r.path.startswith("<")}
    folders = {tail[0]: os.path.dirname(os.path.normpath(path)) for tail, path in loaded.items()}
    owners: set[str] = set()
    gone: list[tuple[str, frozenset[str]]] = []
    matched = False
    for save in saves:
        folder, name = tail = _tail(save.path)
        where = folders.get(folder)
        if tail in loaded:
            matched = True
        elif where is None:
            continue  # another checkpoint's file
        elif os.path.isabs(where) and not os.path.lexists(os.path.join(where, name)):
            gone.append((f"{folder}/{name}", save.owners))
            continue
        owners |= save.owners
    if not matched:
        return CheckpointRead(saved.saved_owners() or frozenset())
    return CheckpointRead(frozenset(owners), tuple(gone), matched=True)


# -- reading ---------------------------------------------------------------------------------


def read_steps(run_dir: Path, *, max_bytes: int = DEFAULT_MAX_BYTES) -> StepRecords:
    """Rank -> what its record holds; no ranks when nothing was recorded (the agent off, a
    non-Python rank, a run before this version). Each file is read up to ``max_bytes`` (a larger
    one up to there, said in :attr:`RankSteps.cut_at`); a file that is not a regular file inside
    the folder is named in :attr:`StepRecords.unreadable`."""
    folder = Path(run_dir) / STEPS_DIR
    if not folder.is_dir():
        return StepRecords(str(run_dir))
    try:
        entries = list_entries(folder)
    except Unreadable as exc:
        return StepRecords(str(run_dir), unreadable=(str(exc),))
    ranks: dict[int, RankSteps] = {}
    unreadable: list[str] = []
    for entry in entries:
        match = _RANK_FILE.fullmatch(entry.name)
        if match is None:
            continue
        try:
            ranks[int(match.group(1))] = _read_rank(int(match.group(1)), folder / entry.name, folder, max_bytes)
        except (Unreadable, OSError) as exc:
            unreadable.append(f"{shown_name(entry.name)}: {exc}")
    return StepRecords(str(run_dir), MappingProxyType(dict(sorted(ranks.items()))), tuple(unreadable))


def _read_rank(rank: int, path: Path, folder: Path, max_bytes: int) -> RankSteps:
    steps: list[StepRecord] = []
    saves: list[SaveRecord] = []
    restores: list[RestoreRecord] = []
    seeds: list[SeedRecord] = []
    malformed = processes = 0
    truncated = False
    extras = FieldLines()
    for line in read_head_lines(path, max_bytes, max_line=MAX_LINE, root=folder):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            kind = obj.get("k") if isinstance(obj, dict) else None
            if kind == "step":
                steps.append(_step(obj))
            elif kind == "save":
                saves.append(_save(obj))
            elif kind == "restore":
                restores.append(RestoreRecord(_number(obj, "t", 0.0), _text(obj, "call"), _text(obj, "target", ""),
                                              _optional_text(obj, "path"), _optional_text(obj, "by") or ""))
            elif kind == "seed":
                seeds.append(SeedRecord(_number(obj, "t", 0.0), _text(obj, "call")))
            elif kind == "meta":
                processes += 1
            elif kind == "truncated":
                truncated = True
            elif not isinstance(kind, str):
                raise _Malformed("no kind")
            else:
                extras.add(kind, obj)  # the invariants' lines; another kind: a newer agent's, ignored
        except (ValueError, TypeError, KeyError, RecursionError, AttributeError):
            malformed += 1
    size = path.stat().st_size
    return RankSteps(rank, tuple(steps), tuple(saves), tuple(restores), tuple(seeds), truncated,
                     max_bytes if size > max_bytes else None, malformed, processes,
                     tuple(extras.params), tuple(extras.models), tuple(extras.evals), tuple(extras.scalers))


def _step(obj: Any) -> StepRecord:
    opt, n = obj.get("opt"), obj.get("n")
    if not _is_int(opt) or not _is_int(n) or opt < 0 or n < 1:
        raise _Malformed("opt and n must be integers (n from 1)")
    groups = obj.get("groups", [])
    if not isinstance(groups, list):
        raise _Malformed("groups must be a list")
    backward = obj.get("backward")
    if backward is not None and not _is_int(backward):
        raise _Malformed("backward must be an integer")
    placement = obj.get("placement") or {}
    if not isinstance(placement, dict) or not all(isinstance(v, str) for v in placement.values()):
        raise _Malformed("placement must map names to strings")
    return StepRecord(
        opt, n, _number(obj, "t", 0.0), tuple(_group(g) for g in groups), backward, _rng(obj.get("rng")),
        _prints(obj.get("param")), _grads(obj.get("grad")), None if obj.get("optim", {}) is None else _prints(obj["optim"]),
        MappingProxyType(dict(placement)), _scaler(obj.get("scaler")),
        None if obj.get("carried") is None else names(obj["carried"], "carried"),
        names(obj.get("eval_in_step"), "eval_in_step"), clip_calls(obj.get("clip")),
    )


def _group(obj: Any) -> GroupParams:
    if not isinstance(obj, dict):
        raise _Malformed("a param group must be an object")
    values: list[tuple[str, float | bool | tuple[float, ...]]] = []
    for key, value in obj.items():
        if isinstance(value, bool) or _is_number(value):
            values.append((key, value))
        elif isinstance(value, list) and all(_is_number(v) for v in value):
            values.append((key, tuple(float(v) for v in value)))
        # any other value is a hyperparameter this version does not compare: ignored
    return GroupParams(tuple(values))


def _rng(obj: Any) -> RngStates | None:
    if obj is None:
        return None
    if not isinstance(obj, dict):
        raise _Malformed("rng must be an object")
    cuda = obj.get("cuda")
    if cuda is not None and not (isinstance(cuda, list) and all(isinstance(c, str) for c in cuda)):
        raise _Malformed("rng.cuda must be a list of strings")
    return RngStates(_optional_text(obj, "cpu"), tuple(cuda) if cuda is not None else None,
                     _optional_text(obj, "numpy"), _optional_text(obj, "python"))


def _prints(obj: Any) -> Mapping[str, Fingerprint]:
    """Name -> fingerprint (``param``, ``optim``)."""
    if obj is None:
        return MappingProxyType({})
    if not isinstance(obj, dict):
        raise _Malformed("fingerprints must be an object")
    return MappingProxyType({name: _fingerprint(name, value) for name, value in obj.items()})


def _grads(obj: Any) -> Mapping[str, Fingerprint | None]:
    """Name -> the gradient's fingerprint, None for a parameter without one."""
    if obj is None:
        return MappingProxyType({})
    if not isinstance(obj, dict):
        raise _Malformed("fingerprints must be an object")
    return MappingProxyType({name: None if value is None else _fingerprint(name, value) for name, value in obj.items()})


def _fingerprint(name: str, value: Any) -> Fingerprint:
    if not (isinstance(value, list) and len(value) == 2 and isinstance(value[0], str) and _HEX.fullmatch(value[0])):
        raise _Malformed(f"the fingerprint of {name!r} must be [16 hex digits, sum of squares]")
    ss = value[1]
    if isinstance(ss, str):
        ss = _SPECIAL[ss]  # a KeyError for another string: malformed
    elif not _is_number(ss):
        raise _Malformed(f"the sum of squares of {name!r} must be a number")
    return Fingerprint(int(value[0], 16), float(ss))


def _scaler(obj: Any) -> ScalerState | None:
    if obj is None:
        return None
    if not isinstance(obj, dict) or not _is_number(obj.get("scale")) or not isinstance(obj.get("skipped", False), bool):
        raise _Malformed("scaler must be {scale: number, skipped: bool}")
    return ScalerState(float(obj["scale"]), bool(obj.get("skipped", False)))


def _save(obj: Any) -> SaveRecord:
    keys = obj.get("keys") or {}
    if not isinstance(keys, dict) or not all(isinstance(v, str) for v in keys.values()):
        raise _Malformed("save keys must map names to owners")
    whole = obj.get("whole")
    if whole is not None and not isinstance(whole, str):
        raise _Malformed("save whole must be a string or null")
    return SaveRecord(_number(obj, "t", 0.0), _text(obj, "how", ""), _text(obj, "path", ""),
                      MappingProxyType({k: v for k, v in keys.items() if v in _OWNERS}),
                      whole if whole in _OWNERS else None)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _number(obj: Any, key: str, default: float) -> float:
    value = obj.get(key, default)
    if not _is_number(value):
        raise _Malformed(f"{key} must be a number")
    return float(value)


def _text(obj: Any, key: str, default: str | None = None) -> str:
    value = obj.get(key, default)
    if not isinstance(value, str):
        raise _Malformed(f"{key} must be a string")
    return value


def _optional_text(obj: Any, key: str) -> str | None:
    value = obj.get(key)
    if value is not None and not isinstance(value, str):
        raise _Malformed(f"{key} must be a string or null")
    return value
