"""The step records' lines and fields the invariants check reads (issue 45), read back as typed
records by :func:`trainguard.launch.steps.read_steps`: which parameters each optimizer holds
(``params``), which the model trains (``model``), validation forwards in training mode (``eval``),
a loss scaler's settings (``scaler``), and on a step line the gradients carried into it
(``carried``), the modules in eval mode in it (``eval_in_step``) and its clip calls (``clip``).
The agent writes them in ``trainguard/launch/hook/_trainguard_step_extras.py``; the format is
docs/step-records.md. A line of the wrong shape raises :class:`ValueError` (the reader counts it
as malformed); keys this version does not know are ignored.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

__all__ = ["ClipCalls", "EvalRecord", "FieldLines", "ModelRecord", "ParamsRecord", "ScalerSettings", "clip_calls", "eval_record",
           "model_record", "names", "params_record", "scaler_settings"]


@dataclass(frozen=True)
class ParamsRecord:
    """Optimizer ``opt``'s param groups as of its step ``n``: each group's parameter names and dtypes."""

    opt: int
    n: int
    groups: tuple[tuple[str, ...], ...]
    dtypes: tuple[tuple[str, ...], ...]
    #: its parameters another live optimizer of the process holds as well
    shared: tuple[str, ...] = ()
    #: a DTensor parameter's name -> this rank's coordinate on its device mesh (one per dimension)
    mesh: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    #: the ranks of the process group of the DDP wrapper holding its parameters, when smaller than
    #: the world (a data-parallel group beside tensor parallelism); () when absent
    dp_ranks: tuple[int, ...] = ()

    @property
    def names(self) -> frozenset[str]:
        return frozenset(name for group in self.groups for name in group)

    def dtype(self, name: str) -> str | None:
        for group, kinds in zip(self.groups, self.dtypes, strict=False):
            if name in group and len(kinds) == len(group):
                return kinds[group.index(name)]
        return None


@dataclass(frozen=True)
class ModelRecord:
    """The root modules holding optimizer ``opt``'s parameters, at its step ``n``: their trainable
    and frozen parameters, the trainable ones that had a gradient then (the forward used them) and
    that no live optimizer held by its next step (``grad``), and how many dropout or norm modules'
    modes are watched."""

    opt: int
    n: int
    trainable: tuple[str, ...]
    frozen: tuple[str, ...]
    grad: tuple[str, ...]
    watched: int


@dataclass(frozen=True)
class EvalRecord:
    """A forward without gradients after optimizer ``opt``'s step ``after`` that ran these
    dropout or norm modules in training mode."""

    opt: int
    after: int
    train_mode: tuple[str, ...]


@dataclass(frozen=True)
class ScalerSettings:
    """A GradScaler's settings, at optimizer ``opt``'s step ``n`` (None: not an attribute of it)."""

    opt: int
    n: int
    growth_factor: float | None
    backoff_factor: float | None
    growth_interval: int | None


@dataclass(frozen=True)
class ClipCalls:
    """The gradient clip calls since the optimizer's previous step, and how many ran on gradients
    a GradScaler had scaled and not yet unscaled."""

    calls: int
    scaled: int


@dataclass
class FieldLines:
    """The invariants' lines of one rank's record, gathered as they are read."""

    params: list[ParamsRecord] = field(default_factory=list)
    models: list[ModelRecord] = field(default_factory=list)
    evals: list[EvalRecord] = field(default_factory=list)
    scalers: list[ScalerSettings] = field(default_factory=list)

    def add(self, kind: object, obj: Any) -> bool:
        """Read ``obj`` when its kind is one of these lines (a ValueError when it is malformed);
        False for another kind."""
        if kind == "params":
            self.params.append(params_record(obj))
        elif kind == "model":
            self.models.append(model_record(obj))
        elif kind == "eval":
            self.evals.append(eval_record(obj))
        elif kind == "scaler":
            self.scalers.append(scaler_settings(obj))
        else:
            return False
        return True


def _int(obj: Any, key: str, least: int = 0) -> int:
    value = obj.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
        raise ValueError(f"{key} must be an integer of at least {least}")
    return value


def names(value: Any, key: str) -> tuple[str, ...]:
    """A list of names (``[]`` when absent)."""
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{key} must be a list of names")
    return tuple(value)


def _nested(value: Any, key: str) -> tuple[tuple[str, ...], ...]:
    if not isinstance(value, list):
        raise ValueError(f"{key} must be a list of lists of names")
    return tuple(names(v, key) for v in value)


def params_record(obj: Any) -> ParamsRecord:
    return ParamsRecord(_int(obj, "opt"), _int(obj, "n", 1), _nested(obj.get("groups"), "groups"),
                        _nested(obj.get("dtypes") or [], "dtypes"), names(obj.get("shared"), "shared"),
                        _coordinates(obj.get("mesh")), _ranks(obj.get("dp_ranks")))


def _ranks(value: Any) -> tuple[int, ...]:
    """``dp_ranks``: a list of distinct ranks (() when absent)."""
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(r, int) and not isinstance(r, bool) and r >= 0
                                              for r in value) or len(set(value)) != len(value):
        raise ValueError("dp_ranks must be a list of distinct ranks")
    return tuple(value)


def _coordinates(value: Any) -> Mapping[str, tuple[int, ...]]:
    """``mesh``: names -> lists of mesh coordinates ({} when absent)."""
    if value is None:
        return MappingProxyType({})
    if not isinstance(value, dict) or not all(
            isinstance(v, list) and all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in v)
            for v in value.values()):
        raise ValueError("mesh must map names to lists of mesh coordinates")
    return MappingProxyType({str(k): tuple(v) for k, v in value.items()})


def model_record(obj: Any) -> ModelRecord:
    watched = obj.get("watched", 0)
    if not isinstance(watched, int) or isinstance(watched, bool):
        raise ValueError("watched must be an integer")
    return ModelRecord(_int(obj, "opt"), _int(obj, "n", 1), names(obj.get("trainable"), "trainable"),
                       names(obj.get("frozen"), "frozen"), names(obj.get("grad"), "grad"), watched)


def eval_record(obj: Any) -> EvalRecord:
    return EvalRecord(_int(obj, "opt"), _int(obj, "after"), names(obj.get("train_mode"), "train_mode"))


def scaler_settings(obj: Any) -> ScalerSettings:
    values: list[float | None] = []
    for key in ("growth_factor", "backoff_factor"):
        value = obj.get(key)
        if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool)):
            raise ValueError(f"{key} must be a number or null")
        values.append(None if value is None else float(value))
    interval = obj.get("growth_interval")
    if interval is not None and (not isinstance(interval, int) or isinstance(interval, bool)):
        raise ValueError("growth_interval must be an integer or null")
    return ScalerSettings(_int(obj, "opt"), _int(obj, "n", 1), values[0], values[1], interval)


def clip_calls(value: Any) -> ClipCalls | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError("clip must be {calls, scaled}")
    return ClipCalls(_int(value, "calls"), _int(value, "scaled"))
