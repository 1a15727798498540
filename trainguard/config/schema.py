"""The job file (``trainguard.yaml``): load, validate, render commands.

A job file describes a training job the user already has -- the command that runs it, how to
resume it, where its metrics appear -- and the checks to run on it::

    job:
      name: mlp
      command: "python train.py --steps {steps} --ckpt-dir {checkpoint_dir} --seed {seed}"
      resume_args: "--resume"
      metrics:
        loss: 'step (?P<step>\\d+) loss (?P<value>\\S+)'
    checks:
      smoke: {steps: 5}

Everything wrong with a document -- YAML syntax, unknown keys, wrong types, bad regexes,
placeholders a check needs -- raises :class:`~trainguard.errors.ConfigError` naming the file,
the key path and the fix. All problems are reported at once, one per line.
"""

from __future__ import annotations

import difflib
import os
import re
import shlex
import string
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, model_validator

from trainguard.errors import ConfigError
from trainguard.gate.policy import GatePolicy

__all__ = [
    "CHECK_NAMES",
    "JOB_FILE_NAMES",
    "PLACEHOLDERS",
    "CanaryCheck",
    "CheckSpec",
    "Checks",
    "DeterminismCheck",
    "DrillSpec",
    "HeadroomSearch",
    "Job",
    "JobFile",
    "MetricFile",
    "ParallelCheck",
    "ProfileCheck",
    "ResumeCheck",
    "SmokeCheck",
    "Target",
    "is_job_file_name",
    "load_config",
    "parse_config",
]

#: File names the pytest plugin collects and ``trainguard check`` looks for in a directory.
JOB_FILE_NAMES = ("trainguard.yaml", "trainguard.yml")

#: Placeholders trainguard fills in ``job.command``, ``job.resume_args``, check ``args``,
#: env values and metric file paths.
PLACEHOLDERS = ("steps", "checkpoint_dir", "seed", "world_size", "run_dir", "batch_size")

#: Check names in the order ``trainguard check`` runs them.
CHECK_NAMES = ("smoke", "canary", "determinism", "resume", "parallel", "profile")

_DEFAULT_REGEX_HINT = "loss: 'step (?P<step>\\d+) loss (?P<value>\\S+)'"


def is_job_file_name(name: str) -> bool:
    """True for ``trainguard.yaml``/``.yml`` and ``*.trainguard.yaml``/``.yml``."""
    return name in JOB_FILE_NAMES or name.endswith((".trainguard.yaml", ".trainguard.yml"))


# --------------------------------------------------------------------------------------------
# Value coercions with messages a person can act on
# --------------------------------------------------------------------------------------------


def _to_argv(value: Any) -> list[str]:
    """A command is a string (split like a POSIX shell would) or a list of strings."""
    if isinstance(value, str):
        try:
            return shlex.split(value)
        except ValueError as exc:  # unbalanced quotes
            raise ValueError(f"cannot split {value!r} like a shell would ({exc})") from None
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return list(value)
    if isinstance(value, list):
        bad = next(v for v in value if not isinstance(v, str))
        raise ValueError(
            f"expected a list of strings, but item {bad!r} is {type(bad).__name__}; quote it"
        )
    raise ValueError(
        f"expected a string or a list of strings, got {value!r} ({type(value).__name__})"
    )


def _to_env(value: Any) -> dict[str, str]:
    """Env values may be written as YAML scalars (``OMP_NUM_THREADS: 1``); they become strings."""
    if not isinstance(value, dict):
        raise ValueError(
            f"expected a mapping of variable name to value, got {value!r} ({type(value).__name__})"
        )
    out: dict[str, str] = {}
    for key, val in value.items():
        if not isinstance(key, str) or not key:
            raise ValueError(f"variable names must be non-empty strings, got {key!r}")
        if isinstance(val, bool):
            out[key] = "1" if val else "0"
        elif isinstance(val, (str, int, float)):
            out[key] = str(val)
        else:
            raise ValueError(
                f"value of {key} must be a string or number, got {val!r} ({type(val).__name__})"
            )
    return out


