"""The ``gate:`` section of the job file: the promotion gate's policy (docs/gate.md).

This is only the schema; :func:`trainguard.gate.policy.decide` reads a :class:`GatePolicy` with
the results of the checks and returns the gate's verdict.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from trainguard._internal.model import ConfigModel

__all__ = [
    "GATE_CHECKS",
    "GateCheck",
    "GatePolicy",
    "MissingRule",
    "OnMissing",
    "Thresholds",
]

#: what ``gate.require`` may name; ``drills`` means every configured drill
GATE_CHECKS = ("smoke", "canary", "determinism", "resume", "parallel", "reshard", "drills", "profile")

#: what a missing capability means for the checks that need it
MissingRule = Literal["skip", "block"]
#: a name ``gate.require`` accepts (the entries of :data:`GATE_CHECKS`)
GateCheck = Literal["smoke", "canary", "determinism", "resume", "parallel", "reshard", "drills", "profile"]


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


#: the default ``require`` (``reshard`` is required only where a job file names it: a default
#: that every job file without ``checks.reshard`` would fail to meet)
_ALL: tuple[GateCheck, ...] = ("smoke", "canary", "determinism", "resume", "parallel", "drills", "profile")


class GatePolicy(ConfigModel):
    """``gate:`` -- which checks must pass before the job may be promoted, and limits."""

    require: list[GateCheck] = Field(default_factory=lambda: list(_ALL))
    thresholds: Thresholds = Field(default_factory=lambda: Thresholds.model_validate({}))
    on_missing: OnMissing = Field(default_factory=lambda: OnMissing.model_validate({}))
    #: a promoted report older than this (seconds) is stale for ``trainguard submit``
    max_report_age: float = Field(24 * 3600.0, gt=0)
    #: where ``--submit`` sends a promoted job: ``ray`` (Jobs API) or ``slurm`` (sbatch)
    queue: Literal["ray", "slurm"] = "ray"
