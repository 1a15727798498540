"""The ``checks:`` section of the job file: one spec model per check and the drills.

Each check is optional; ``smoke:`` with nothing after it means "enabled, with defaults". Fields
every check accepts are on :class:`CheckSpec`; a drill (:class:`DrillSpec`, docs/drills.md) is a
check spec too, run as ``drill:<name>`` after the checks.
"""

from __future__ import annotations

import difflib
import itertools
import re
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BeforeValidator, Field, model_validator

from trainguard._internal.limits import MAX_SECONDS, MAX_WORLD_SIZE
from trainguard._internal.model import ConfigModel, one_of
from trainguard.config.fault_params import FaultParams
from trainguard.config.faults import (
    EXPECTATIONS,
    FAULTS,
    Expectation,
    FaultClass,
    FaultNotInstalled,
    fault_class,
    faults_judged_by,
)
from trainguard.config.values import Argv, Env

__all__ = [
    "CanaryCheck",
    "CheckSpec",
    "Checks",
    "DeterminismCheck",
    "DrillSpec",
    "HeadroomSearch",
    "ParallelCheck",
    "ProfileCheck",
    "ReshardCheck",
    "ResumeCheck",
    "SmokeCheck",
]

class CheckSpec(ConfigModel):
    """Fields every check accepts."""

    steps: int = Field(ge=1)
    args: Argv = Field(default_factory=list)
    env: Env = Field(default_factory=dict)
    timeout: float | None = Field(None, gt=0, le=MAX_SECONDS)
    seed: int | None = Field(None, ge=0, le=2**32 - 1)
    #: the comparisons this check may pass without, by name: ``[state]`` lets a final checkpoint
    #: that could not be compared (over a read limit, unreadable, one run's missing) leave the
    #: verdict to the trajectory, and the report says so. Without it a skipped comparison is
    #: an error, never a pass (docs/security.md, "What never passes")
    allow_uncompared: list[Literal["state"]] = Field(default_factory=list)


class SmokeCheck(CheckSpec):
    """``checks.smoke``: a few steps end to end."""

    steps: int = Field(5, ge=1)


class CanaryCheck(CheckSpec):
    """``checks.canary``: learns on real data within strict limits."""

    steps: int = Field(60, ge=2)
    max_seconds: float | None = Field(None, gt=0)
    max_memory_mb: float | None = Field(None, gt=0)
    min_loss_drop: float = Field(0.2, ge=0, lt=1)
    spike_factor: float = Field(10.0, gt=1)
    #: a validation metric (a name in job.metrics) that must fall by ``min_val_drop`` too
    val_metric: str | None = Field(None, min_length=1)
    min_val_drop: float = Field(0.1, ge=0, lt=1)
    #: a gradient-norm metric (a name in job.metrics) whose every value must lie in
    #: ``grad_norm_range``
    grad_norm: str | None = Field(None, min_length=1)
    grad_norm_range: list[float] | None = None
    #: the saved trajectory the run must stay near (docs/baselines.md): ``latest`` (the newest
    #: baseline of this machine saved for the same run), ``off``, or a baseline file's path
    #: (relative to the job file)
    baseline: str = Field("latest", min_length=1)
    #: half-width of the baseline band, relative to the baseline's smoothed value
    baseline_tolerance: float = Field(0.2, gt=0, le=10)

    @model_validator(mode="after")
    def _grad_norm_range_is_an_interval(self) -> CanaryCheck:
        bounds = self.grad_norm_range
        if bounds is not None and (len(bounds) != 2 or not 0 <= bounds[0] <= bounds[1]):
            raise ValueError(
                f"grad_norm_range must be [low, high] with 0 <= low <= high, got {bounds!r}; "
                "e.g. `grad_norm_range: [0.0, 100.0]`"
            )
        if (bounds is None) != (self.grad_norm is None):
            raise ValueError(
                "grad_norm and grad_norm_range go together: name the metric "
                "(`grad_norm: grad_norm`) and its allowed range (`grad_norm_range: [0.0, 100.0]`)"
            )
        return self


class DeterminismCheck(CheckSpec):
    """``checks.determinism``: same seed twice gives the same trajectory."""

    steps: int = Field(20, ge=1)
    rtol: float = Field(0.0, ge=0)
    atol: float = Field(0.0, ge=0)