def _check_regex(value: str) -> str:
    try:
        pattern = re.compile(value)
    except re.error as exc:
        raise ValueError(f"{value!r} is not a valid regular expression: {exc}") from None
    missing = [g for g in ("step", "value") if g not in pattern.groupindex]
    if missing:
        have = sorted(pattern.groupindex) or "none"
        raise ValueError(
            f"regex {value!r} lacks the named group(s) {', '.join(missing)} (it has: {have}); "
            "write them as (?P<step>\\d+) and (?P<value>\\S+)"
        )
    return value


Argv = Annotated[list[str], BeforeValidator(_to_argv)]
Env = Annotated[dict[str, str], BeforeValidator(_to_env)]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class MetricFile(_Model):
    """Metrics read from a JSONL file: one object per line with ``step`` and metric keys."""

    file: str = Field(min_length=1)


def _to_metric_source(value: Any) -> Any:
    if isinstance(value, str):
        return _check_regex(value)
    if isinstance(value, dict):
        return value  # validated as MetricFile
    raise ValueError(
        f"expected a regex string or {{file: path.jsonl}}, got {value!r} ({type(value).__name__})"
    )


MetricSource = Annotated[str | MetricFile, BeforeValidator(_to_metric_source)]


class Job(_Model):
    """``job:`` -- the training job as the user runs it today: a command (``kind: command``,
    the default) or a Ray Train function (``kind: ray_train``, docs/ray-train.md), which is
    rewritten here into the command of trainguard's Ray driver."""

    name: str = Field(min_length=1)
    command: Argv = Field(min_length=1)
    resume_args: Argv = Field(default_factory=list)
    world_size: int = Field(1, ge=1)
    cwd: str = "."
    env: Env = Field(default_factory=dict)
    metrics: dict[str, MetricSource] = Field(min_length=1)
    checkpoint_dir: str = "{run_dir}/checkpoints"
    seed: int = Field(0, ge=0, le=2**32 - 1)
    batch_size: int | None = Field(None, ge=1)
    timeout: float = Field(600.0, gt=0)
    stall_timeout: float = Field(60.0, gt=0)
    max_restarts: int = Field(0, ge=0)
    kind: Literal["command", "ray_train"] = "command"

    @model_validator(mode="before")
    @classmethod
    def _ray_train_as_command(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("kind") == "ray_train":
            from trainguard.raytrain.job import expand_ray_job

            return expand_ray_job(data, PLACEHOLDERS)
        if isinstance(data, dict) and data.get("kind", "command") == "command":
            from trainguard.raytrain.job import RAY_KEYS

            stray = [k for k in RAY_KEYS if k in data]
            if stray:
                raise ValueError(f"{', '.join(stray)} belong to a Ray Train job; add `kind: ray_train` "
                                 "or remove them")
        return data


class CheckSpec(_Model):
    """Fields every check accepts."""

    steps: int = Field(ge=1)
    args: Argv = Field(default_factory=list)
    env: Env = Field(default_factory=dict)
    timeout: float | None = Field(None, gt=0)
    seed: int | None = Field(None, ge=0, le=2**32 - 1)


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
    """``checks.resume``: killed after ``after_step`` and resumed equals uninterrupted."""

    steps: int = Field(40, ge=2)
    after_step: int = Field(ge=1)
    rtol: float = Field(0.0, ge=0)
    atol: float = Field(0.0, ge=0)
    max_lost_steps: int | None = Field(None, ge=0)

    @model_validator(mode="after")
    def _after_step_inside_run(self) -> ResumeCheck:
        if self.after_step >= self.steps:
            raise ValueError(
                f"after_step ({self.after_step}) must be smaller than steps ({self.steps}) "
                "so there are steps left to compare after the resume"
            )
        return self


class ParallelCheck(CheckSpec):
    """``checks.parallel``: N ranks train like 1 rank on the same global batch."""

    steps: int = Field(20, ge=1)
    world_size: int = Field(2, ge=2)
    rtol: float = Field(1e-4, ge=0)
    atol: float = Field(1e-5, ge=0)


class HeadroomSearch(_Model):
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
    world_size: int = Field(1, ge=1)
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
    timeout: float | None = Field(None, gt=0)

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
    world_sizes: list[int] = Field(default_factory=lambda: [1, 2], min_length=1)
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


class Target(_Model):
    """``target:`` -- the full run a profile sizes: its length, budget and failure rate."""

    steps: int | None = Field(None, ge=1)
    samples: int | None = Field(None, ge=1)
    tokens: int | None = Field(None, ge=1)
    #: tokens in one sample (needed with ``tokens``)
    tokens_per_sample: int | None = Field(None, ge=1)
    max_gpus: int = Field(8, ge=1)
    price_per_gpu_hour: float = Field(0.0, ge=0)
    deadline_hours: float | None = Field(None, gt=0)
    min_efficiency: float = Field(0.7, gt=0, le=1)
    #: mean time between failures of one GPU (the job's: this divided by its GPUs)
    mtbf_hours: float = Field(50_000.0, gt=0)
    #: the job's MTBF for given GPU counts, overriding mtbf_hours / N, e.g. {8: 500}
    mtbf_hours_by_gpus: dict[int, float] = Field(default_factory=dict)
    max_lost_minutes: float = Field(10.0, gt=0)
    #: memory one rank may use, in MB (default: the GPU's memory, or host memory / ranks)
    memory_budget_mb: float | None = Field(None, gt=0)

    @model_validator(mode="after")
    def _one_length(self) -> Target:
        given = [k for k in ("steps", "samples", "tokens") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(
                "give the full run's length as exactly one of steps, samples or tokens "
                f"(got {', '.join(given) or 'none'}); e.g. `target: {{steps: 100000}}`"
            )
        if self.tokens is not None and self.tokens_per_sample is None:
            raise ValueError("target.tokens needs tokens_per_sample, e.g. `tokens_per_sample: 2048`")
        return self


_DRILL_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


def _to_fault_kind(value: Any) -> Any:
    from trainguard.config.faults import FAULT_CLASSES

    if isinstance(value, str) and value not in FAULT_CLASSES:
        close = difflib.get_close_matches(value, list(FAULT_CLASSES), n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise ValueError(
            f"unknown fault {value!r}{hint}; expected one of {', '.join(FAULT_CLASSES)}"
        )
    return value


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
    world_size: int | None = Field(None, ge=1)
    #: the launcher's stall limit for this drill (default: job.stall_timeout)
    stall_timeout: float | None = Field(None, gt=0)
    #: the fault's own parameters (each fault documents its own; validated by its class)
    params: dict[str, Any] = Field(default_factory=dict)
    #: default per fault: kill_rank/hang recover, oom/disk_full fail_clean, network continue
    expect: Literal["recover", "fail_clean", "continue"] | None = None
    # recover
    max_restarts: int | None = Field(None, ge=0)
    max_lost_steps: int | None = Field(None, ge=0)
    rtol: float = Field(0.0, ge=0)
    atol: float = Field(0.0, ge=0)
    # fail_clean
    deadline: float | None = Field(None, gt=0)
    # continue
    min_rate: float | None = Field(None, ge=0)

    @model_validator(mode="before")
    @classmethod
    def _default_after_step(cls, data: Any) -> Any:
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
               "fail_clean": ("deadline", "max_lost_steps"), "continue": ("min_rate",)}
        expect = self.expectation
        foreign = [
            key for other, keys in own.items() if other != expect for key in keys
            if key not in own[expect] and getattr(self, key) is not None
        ]
        if foreign:
            raise ValueError(
                f"{' and '.join(foreign)} {'does' if len(foreign) == 1 else 'do'} not apply to "
                f"`expect: {expect}`; remove it or set "
                "the expectation it belongs to (max_restarts: recover; deadline: fail_clean; "
                "min_rate: continue; max_lost_steps: recover or fail_clean)"
            )
        if expect == "continue" and self.duration is None:
            raise ValueError(
                "`expect: continue` compares the step rate during the fault with the rate "
                "before it and checks the job after the fault ends: set `duration` (seconds)"
            )
        return self

    @property
    def expectation(self) -> str:
        """``expect``, or the fault's default (:data:`trainguard.config.faults.DEFAULT_EXPECT`)."""
        from trainguard.config.faults import DEFAULT_EXPECT

        return self.expect or DEFAULT_EXPECT[self.fault]

    @property
    def restart_limit(self) -> int:
        """Restarts the drill allows: ``max_restarts`` (default 1) for recover, else 0."""
        if self.expectation != "recover":
            return 0
        return 1 if self.max_restarts is None else self.max_restarts

    @property
    def deadline_s(self) -> float:
        """fail_clean: seconds after the fault by which the job must have exited (default 60)."""
        return 60.0 if self.deadline is None else self.deadline

    @property
    def rate_floor(self) -> float:
        """continue: the lowest allowed step rate during the fault as a fraction of the rate
        before it (default 0.5)."""
        return 0.5 if self.min_rate is None else self.min_rate


def _null_means_defaults(value: Any) -> Any:
    # ``smoke:`` with nothing after it reads as "enabled, with defaults".
    return {} if value is None else value


def _null_means_list(value: Any) -> Any:
    return [] if value is None else value


class Checks(_Model):
    """``checks:`` -- each optional."""

    smoke: Annotated[SmokeCheck | None, BeforeValidator(_null_means_defaults)] = None
    canary: Annotated[CanaryCheck | None, BeforeValidator(_null_means_defaults)] = None
    determinism: Annotated[DeterminismCheck | None, BeforeValidator(_null_means_defaults)] = None
    resume: Annotated[ResumeCheck | None, BeforeValidator(_null_means_defaults)] = None
    parallel: Annotated[ParallelCheck | None, BeforeValidator(_null_means_defaults)] = None
    profile: Annotated[ProfileCheck | None, BeforeValidator(_null_means_defaults)] = None
    #: fault drills (docs/drills.md); they run after the checks above, each as ``drill:<name>``
    drills: Annotated[list[DrillSpec], BeforeValidator(_null_means_list)] = Field(default_factory=list)


class _Document(_Model):
    job: Job
    checks: Checks = Field(default_factory=Checks)
    target: Target | None = None
    gate: GatePolicy | None = None


# --------------------------------------------------------------------------------------------
# The loaded file
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class JobFile:
    """A validated job file and where it lives."""

    path: Path
    job: Job
    checks: Checks
    #: the full run a profile sizes (``target:``); None when absent
    target: Target | None = None
    #: the promotion gate's policy (``gate:``); None when absent (the defaults apply)
    gate: GatePolicy | None = None

    @property
    def base_dir(self) -> Path:
        """The directory holding the job file; relative paths in it are relative to this."""
        return self.path.parent

    @property
    def cwd(self) -> Path:
        """The job's working directory (``job.cwd`` resolved against the file's directory)."""
        return (self.base_dir / self.job.cwd).resolve()

    @property
    def state_dir(self) -> Path:
        """``.trainguard/`` next to the job file: the one place trainguard writes in a repo."""
        return self.base_dir / ".trainguard"

    def enabled_checks(self, only: Iterable[str] | None = None) -> list[tuple[str, CheckSpec]]:
        """The configured checks in run order, restricted to ``only`` when given."""
        wanted = set(only) if only else None
        drills = self._selected_drills(wanted)
        if wanted:
            wanted -= {"drills"} | {n for n in wanted if n.startswith("drill:")}
        if wanted:
            unknown = sorted(wanted - set(CHECK_NAMES))
            if unknown:
                raise ConfigError(
                    f"unknown check name(s) {', '.join(unknown)}; known: {', '.join(CHECK_NAMES)}"
                    ", drills, drill:<name>",
                    path=str(self.path),
                )
            absent = sorted(n for n in wanted if getattr(self.checks, n) is None)
            if absent:
                raise ConfigError(
                    f"check(s) {', '.join(absent)} requested but not configured; "
                    f"add e.g. `checks: {{{absent[0]}: {{}}}}` to the file",
                    path=str(self.path),
                )
        out: list[tuple[str, CheckSpec]] = []
        for name in CHECK_NAMES:
            spec = getattr(self.checks, name)
            if spec is not None and (wanted is None or name in wanted):
                out.append((name, spec))
        return out + [(f"drill:{d.name}", d) for d in drills]

    def _selected_drills(self, wanted: set[str] | None) -> list[DrillSpec]:
        """Drills named in ``wanted`` (``drills``: all, ``drill:NAME``: one); all when None."""
        drills = list(self.checks.drills)
        if wanted is None:
            return drills
        names = {n.partition(":")[2] for n in wanted if n.startswith("drill:")}
        unknown = sorted(names - {d.name for d in drills})
        if unknown or ("drills" in wanted and not drills):
            have = ", ".join(d.name for d in drills) or "none configured"
            raise ConfigError(
                f"drill(s) {', '.join(unknown) or 'drills'} requested but not in checks.drills "
                f"(drills here: {have}); add an entry such as "
                "`drills: [{name: kill, fault: kill_rank, rank: 1}]`",
                path=str(self.path),
            )
        return [d for d in drills if "drills" in wanted or d.name in names]

    def render(self, tokens: Iterable[str], values: Mapping[str, object]) -> list[str]:
        """Fill placeholders in each token (tokens were split before filling, so a value with
        spaces stays one argument)."""
        return [render_placeholders(t, values) for t in tokens]

    def argv(
        self,
        values: Mapping[str, object],
        *,
        extra_args: Iterable[str] = (),
        resume: bool = False,
    ) -> list[str]:
        """The job's command with placeholders filled, plus ``resume_args`` and extra args."""
        tokens = list(self.job.command)
        if resume:
            tokens += self.job.resume_args
        tokens += list(extra_args)
        return self.render(tokens, values)


def render_placeholders(template: str, values: Mapping[str, object]) -> str:
    """``str.format`` with only the named placeholders (``{{``/``}}`` escape braces)."""
    return template.format_map(dict(values))


def _placeholders_in(template: str) -> list[str]:
    """Field names used in a format template; raises ValueError on malformed braces."""
    names = []
    for _, field, _, _ in string.Formatter().parse(template):
        if field is not None:
            names.append(field)
    return names


# --------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------

_FIX: dict[str, str] = {
    "job": "add a `job:` mapping with at least `name`, `command` and `metrics`",
    "job.name": "give the job a short name, e.g. `name: mlp`",
    "job.command": 'the command that trains, e.g. "python train.py --steps {steps}"',
    "job.metrics": f"map metric names to a regex, e.g. {_DEFAULT_REGEX_HINT}, or to {{file: metrics.jsonl}}",
    "job.world_size": "the number of ranks to launch, e.g. `world_size: 2`",
    "job.timeout": "seconds one run may take, e.g. `timeout: 600`",
    "job.stall_timeout": "seconds without a new metric line before the run counts as hung",
    "job.env": "a mapping such as `env: {OMP_NUM_THREADS: \"1\"}`",
    "checks.resume.after_step": "the step after which the run is killed, e.g. `after_step: 25`",
}


# pydantic names union branches and validators in error locations; they are not user keys
_BRANCH_NAMES = frozenset({"str", "MetricFile", "list[str]", "dict[str,str]"})


def _key_path(loc: tuple[int | str, ...]) -> str:
    parts: list[str] = []
    for item in loc:
        # pydantic adds the union/validator branch name to some locations; not a user key
        if isinstance(item, str) and (item in _BRANCH_NAMES or item.startswith("function-")):
            continue
        if isinstance(item, int):
            parts.append(f"[{item}]")
        else:
            parts.append(("." if parts else "") + item)
    return "".join(parts) or "<top level>"


def _allowed_keys(model: type[BaseModel], loc: tuple[int | str, ...]) -> list[str]:
    """The keys the schema accepts at the mapping that holds ``loc``."""
    current: Any = model
    in_mapping = False
    for item in loc[:-1]:
        if isinstance(item, str) and (item in _BRANCH_NAMES or item.startswith("function-")):
            continue
        if isinstance(item, int):  # an item of a list (checks.drills[0]): same schema
            continue
        if in_mapping:  # a user-chosen key of a mapping field (a metric name), not a schema key
            in_mapping = False
            continue
        if not (isinstance(current, type) and issubclass(current, BaseModel)):
            return []
        field = current.model_fields.get(str(item))
        if field is None:
            return []
        in_mapping = getattr(field.annotation, "__origin__", None) is dict
        current = _model_of(field.annotation)
    if isinstance(current, type) and issubclass(current, BaseModel):
        return list(current.model_fields)
    return []


def _model_of(annotation: Any) -> Any:
    for candidate in getattr(annotation, "__args__", ()) or (annotation,):
        inner = _model_of(candidate) if getattr(candidate, "__args__", None) else candidate
        if isinstance(inner, type) and issubclass(inner, BaseModel):
            return inner
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    metadata = getattr(annotation, "__metadata__", None)
    if metadata is not None:
        return _model_of(annotation.__origin__)
    return None


def _describe(error: Any) -> str:
    kind = error["type"]
    value = error.get("input")
    got = f"{value!r} ({type(value).__name__})"
    if kind == "missing":
        return "required key is missing"
    if kind in ("value_error", "assertion_error"):
        return str(error["msg"]).removeprefix("Value error, ").removeprefix("Assertion failed, ")
    expected = {
        "int_type": "an integer",
        "int_from_float": "a whole number",
        "float_type": "a number",
        "string_type": "a string",
        "bool_type": "true or false",
        "dict_type": "a mapping",
        "list_type": "a list",
        "model_type": "a mapping",
        "model_attributes_type": "a mapping",
        "dict_attributes_type": "a mapping",
    }.get(kind)
    if expected:
        return f"expected {expected}, got {got}"
    ctx = error.get("ctx") or {}
    bounds = {
        "greater_than_equal": (">=", "ge"),
        "greater_than": (">", "gt"),
        "less_than_equal": ("<=", "le"),
        "less_than": ("<", "lt"),
    }
    if kind in bounds:
        sym, key = bounds[kind]
        return f"expected a value {sym} {ctx.get(key)}, got {value!r}"
    if kind in ("too_short", "string_too_short"):
        return f"must not be empty, got {value!r}"
    return f"{error['msg']} (got {got})"


def _format_validation_error(exc: ValidationError) -> list[tuple[str, str]]:
    problems: list[tuple[str, str]] = []
    for error in exc.errors():
        loc = tuple(error["loc"])
        if loc and loc[-1] == "str" and isinstance(error.get("input"), dict):
            continue  # the str branch of "regex or {file: ...}"; the mapping branch reports it
        key = _key_path(loc)
        if error["type"] == "extra_forbidden":
            allowed = _allowed_keys(_Document, loc)
            unknown = str(loc[-1])
            close = difflib.get_close_matches(unknown, allowed, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            msg = f"unknown key '{unknown}'{hint}; allowed here: {', '.join(allowed)}"
        else:
            msg = _describe(error)
            fix = _FIX.get(key)
            if fix and not (loc == ("job",) and error["type"] == "value_error"):  # ray_train: own fix
                msg += f". Fix: {fix}"
        problems.append((key, msg))
    return problems


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate keys (PyYAML silently keeps the last one)."""


def _construct_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False) -> Any:
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)  # type: ignore[no-untyped-call]
        try:
            hash(key)
        except TypeError:
            raise yaml.constructor.ConstructorError(
                None, None, f"unhashable key {key!r}", key_node.start_mark
            ) from None
        if key in seen:
            raise yaml.constructor.ConstructorError(
                f"key {key!r} first defined on line {seen[key] + 1}",
                None,
                f"duplicate key {key!r}",
                key_node.start_mark,
            )
        seen[key] = key_node.start_mark.line
    return loader.construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor(
    yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG,
    _construct_mapping,  # type: ignore[arg-type]
)


def load_config(path: str | os.PathLike[str]) -> JobFile:
    """Load and validate a job file (or the ``trainguard.yaml`` inside a directory)."""
    target = Path(path)
    if target.is_dir():
        for name in JOB_FILE_NAMES:
            if (target / name).is_file():
                target = target / name
                break
        else:
            raise ConfigError(
                f"no {' or '.join(JOB_FILE_NAMES)} in this directory; create one with "
                "`trainguard init` or pass the file's path",
                path=str(target),
            )
    try:
        text = target.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(
            "file not found; pass the path of your job file (e.g. trainguard.yaml)",
            path=str(target),
        ) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read the file: {exc}", path=str(target)) from None
    return parse_config(text, path=target)


def parse_config(text: str, *, path: str | os.PathLike[str] = "trainguard.yaml") -> JobFile:
    """Validate the text of a job file; ``path`` is used for messages and relative paths."""
    where = str(path)
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc)
        context = getattr(exc, "context", None)
        if context and getattr(exc, "problem", None):
            problem = f"{problem} ({context})"
        raise ConfigError(f"invalid YAML{at}: {problem}", path=where) from None
    except (ValueError, OverflowError, RecursionError) as exc:  # e.g. absurd timestamps
        raise ConfigError(f"invalid YAML: {exc}", path=where) from None
    if data is None:
        raise ConfigError("the file is empty; it needs a `job:` section", path=where, key="job")
    if not isinstance(data, dict):
        raise ConfigError(
            f"expected a mapping with a `job:` key at the top level, got {type(data).__name__}",
            path=where,
        )
    try:
        doc = _Document.model_validate(data)
    except ValidationError as exc:
        problems = _format_validation_error(exc)
        raise _config_error(where, problems) from None
    job_file = JobFile(path=Path(path).resolve(), job=doc.job, checks=doc.checks, target=doc.target, gate=doc.gate)
    problems = _cross_checks(job_file)
    if problems:
        raise _config_error(where, problems)
    return job_file


def _config_error(where: str, problems: list[tuple[str, str]]) -> ConfigError:
    if len(problems) == 1:
        key, msg = problems[0]
        return ConfigError(msg, path=where, key=key)
    lines = "\n".join(f"  {key}: {msg}" for key, msg in problems)
    return ConfigError(f"{len(problems)} problems:\n{lines}", path=where)


def _cross_checks(job_file: JobFile) -> list[tuple[str, str]]:
    """Placeholders and what each configured check needs from the job."""
    job, checks = job_file.job, job_file.checks
    problems: list[tuple[str, str]] = []
    known = set(PLACEHOLDERS)
    used: set[str] = set()

    def scan(key: str, template: str, allowed: set[str]) -> None:
        try:
            names = _placeholders_in(template)
        except ValueError as exc:
            problems.append((key, f"{template!r}: {exc}; write a literal brace as {{{{ or }}}}"))
            return
        for name in names:
            if name not in allowed:
                hint = difflib.get_close_matches(name, sorted(allowed), n=1)
                extra = f" (did you mean {{{hint[0]}}}?)" if hint else ""
                problems.append(
                    (
                        key,
                        f"unknown placeholder {{{name}}} in {template!r}{extra}; known: "
                        + ", ".join(f"{{{p}}}" for p in sorted(allowed))
                        + "; write a literal brace as {{ or }}",
                    )
                )
            else:
                used.add(name)

    for i, token in enumerate(job.command):
        scan(f"job.command[{i}]", token, known)
    for i, token in enumerate(job.resume_args):
        scan(f"job.resume_args[{i}]", token, known)
    for var, val in job.env.items():
        scan(f"job.env.{var}", val, known)
    scan("job.checkpoint_dir", job.checkpoint_dir, known - {"checkpoint_dir"})
    for metric, source in job.metrics.items():
        if isinstance(source, MetricFile):
            scan(f"job.metrics.{metric}.file", source.file, known | {"rank"})
    for name, spec in job_file.enabled_checks():
        for i, token in enumerate(spec.args):
            scan(f"{_check_key(job_file, name)}.args[{i}]", token, known)
        for var, val in spec.env.items():
            scan(f"{_check_key(job_file, name)}.env.{var}", val, known)

    command_text = " ".join(job.command) + " " + " ".join(job.resume_args)
    env_text = " ".join(job.env.values())
    if "batch_size" in used and job.batch_size is None:
        problems.append(
            (
                "job.batch_size",
                "the command uses {batch_size} but job.batch_size is not set. "
                "Fix: add `batch_size: 32` (the global batch size) under job",
            )
        )
    for name, spec in job_file.enabled_checks():
        if "{steps}" not in command_text and not any("{steps}" in a for a in spec.args):
            problems.append(
                (
                    f"{_check_key(job_file, name)}.steps",
                    f"the check runs {spec.steps} steps but job.command has no {{steps}} "
                    "placeholder, so trainguard cannot choose the run length. Fix: pass it to "
                    "your script, e.g. add `--steps {steps}` to job.command",
                )
            )
    if checks.resume is not None:
        if not job.resume_args:
            problems.append(
                (
                    "job.resume_args",
                    "checks.resume needs to know how to resume the job. Fix: set "
                    'job.resume_args to the flags that make the script resume, e.g. "--resume"',
                )
            )
        if "{checkpoint_dir}" not in command_text + " " + env_text:
            problems.append(
                (
                    "job.command",
                    "checks.resume needs the job to write checkpoints where trainguard can find "
                    "them. Fix: pass {checkpoint_dir} to the script, e.g. `--ckpt-dir "
                    "{checkpoint_dir}` in job.command or `CKPT_DIR: \"{checkpoint_dir}\"` in job.env",
                )
            )
    if checks.canary is not None and "loss" not in job.metrics:
        problems.append(
            (
                "job.metrics",
                "checks.canary judges the `loss` metric, but job.metrics has none "
                f"(it has: {', '.join(job.metrics)}). Fix: add {_DEFAULT_REGEX_HINT}",
            )
        )
    if checks.canary is not None:
        for key in ("val_metric", "grad_norm"):
            name = getattr(checks.canary, key)
            if name is not None and name not in job.metrics:
                problems.append(
                    (
                        f"checks.canary.{key}",
                        f"{name!r} is not one of job.metrics (it has: {', '.join(job.metrics)}). "
                        f"Fix: add a `{name}` regex to job.metrics or name one of those",
                    )
                )
    if checks.profile is not None:
        problems += _profile_problems(job_file, checks.profile, used)
    problems += _drill_problems(job_file, command_text, env_text)
    return problems


def _check_key(job_file: JobFile, name: str) -> str:
    """``checks.resume`` for a check, ``checks.drills[2]`` for the drill ``drill:<name>``."""
    if name.startswith("drill:"):
        for i, drill in enumerate(job_file.checks.drills):
            if f"drill:{drill.name}" == name:
                return f"checks.drills[{i}]"
    return f"checks.{name}"


def _drill_problems(job_file: JobFile, command_text: str, env_text: str) -> list[tuple[str, str]]:
    """Unique names, ranks that exist, what recover/fail_clean need, each fault's parameters."""
    from trainguard.config.faults import FaultNotInstalled, fault_class

    job = job_file.job
    problems: list[tuple[str, str]] = []
    seen: dict[str, int] = {}
    for i, drill in enumerate(job_file.checks.drills):
        key = f"checks.drills[{i}]"
        if drill.name in seen:
            problems.append((f"{key}.name", f"duplicate drill name {drill.name!r} (also "
                             f"checks.drills[{seen[drill.name]}]); give each drill its own name"))
        seen.setdefault(drill.name, i)
        world_size = drill.world_size or job.world_size
        if drill.rank >= world_size:
            problems.append((f"{key}.rank", f"rank {drill.rank} does not exist in a run of "
                             f"{world_size} rank(s); use 0..{world_size - 1} or set world_size"))
        if drill.expectation in ("recover", "fail_clean"):
            if not job.resume_args:
                problems.append((f"{key}.expect", f"`expect: {drill.expectation}` resumes the job "
                                 "from its latest checkpoint. Fix: set job.resume_args, e.g. "
                                 '"--resume"'))
            if "{checkpoint_dir}" not in command_text + " " + env_text:
                problems.append((f"{key}.expect", f"`expect: {drill.expectation}` needs the job to "
                                 "checkpoint where trainguard can find it. Fix: pass "
                                 "{checkpoint_dir} to the script, e.g. `--ckpt-dir {checkpoint_dir}`"))
        try:
            cls = fault_class(drill.fault)
        except FaultNotInstalled:
            continue  # reported when the drill runs; the rest of the file stays usable
        for param, message in cls.validate(drill.params):
            problems.append((f"{key}.params.{param}", message))
    return problems


def _profile_problems(job_file: JobFile, spec: ProfileCheck, used: set[str]) -> list[tuple[str, str]]:
    """What ``checks.profile`` needs: known metric names and a way to count samples."""
    job = job_file.job
    problems: list[tuple[str, str]] = []
    for key in ("step_metric", "data_wait_metric", "checkpoint_metric"):
        name = getattr(spec, key)
        if name is not None and name not in job.metrics:
            problems.append(
                (
                    f"checks.profile.{key}",
                    f"{name!r} is not one of job.metrics (it has: {', '.join(job.metrics)}). "
                    f"Fix: add a `{name}` regex to job.metrics or name one of those",
                )
            )
    if spec.headroom is not None and "batch_size" not in used:
        problems.append(
            (
                "checks.profile.headroom",
                "the memory headroom search runs the job at growing batch sizes, but the command "
                "has no {batch_size} placeholder to pass them. Fix: add `--batch-size "
                "{batch_size}` (your script's flag) to job.command or checks.profile.args, or "
                "remove checks.profile.headroom",
            )
        )
    if spec.scaling == "weak" and spec.samples_per_step is None and "batch_size" not in used:
        problems.append(
            (
                "checks.profile.scaling",
                "weak scaling grows the global batch with the ranks, but the command has no "
                "{batch_size} placeholder to pass it. Fix: add `--batch-size {batch_size}` to "
                "job.command (or checks.profile.args), or use `scaling: strong`",
            )
        )
    return problems
