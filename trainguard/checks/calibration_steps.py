"""The same-seed spread of every tensor's sum of squares at each optimizer step, measured by
``trainguard calibrate`` from its same-seed runs' step records and stored with the calibration
(``step_spreads``): the tolerance a check whose runs are not bitwise reproducible compares two
runs' step records within (:class:`~trainguard.checks.step_compare.SsTolerance`).

Per kind (``parameter``, ``optimizer state``, ``gradient``) and tensor name, per optimizer step
(optimizer 0, from 1) every same-seed run recorded: the largest minus the smallest sum of squares
of the whole run (local shards summed across ranks, :func:`~trainguard.checks.step_compare.whole_run`).
A tensor some run did not record, or recorded with a NaN or infinite sum of squares, is left out
(compared with the default relative tolerance). Bounded: at most :data:`MAX_TENSORS` tensors of
each kind and :data:`MAX_STEPS` steps; every value checked when read.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import Any

from trainguard.checks.statefiles import checked_numbers, mapping_or_empty
from trainguard.checks.step_compare import whole_run
from trainguard.launch.steps import Fingerprint, read_steps

__all__ = ["KINDS", "MAX_STEPS", "MAX_TENSORS", "StepSpreads", "measure_step_spreads"]

#: the kinds of tensor whose spread is stored, and the step line's key of each
KINDS = {"parameter": "param", "optimizer state": "optim", "gradient": "grad"}
MAX_TENSORS = 4096
MAX_STEPS = 10_000


@dataclass(frozen=True)
class StepSpreads:
    """Per kind and tensor, the same-seed spread of its sum of squares at each of ``steps``."""

    steps: list[int]
    #: kind -> tensor name -> the spread at each of ``steps``
    spreads: Mapping[str, Mapping[str, list[float]]]

    def envelopes(self) -> dict[tuple[str, str], dict[int, float]]:
        """(kind, name) -> step -> the largest spread at that step or any before it."""
        out: dict[tuple[str, str], dict[int, float]] = {}
        for kind, tensors in self.spreads.items():
            for name, values in tensors.items():
                worst, envelope = 0.0, {}
                for step, value in zip(self.steps, values, strict=True):
                    worst = max(worst, value)
                    envelope[step] = worst
                out[(kind, name)] = envelope
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "spread": {k: dict(v) for k, v in self.spreads.items()}}

    @classmethod
    def from_dict(cls, value: Any, where: str = "step_spreads") -> StepSpreads:
        """Read back, every value checked (ValueError naming the key): steps whole numbers from 1,
        rising, at most :data:`MAX_STEPS`; per kind at most :data:`MAX_TENSORS` tensors, each a
        list of one finite spread, not below 0, per step."""
        data = mapping_or_empty(value, where)
        steps = data.get("steps")
        if (not isinstance(steps, list) or len(steps) > MAX_STEPS
                or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 1 for s in steps)
                or any(a >= b for a, b in pairwise(steps))):
            raise ValueError(f"{where}.steps must be a rising list of at most {MAX_STEPS} optimizer steps from 1")
        spread = mapping_or_empty(data.get("spread"), f"{where}.spread")
        out: dict[str, dict[str, list[float]]] = {}
        for kind, tensors in spread.items():
            if kind not in KINDS:
                continue  # a kind this version does not compare
            tensors = mapping_or_empty(tensors, f"{where}.spread.{kind}")
            if len(tensors) > MAX_TENSORS:
                raise ValueError(f"{where}.spread.{kind} holds {len(tensors)} tensors, at most {MAX_TENSORS}")
            out[kind] = {str(name): checked_numbers(v, f"{where}.spread.{kind}.{str(name)[:80]}", len(steps),
                                                    non_negative=True) for name, v in tensors.items()}
        return cls(list(steps), out)


def measure_step_spreads(run_dirs: Sequence[Path]) -> StepSpreads | None:
    """The spreads of the same-seed runs in ``run_dirs`` (None when one of them recorded no step:
    the agent off, a job without torch)."""
    runs = [whole_run(read_steps(Path(d))) for d in run_dirs]
    if len(runs) < 2 or not all(runs):
        return None
    steps = sorted(set.intersection(*(set(r) for r in runs)))[:MAX_STEPS]
    if not steps:
        return None
    spreads: dict[str, dict[str, list[float]]] = {}
    for kind, key in KINDS.items():
        names = list(getattr(runs[0][steps[0]], key) or {})[:MAX_TENSORS]
        tensors = {}
        for name in names:
            values = _spreads_of([[getattr(r[n], key) for r in runs] for n in steps], name)
            if values is not None:
                tensors[name] = values
        spreads[kind] = tensors
    return StepSpreads(steps, spreads)


def _spreads_of(by_step: Sequence[Sequence[Mapping[str, Fingerprint | None] | None]], name: str) -> list[float] | None:
    """The spread of ``name`` at each step (the step records' mappings of every run); at a step
    some run did not read (an optimizer state off the agent's schedule) the largest before it;
    None when a run that read it lacks it or it is not finite."""
    out: list[float] = []
    for prints in by_step:
        if any(p is None for p in prints):
            out.append(max(out, default=0.0))
            continue
        spread = _spread([p.get(name) for p in prints if p is not None])
        if spread is None:
            return None
        out.append(spread)
    return out


def _spread(prints: Sequence[Fingerprint | None]) -> float | None:
    """The largest minus the smallest sum of squares; None when one is absent or not finite."""
    values = [p.ss for p in prints if p is not None and math.isfinite(p.ss)]
    return max(values) - min(values) if len(values) == len(prints) else None
