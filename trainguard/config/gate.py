"""The ``gate:`` section of the job file: the promotion gate's policy (docs/gate.md).

This is only the schema; :func:`trainguard.gate.policy.decide` reads a :class:`GatePolicy` with
the results of the checks and returns the gate's verdict.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field

from trainguard._internal.limits import brief
from trainguard._internal.model import ConfigModel, one_of
from trainguard.config.queues import QUEUES

__all__ = [
    "GatePolicy",
    "MissingRule",
    "OnMissing",
    "Thresholds",
    "default_require",
    "gate_checks",
]

#: what a missing capability means for the checks that need it
MissingRule = Literal["skip", "block"]


def gate_checks() -> list[str]:
    """What ``gate.require`` may name: every registered check (``drills``: every configured
    drill)."""
    from trainguard.config.registry import check_names

    return check_names(many=True)


def default_require() -> list[str]:
    """The ``require`` of a gate that does not say: the registered checks whose descriptor says
    ``gate_default`` (``reshard`` is not: every job file without ``checks.reshard`` would fail
    to meet it)."""
    from trainguard.config.registry import registered

    return [c.name for c in registered() if c.gate_default]


def _a_gate_check(name: Any) -> Any:
    allowed = gate_checks()
    if name not in allowed:
        raise ValueError(f"Input should be {', '.join(repr(n) for n in allowed[:-1])} or {allowed[-1]!r} "
                         f"(got {brief(name)} ({type(name).__name__}))")
    return name


#: a name ``gate.require`` accepts (one of :func:`gate_checks`)
GateCheck = Annotated[str, AfterValidator(_a_gate_check)]


class Thresholds(ConfigModel):
    """Limits on the profile's prediction for the recommended world size."""

    #: lowest scaling efficiency allowed at the recommended world size (0..1)
    min_scaling_efficiency: float | None = Field(None, gt=0, le=1)
    #: the predicted full run's cost, in the currency of ``target.price_per_gpu_hour``
    max_cost: float | None = Field(None, ge=0)
    #: the predicted full run's wall-clock hours (failures included)
    max_predicted_hours: float | None = Field(None, gt=0)
    #: the lowest goodput forecast (effective training time ratio, 0 < x <= 1) allowed at the
    #: recommended world size (docs/profiling.md, "Goodput forecast")
    min_goodput: float | None = Field(None, gt=0, le=1)


class OnMissing(ConfigModel):
    """What a capability this machine lacks means: ``skip`` the checks that need it (the report
    lists them) or ``block`` promotion."""

    gpu: MissingRule = "skip"
    root: MissingRule = "skip"
    ray: MissingRule = "skip"


class GatePolicy(ConfigModel):
    """``gate:`` -- which checks must pass before the job may be promoted, and limits."""

    require: list[GateCheck] = Field(default_factory=default_require)
    thresholds: Thresholds = Field(default_factory=lambda: Thresholds.model_validate({}))
    on_missing: OnMissing = Field(default_factory=lambda: OnMissing.model_validate({}))
    #: a promoted report older than this (seconds) is stale for ``trainguard submit``
    max_report_age: float = Field(24 * 3600.0, gt=0)
    #: where ``--submit`` sends a promoted job: ``ray`` (Jobs API) or ``slurm`` (sbatch), or
    #: another queue registered in :data:`trainguard.config.queues.QUEUES`
    queue: Annotated[str, one_of(QUEUES)] = "ray"
    #: a rank named a straggler (docs/drills.md "Stragglers") is a warning; with this limit, one
    #: whose ratio (its busy ratio over the busiest other rank's) exceeds it blocks promotion
    max_straggler_ratio: float | None = Field(None, gt=1)