class ResumeCheck(CheckSpec):
    """``checks.resume``: killed after ``after_step`` and resumed equals uninterrupted; with
    ``chain``, killed and resumed again after each step it lists (one run, several cycles)."""

    steps: int = Field(40, ge=2)
    after_step: int = Field(ge=1)
    rtol: float = Field(0.0, ge=0)
    atol: float = Field(0.0, ge=0)
    max_lost_steps: int | None = Field(None, ge=0)
    #: the metrics whose trajectories must match after the resume (default: every metric of
    #: job.metrics): state a resume drops may show in one metric only (an EMA in its own)
    metrics: list[str] | None = Field(None, min_length=1)
    #: the steps after which the run is killed, in order, each kill resumed from the checkpoint
    #: the one before left (``after_step`` is the first; give either): a bug that shows only on
    #: the second resume (state restored once and not saved again) needs two
    chain: list[int] | None = Field(None, min_length=1)

    @model_validator(mode="before")
    @classmethod
    def _first_cut_is_after_step(cls, data: Any) -> Any:
        if isinstance(data, dict) and "after_step" not in data and isinstance(data.get("chain"), list) \
                and data["chain"]:
            return {**data, "after_step": data["chain"][0]}
        return data

    @model_validator(mode="after")
    def _after_step_inside_run(self) -> ResumeCheck:
        cuts = self.cuts
        if self.chain is not None and self.chain[0] != self.after_step:
            raise ValueError(f"after_step ({self.after_step}) is not chain's first step ({self.chain[0]}); "
                             "give chain alone")
        if any(b <= a for a, b in itertools.pairwise(cuts)):
            raise ValueError(f"chain {cuts} must list increasing steps")
        if cuts[-1] >= self.steps:
            raise ValueError(
                f"{'chain ends at' if self.chain else 'after_step'} ({cuts[-1]}) must be smaller than "
                f"steps ({self.steps}) so there are steps left to compare after the resume"
            )
        return self

    @property
    def cuts(self) -> list[int]:
        """The steps after which the run is killed: ``chain``, else ``[after_step]``."""
        return list(self.chain) if self.chain else [self.after_step]


class ParallelCheck(CheckSpec):
    """``checks.parallel``: N ranks train like 1 rank on the same global batch."""

    steps: int = Field(20, ge=1)
    world_size: int = Field(2, ge=2, le=MAX_WORLD_SIZE)
    rtol: float = Field(1e-4, ge=0)
    atol: float = Field(1e-5, ge=0)


class ReshardCheck(CheckSpec):
    """``checks.reshard``: N ranks checkpoint after ``after_step``, M ranks resume from it, and
    the rest must train like the uninterrupted N-rank run (docs/equivalence.md, "Elastic
    resume"). Tolerances as ``checks.parallel``: N ranks and M ranks differ by float rounding."""

    steps: int = Field(20, ge=2)
    after_step: int = Field(ge=1)
    #: [N, M] pairs: the world size that checkpoints, then the one that resumes
    pairs: list[Any] = Field(default_factory=lambda: [[2, 1], [1, 2]], min_length=1)
    rtol: float = Field(1e-4, ge=0)
    atol: float = Field(1e-5, ge=0)

    @model_validator(mode="before")
    @classmethod
    def _default_after_step(cls, data: Any) -> Any:
        if isinstance(data, dict) and "after_step" not in data:  # default: half way (steps // 2)
            steps = data.get("steps", 20)
            if isinstance(steps, int) and not isinstance(steps, bool):
                data = {**data, "after_step": max(1, steps // 2)}
        return data

    @model_validator(mode="after")
    def _pairs_and_steps(self) -> ReshardCheck:
        if self.after_step >= self.steps:
            raise ValueError(
                f"after_step ({self.after_step}) must be smaller than steps ({self.steps}) "
                "so there are steps left to compare after the resume"
            )
        seen = set()
        for i, pair in enumerate(self.pairs):
            ok = (isinstance(pair, (list, tuple)) and len(pair) == 2
                  and all(isinstance(n, int) and not isinstance(n, bool) for n in pair))
            if not ok or not all(1 <= n <= MAX_WORLD_SIZE for n in pair):
                raise ValueError(
                    f"pairs[{i}] must be [N, M]: the world size that checkpoints and the one that "
                    f"resumes, each 1..{MAX_WORLD_SIZE}; got {pair!r}; e.g. `pairs: [[2, 1], [1, 2]]`"
                )
            if pair[0] == pair[1]:
                raise ValueError(
                    f"pairs[{i}] resumes at the world size it checkpointed at ({pair[0]}): that is "
                    f"checks.resume; use two different sizes, e.g. `[{pair[0]}, {max(1, pair[0] // 2) if pair[0] > 1 else 2}]`"
                )
            if tuple(pair) in seen:
                raise ValueError(f"pairs[{i}] {list(pair)} is listed twice; list each pair once")
            seen.add(tuple(pair))
        return self

    @property
    def world_size_pairs(self) -> list[tuple[int, int]]:
        """``pairs`` as (N, M) tuples."""
        return [(int(n), int(m)) for n, m in self.pairs]


class HeadroomSearch(ConfigModel):
    """``checks.profile.headroom``: the largest batch that fits a memory budget per rank, found by
    real short runs with {batch_size} filled: doubling from ``start`` until a run runs out of
    memory (or ``max`` passes), then a binary search (docs/profiling.md, "Memory headroom")."""

    #: the first batch tried (the global batch, as {batch_size})
    start: int = Field(16, ge=1)
    #: the largest batch tried; passing it ends the search ("max reached")
    max: int = Field(4096, ge=1)
    #: memory one rank may use, in MB. CPU: enforced by a memory cgroup per rank (default: 50% of
    #: the available host memory / world_size); GPU: default the device's memory
    memory_budget_mb: float | None = Field(None, gt=0)
    #: share of the budget kept free: the safe batch is the largest whose fitted peak memory is
    #: at most (1 - margin) x budget (and no larger than the largest passing batch)
    margin: float = Field(0.2, ge=0, lt=1)
    #: steps per probe run
    steps: int = Field(5, ge=1)
    #: ranks per probe run
    world_size: int = Field(1, ge=1, le=MAX_WORLD_SIZE)
    #: probes at most (growth and bisection together)
    max_probes: int = Field(12, ge=2)
    #: the bisection stops when first failing - largest passing <= resolution x largest passing
    resolution: float = Field(0.05, gt=0, lt=1)
    #: every batch tried is a multiple of this (default: world_size)
    multiple_of: int | None = Field(None, ge=1)
    #: how the CPU budget is enforced: auto (cgroup as root, else rlimit), cgroup, rlimit
    #: (RLIMIT_AS: address space, not resident memory)
    enforce: Literal["auto", "cgroup", "rlimit"] = "auto"
    #: seconds one probe may take (default: the profile's timeout, else job.timeout)
    timeout: float | None = Field(None, gt=0, le=MAX_SECONDS)

    @model_validator(mode="after")
    def _range(self) -> HeadroomSearch:
        if self.start > self.max:
            raise ValueError(
                f"start ({self.start}) must not exceed max ({self.max}); e.g. "
                "`headroom: {start: 16, max: 4096}`"
            )
        step = self.step
        if self.start % step:
            raise ValueError(
                f"start ({self.start}) must be a multiple of multiple_of ({step}; default: "
                f"world_size); e.g. `start: {max(step, self.start // step * step)}`"
            )
        return self

    @property
    def step(self) -> int:
        """The batch granularity: ``multiple_of``, default ``world_size``."""
        return self.multiple_of or self.world_size


class ProfileCheck(CheckSpec):
    """``checks.profile``: a short run per world size; step times, throughput, memory, scaling
    (see docs/profiling.md)."""

    steps: int = Field(30, ge=2)
    world_sizes: list[Annotated[int, Field(ge=1, le=MAX_WORLD_SIZE)]] = Field(default_factory=lambda: [1, 2], min_length=1)
    #: steps at the start of each run left out of the step-time statistics
    warmup_steps: int = Field(5, ge=0)
    #: weak: the global batch grows with the ranks; strong: the global batch stays fixed
    scaling: Literal["weak", "strong"] = "strong"
    #: samples in one step at world size 1 (weak scaling: times the ranks); default: the batch
    samples_per_step: int | None = Field(None, ge=1)
    #: the {batch_size} at world size 1 (weak scaling: times the ranks); default: job.batch_size
    batch_size: int | None = Field(None, ge=1)
    #: the metric whose lines mark the end of a step (default: loss, else the first metric)
    step_metric: str | None = Field(None, min_length=1)
    #: a metric with the seconds a step waited for input data (the input-pipeline stall)
    data_wait_metric: str | None = Field(None, min_length=1)
    #: a metric with the seconds a checkpoint write took (default: found from the checkpoint dir)
    checkpoint_metric: str | None = Field(None, min_length=1)
    #: regressions against the stored baseline that fail the check, e.g. "throughput:-5%"
    compare: list[str] = Field(default_factory=list)
    #: the batch-size / memory headroom search (optional; needs {batch_size} in the command)
    headroom: HeadroomSearch | None = None

    @model_validator(mode="after")
    def _sizes_and_warmup(self) -> ProfileCheck:
        if len(set(self.world_sizes)) != len(self.world_sizes) or min(self.world_sizes) < 1:
            raise ValueError(
                f"world_sizes must be distinct positive rank counts, got {self.world_sizes!r}; "
                "e.g. `world_sizes: [1, 2, 4]`"
            )
        if self.warmup_steps + 2 > self.steps:
            raise ValueError(
                f"warmup_steps ({self.warmup_steps}) leaves fewer than 2 measured steps of "
                f"{self.steps}; raise steps or lower warmup_steps"
            )
        return self


_DRILL_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")

def _to_fault_kind(value: Any) -> Any:
    if isinstance(value, str) and value not in FAULTS:
        close = difflib.get_close_matches(value, list(FAULTS), n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise ValueError(
            f"unknown fault {value!r}{hint}; expected one of {', '.join(FAULTS)}"
        )
    return value


def _words(expectations: tuple[Expectation, ...] | list[str]) -> str:
    *most, last = [str(e) for e in expectations]
    return f"{', '.join(most)} or {last}" if most else last


def _not_judged_by(fault: str, params: FaultParams, expect: Expectation, cls: FaultClass) -> str:
    """Why ``expect`` cannot judge a drill of ``fault``, with the expectations that can."""
    allowed = cls.expectations_for(params)
    if str(params.raw("kind")) in getattr(cls, "kind_expectations", {}):
        return (f"a {fault} drill of `params.kind: {params.raw('kind')}` is judged by {_words(allowed)}, "
                f"not {expect}; set `expect: {allowed[0]}` or another kind")
    if len(allowed) == 1:
        return f"a {fault} drill is judged by {allowed[0]}, not {expect}; remove `expect` or set `expect: {allowed[0]}`"
    return (f"`expect: {expect}` judges a {_words(faults_judged_by(expect))} drill; "
            f"for a {fault} drill use {_words(allowed)}")


class DrillSpec(CheckSpec):
    """One entry of ``checks.drills``: a real fault injected into a small run of the job and
    what must follow (docs/drills.md). Options of another expectation than the drill's are
    rejected, so a typo never silently weakens a drill."""

    name: str = Field(min_length=1)
    fault: Annotated[str, BeforeValidator(_to_fault_kind)]
    steps: int = Field(20, ge=2)
    #: the rank the fault hits and the step after which it is injected (default: steps // 2)
    rank: int = Field(0, ge=0)
    after_step: int = Field(ge=1)
    #: seconds until the fault is cleared (None: it lasts until the attempt ends)
    duration: float | None = Field(None, gt=0)
    #: ranks to launch (default: job.world_size)
    world_size: int | None = Field(None, ge=1, le=MAX_WORLD_SIZE)
    #: the launcher's stall limit for this drill (default: job.stall_timeout)
    stall_timeout: float | None = Field(None, gt=0, le=MAX_SECONDS)
    #: the fault's own parameters (each fault documents its own; validated by its class)
    params: dict[str, Any] = Field(default_factory=dict)
    #: default per fault: kill_rank/hang recover, oom/disk_full fail_clean, network continue,
    #: preempt save_and_exit, nan handle_nonfinite, sdc caught, crash_loop give_up
    expect: Annotated[str | None, one_of(EXPECTATIONS)] = None
    # recover
    max_restarts: int | None = Field(None, ge=0)
    max_lost_steps: int | None = Field(None, ge=0)
    rtol: float = Field(0.0, ge=0)
    atol: float = Field(0.0, ge=0)
    # fail_clean (and handle_nonfinite's policy stop): exit within this of the fault; continue:
    # exit within this of the last step
    deadline: float | None = Field(None, gt=0)
    # continue
    min_rate: float | None = Field(None, ge=0)

    @model_validator(mode="before")
    @classmethod
    def _default_after_step(cls, data: Any) -> Any:
        kind = data.get("fault") if isinstance(data, dict) else None
        if isinstance(kind, str) and kind in FAULTS:
            try:
                keys, why = fault_class(kind).spec_keys_not_applying
            except FaultNotInstalled:  # reported when the job file is checked
                keys, why = (), ""
            given = [key for key in keys if key in data]
            if given:  # e.g. a soak's faults strike where its schedule says, each lasting its attempt
                raise ValueError(
                    f"{' and '.join(given)} {'does' if len(given) == 1 else 'do'} not apply to a "
                    f"{kind} drill: {why}"
                )
        if isinstance(data, dict) and "after_step" not in data:
            steps = data.get("steps", 20)
            if isinstance(steps, int) and not isinstance(steps, bool):
                data = {**data, "after_step": max(1, steps // 2)}
        return data

    @model_validator(mode="after")
    def _consistent(self) -> DrillSpec:
        if not _DRILL_NAME.match(self.name):
            raise ValueError(
                f"drill name {self.name!r} may hold only letters, digits, '_', '.' and '-' "
                "(it names the drill in reports, `--only` and pytest ids); e.g. `name: kill-rank1`"
            )
        if self.after_step >= self.steps:
            raise ValueError(
                f"after_step ({self.after_step}) must be smaller than steps ({self.steps}) so "
                "the job has steps left after the fault"
            )
        own = {"recover": ("max_restarts", "max_lost_steps"),
               "fail_clean": ("deadline", "max_lost_steps"), "continue": ("min_rate", "deadline"),
               "save_and_exit": ("max_lost_steps",), "handle_nonfinite": ("deadline",), "caught": (),
               "detect": (), "give_up": ()}
        expect = self.expectation
        cls = self._fault_class()
        if cls is not None and expect not in cls.expectations_for(self.fault_params):
            raise ValueError(_not_judged_by(self.fault, self.fault_params, expect, cls))
        foreign = list(dict.fromkeys(
            key for other, keys in own.items() if other != expect for key in keys
            if key not in own[expect] and getattr(self, key) is not None
        ))
        if foreign:
            raise ValueError(
                f"{' and '.join(foreign)} {'does' if len(foreign) == 1 else 'do'} not apply to "
                f"`expect: {expect}`; remove it or set "
                "the expectation it belongs to (max_restarts: recover; deadline: fail_clean, "
                "continue or handle_nonfinite; min_rate: continue; max_lost_steps: recover, fail_clean or save_and_exit)"
            )
        if expect == "handle_nonfinite" and self.deadline is not None and self.params.get("policy") == "skip":
            raise ValueError(
                "deadline applies to `params.policy: stop` (seconds after the NaN by which the job "
                "must have exited); a `policy: skip` job must complete: remove deadline"
            )
        if expect == "continue" and self.duration is None:
            raise ValueError(
                "`expect: continue` compares the step rate during the fault with the rate "
                "before it and checks the job after the fault ends: set `duration` (seconds)"
            )
        return self

    def _fault_class(self) -> FaultClass | None:
        try:
            return fault_class(self.fault)
        except FaultNotInstalled:  # reported when the job file is checked and when the drill runs
            return None

    @property
    def fault_params(self) -> FaultParams:
        """``params``, as the fault reads them (:class:`~trainguard.config.fault_params.FaultParams`)."""
        return FaultParams(self.params)

    @property
    def expectation(self) -> Expectation:
        """``expect``, or the fault's default: the first of its class's ``expectations``
        (:meth:`trainguard.faults.base.Fault.expectations_for`); recover for a fault whose
        module is not installed (such a drill only reports that it cannot run)."""
        if self.expect is not None:
            return Expectation(self.expect)
        cls = self._fault_class()
        return cls.expectations_for(self.fault_params)[0] if cls is not None else Expectation.RECOVER

    @property
    def restart_limit(self) -> int:
        """Restarts the drill allows: ``max_restarts`` (default 1) for recover, else 0."""
        if self.expectation != "recover":
            return 0
        return 1 if self.max_restarts is None else self.max_restarts

    @property
    def deadline_s(self) -> float:
        """fail_clean and handle_nonfinite (policy stop): seconds after the fault by which the
        job must have exited; continue: seconds after its last step (default 60)."""
        return 60.0 if self.deadline is None else self.deadline

    @property
    def rate_floor(self) -> float:
        """continue: the lowest allowed step rate during the fault as a fraction of the rate
        before it (default 0.5)."""
        return 0.5 if self.min_rate is None else self.min_rate


class Checks(ConfigModel):
    """``checks:`` -- each optional. Its fields are the registered checks'
    (:mod:`trainguard.config.registry`): the model is made from the registry on first use
    (:func:`trainguard.config.registry.checks_model`), so a new check is one module and one
    registration line."""

    if TYPE_CHECKING:  # the fields are the registry's; each is a spec, a list of specs or None
        def __getattr__(self, name: str) -> Any: ...

    def get(self, name: str) -> CheckSpec | None:
        """The spec of the single check ``name`` when the file configures it, else None."""
        value = getattr(self, name, None)
        return value if isinstance(value, CheckSpec) else None
