"""The job file (``trainguard.yaml``): the models of its sections and the loaded file.

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

This module holds ``job:`` and ``target:`` (``checks:`` is in :mod:`trainguard.config.checks`,
``gate:`` in :mod:`trainguard.config.gate`), the whole document and :class:`JobFile`, what
:func:`~trainguard.config.loading.load_config` returns. Everything wrong with a document raises
:class:`~trainguard.errors.ConfigError` (:mod:`trainguard.config.problems`).
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

from pydantic import (
    AfterValidator,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    model_validator,
)

from trainguard._internal.limits import MAX_SECONDS, MAX_WORLD_SIZE
from trainguard._internal.model import ConfigModel
from trainguard.config.backends import BACKENDS, backend_for, known_kind
from trainguard.config.checks import Checks, CheckSpec, DrillSpec
from trainguard.config.gate import GatePolicy
from trainguard.config.registry import ChecksField, check_names, no_checks, on_change
from trainguard.config.restart import RestartPolicy
from trainguard.config.values import Argv, Env, PathText, Text, check_regex, compile_regex
from trainguard.errors import ConfigError
from trainguard.report import CheckId

__all__ = [
    "PLACEHOLDERS",
    "RESUME_PLACEHOLDERS",
    "TRAINERS",
    "Job",
    "JobDocument",
    "JobFile",
    "JobKind",
    "MetricFile",
    "MetricRegex",
    "MetricSource",
    "MetricTrainer",
    "PlaceholderValues",
    "Target",
    "render_placeholders",
]

#: Placeholders trainguard fills in ``job.command``, ``job.resume_args``, check ``args``,
#: env values and metric file paths.
PLACEHOLDERS = ("steps", "checkpoint_dir", "seed", "world_size", "run_dir", "batch_size",
                "latest_checkpoint")
#: known only when a run resumes (the newest complete checkpoint under its checkpoint
#: directory), so allowed in ``job.resume_args`` only
RESUME_PLACEHOLDERS = ("latest_checkpoint",)
#: one run's placeholder values by name: numbers stay numbers (a ``ray_train`` job's
#: ``"{steps}"`` in ``job.config`` becomes 40), paths are text
PlaceholderValues = Mapping[str, str | int]

#: how a job's ranks are started (``job.kind``): a kind a backend is registered for
#: (:mod:`trainguard.config.backends`), ``command`` or ``ray_train`` unless one was added
JobKind = Annotated[str, AfterValidator(known_kind)]


class MetricFile(ConfigModel):
    """Metrics read from a JSONL file: one object per line with ``step`` and metric keys."""

    file: PathText = Field(min_length=1)


class MetricRegex(ConfigModel):
    """Metrics read from output lines whose step is implicit: ``step: count`` (the n-th matching
    line of a rank is step ``n * every``) or taken from another named group (``step:
    global_step`` reads ``(?P<global_step>\\d+)``). Without ``step``: the regex's ``step`` group
    when it has one, else ``count``."""

    regex: str = Field(min_length=1)
    step: str | None = Field(None, min_length=1)
    every: int = Field(1, ge=1)

    @model_validator(mode="after")
    def _groups(self) -> MetricRegex:
        pattern = compile_regex(self.regex)
        check_regex(self.regex, ("value",))
        groups = sorted(pattern.groupindex)
        if self.step == "value":
            raise ValueError("`step: value` would read the step from the value group; name the group "
                             "that holds the step, or write `step: count` to count matching lines")
        if self.step not in (None, "count") and self.step not in pattern.groupindex:
            close = difflib.get_close_matches(self.step, [*groups, "count"], n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise ValueError(
                f"step: {self.step!r} names no group of regex {self.regex!r}{hint} (its groups: "
                f"{', '.join(groups)}); write `step: count` to count matching lines, or name the group "
                "holding the step, e.g. (?P<global_step>\\d+) with `step: global_step`"
            )
        if self.every != 1 and self.step_group != "count":
            raise ValueError(
                f"every: {self.every} applies to `step: count` only (here the step comes from group "
                f"'{self.step_group}'); remove `every` or write `step: count`"
            )
        return self

    @property
    def step_group(self) -> str:
        """``"count"`` or the name of the group holding the step (``step`` left out resolved)."""
        if self.step is not None:
            return self.step
        return "step" if "step" in re.compile(self.regex).groupindex else "count"


#: the trainers whose metrics trainguard's start-up hook records (``{trainer: ...}``)
TRAINERS = ("huggingface", "lightning")
#: what people also call them, for the "did you mean" of an unknown trainer
_TRAINER_ALIASES = {
    "hf": "huggingface", "transformers": "huggingface", "hugging_face": "huggingface",
    "hugging-face": "huggingface", "pl": "lightning", "pytorch_lightning": "lightning",
    "pytorch-lightning": "lightning", "lightning.pytorch": "lightning",
}


class MetricTrainer(ConfigModel):
    """Metrics a trainer computes, recorded inside each rank by trainguard's start-up hook
    (docs/metrics.md). ``key``: the name the trainer logs (default: the metric's own name);
    ``loss`` is the training loss of each optimizer step at full precision."""

    trainer: str
    key: str | None = Field(None, min_length=1)

    @model_validator(mode="after")
    def _known_trainer(self) -> MetricTrainer:
        if self.trainer not in TRAINERS:
            close = _TRAINER_ALIASES.get(self.trainer.lower()) or next(
                iter(difflib.get_close_matches(self.trainer.lower(), TRAINERS, n=1, cutoff=0.5)), None
            )
            hint = f" (did you mean '{close}'?)" if close else ""
            raise ValueError(f"unknown trainer {self.trainer!r}{hint}; known: {', '.join(TRAINERS)}")
        return self

    def key_for(self, name: str) -> str:
        """The trainer's key the metric ``name`` reads."""
        return self.key or name


_SOURCE_KEYS = {"file": "MetricFile", "regex": "MetricRegex", "trainer": "MetricTrainer"}
_SOURCE_FORMS = "a regex string or a mapping ({file: path.jsonl}, {regex: ..., step: count} or {trainer: huggingface})"


def _to_metric_source(value: Any) -> Any:
    if isinstance(value, str):
        return check_regex(value)
    if isinstance(value, dict):
        given = [k for k in _SOURCE_KEYS if k in value]
        if len(given) > 1:
            raise ValueError(f"give one of {', '.join(given)}, not several; one metric has one source")
        if not given and _closest_form(value) is None:
            raise ValueError(f"a metric mapping needs `file`, `regex` or `trainer`, got keys "
                             f"{', '.join(str(k) for k in value) or 'none'}")
        return value
    if isinstance(value, (MetricFile, MetricRegex, MetricTrainer)):
        return value
    raise ValueError(f"expected {_SOURCE_FORMS}, got {value!r} ({type(value).__name__})")


def _closest_form(value: dict[Any, Any]) -> str | None:
    """The form whose keys a mapping without `file`/`regex`/`trainer` comes closest to (a typo:
    that form then reports the unknown key with its "did you mean")."""
    forms: dict[str, type[ConfigModel]] = {
        "MetricFile": MetricFile, "MetricRegex": MetricRegex, "MetricTrainer": MetricTrainer,
    }
    fields = {f: tag for tag, model in forms.items() for f in model.model_fields}
    for key in value:
        close = difflib.get_close_matches(str(key), list(fields), n=1)
        if close:
            return fields[close[0]]
    return None


def _metric_source_tag(value: Any) -> str:
    """Which form a (pre-validated) metric source is: pydantic validates only that branch."""
    if isinstance(value, dict):
        given = [tag for key, tag in _SOURCE_KEYS.items() if key in value]
        return given[0] if given else _closest_form(value) or "MetricFile"
    return type(value).__name__


#: a metric's source: a regex over the job's output lines (with a step group, or a mapping with
#: an implicit step), a JSONL file, or a trainer's own values recorded by the start-up hook
MetricSource = Annotated[
    Annotated[str, Tag("str")]
    | Annotated[MetricFile, Tag("MetricFile")]
    | Annotated[MetricRegex, Tag("MetricRegex")]
    | Annotated[MetricTrainer, Tag("MetricTrainer")],
    Discriminator(_metric_source_tag),
    BeforeValidator(_to_metric_source),
]


class Job(ConfigModel):
    """``job:`` -- the training job as the user runs it today: a command (``kind: command``,
    the default) or a Ray Train function (``kind: ray_train``, docs/ray-train.md), which is
    rewritten here into the command of trainguard's Ray driver."""

    name: Text = Field(min_length=1, max_length=200)
    command: Argv = Field(min_length=1)
    resume_args: Argv = Field(default_factory=list)
    world_size: int = Field(1, ge=1, le=MAX_WORLD_SIZE)
    cwd: PathText = "."
    env: Env = Field(default_factory=dict)
    metrics: dict[str, MetricSource] = Field(min_length=1)
    checkpoint_dir: PathText = Field("{run_dir}/checkpoints", min_length=1)
    seed: int = Field(0, ge=0, le=2**32 - 1)
    batch_size: int | None = Field(None, ge=1)
    timeout: float = Field(600.0, gt=0, le=MAX_SECONDS)
    stall_timeout: float = Field(60.0, gt=0, le=MAX_SECONDS)
    max_restarts: int = Field(0, ge=0)
    #: how trainguard's launcher waits between attempts and when it stops without progress
    restart: RestartPolicy = Field(default_factory=lambda: RestartPolicy.model_validate({}))
    #: False: a one-process job started as a plain script, without the torchrun environment
    #: (RANK, WORLD_SIZE, MASTER_ADDR, ...), for scripts that go distributed when they see it
    distributed_env: bool = True
    #: record the sample indices of every DataLoader batch of each rank's main process through
    #: the start-up hook (``command`` jobs; docs/metrics.md)
    record_samples: bool = True
    #: record every optimizer step of each rank (lr, fingerprints of parameters, gradients and
    #: optimizer state, RNG, scaler), its checkpoint saves and state restores, through the
    #: start-up hook (``command`` jobs; docs/step-records.md)
    record_steps: bool = True
    #: the step records read the optimizer state and the RNG states at a process's first 8
    #: optimizer steps, at the step after each save, restore or seed, and every this many steps
    #: (1: every step; docs/step-records.md#the-schedule)
    record_state_every: int = Field(8, ge=1)
    #: the job's first N steps do not depend on ``{steps}`` (no learning-rate schedule, data
    #: order or eval cadence sized from the total): an uninterrupted run of N steps may then be
    #: the first N steps of a longer run of the same request (docs/equivalence.md)
    steps_independent: bool = False
    #: the script has no option for its number of steps (it runs by epochs, to a time budget):
    #: trainguard ends each run itself after the check's number of steps, all ranks at once
    #: (SIGTERM, then SIGKILL), and judges steps 1..N only (docs/any-script.md)
    stop_after_steps: bool = False
    #: ``command``: trainguard launches ``command`` once per rank (torchrun's contract);
    #: ``ray_train``: one Ray Train driver whose workers are the ranks (docs/ray-train.md); the
    #: kind's backend (:func:`trainguard.config.backends.backend_for`) says how its ranks run
    kind: JobKind = "command"

    @property
    def progress_metric(self) -> str:
        """The metric the checks follow a run's progress by: ``loss``, else the first of
        ``metrics`` (the one rule; every check, drill and profile asks it here)."""
        return "loss" if "loss" in self.metrics else next(iter(self.metrics))

    @property
    def metric_line_regexes(self) -> tuple[str, ...]:
        """The regexes of the metrics read from the job's output lines (a regex string or
        ``{regex: ...}``): what a metric line looks like."""
        return tuple(s if isinstance(s, str) else s.regex for s in self.metrics.values()
                     if isinstance(s, (str, MetricRegex)))

    @model_validator(mode="before")
    @classmethod
    def _as_its_backend_launches_it(cls, data: Any) -> Any:
        """A job of a kind with keys of its own (``ray_train``'s function, config, scaling)
        rewritten by its backend into the command job trainguard launches; keys that another
        kind owns are refused with the kind to add. An unknown kind is left to ``kind``'s own
        check, which names the known ones."""
        kind = data.get("kind", "command") if isinstance(data, dict) else None
        if not (isinstance(kind, str) and kind in BACKENDS):
            return data
        backend = backend_for(kind)
        for other in BACKENDS:
            theirs = backend_for(other)
            stray = [k for k in theirs.job_keys if k in data and k not in backend.job_keys]
            if stray:
                raise ValueError(f"{', '.join(stray)} belong to a {theirs.title} job; add `kind: {other}` "
                                 "or remove them")
        return backend.expand_job(data, tuple(p for p in PLACEHOLDERS if p not in RESUME_PLACEHOLDERS))


class Target(ConfigModel):
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
    #: what one failure costs from the fault to the first new step (detection, requeue, start-up)
    #: until a recover drill measures it (docs/profiling.md, "Goodput forecast")
    restart_minutes: float = Field(10.0, ge=0, le=10_000)
    #: minutes one launch of the real job takes to reach its first step on the target hardware
    #: (loading weights, compiling, warming up): the gate's cost is projected there with it
    startup_minutes: float | None = Field(None, ge=0, le=10_000)
    #: seconds to load a checkpoint on restart (default: as long as the measured save)
    checkpoint_load_seconds: float | None = Field(None, ge=0, le=1e6)
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


class JobDocument(ConfigModel):
    """A whole job file as validated; callers get the :class:`JobFile` built from it."""

    #: ``checks:`` is the registered checks' (built on first validation, once every check
    #: module can be imported)
    model_config = ConfigDict(defer_build=True)

    job: Job
    checks: Annotated[Checks, ChecksField] = Field(default_factory=no_checks)
    target: Target | None = None
    gate: GatePolicy | None = None


def _rebuild_document() -> None:
    """A check registered at run time: ``checks:`` is made again from the registry."""
    JobDocument.model_rebuild(force=True)


on_change(_rebuild_document)


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
            wanted -= {"drills"} | {n for n in wanted if CheckId.parse(n).is_drill}
        names = check_names()
        if wanted:
            unknown = sorted(wanted - set(names))
            if unknown:
                raise ConfigError(
                    f"unknown check name(s) {', '.join(unknown)}; known: {', '.join(names)}"
                    ", drills, drill:<name>",
                    path=str(self.path),
                )
            absent = sorted(n for n in wanted if self.checks.get(n) is None)
            if absent:
                raise ConfigError(
                    f"check(s) {', '.join(absent)} requested but not configured; "
                    f"add e.g. `checks: {{{absent[0]}: {{}}}}` to the file",
                    path=str(self.path),
                )
        out: list[tuple[str, CheckSpec]] = []
        for name in names:
            spec = self.checks.get(name)
            if spec is not None and (wanted is None or name in wanted):
                out.append((name, spec))
        return out + [(str(CheckId.of_drill(d.name)), d) for d in drills]

    def _selected_drills(self, wanted: set[str] | None) -> list[DrillSpec]:
        """Drills named in ``wanted`` (``drills``: all, ``drill:NAME``: one); all when None."""
        drills = list(self.checks.drills)
        if wanted is None:
            return drills
        names = {d for d in (CheckId.parse(n).drill for n in wanted) if d is not None}
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

    def render(self, tokens: Iterable[str], values: PlaceholderValues) -> list[str]:
        """Fill placeholders in each token (tokens were split before filling, so a value with
        spaces stays one argument)."""
        return [render_placeholders(t, values) for t in tokens]

    def argv(
        self,
        values: PlaceholderValues,
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


def render_placeholders(template: str, values: PlaceholderValues) -> str:
    """``str.format`` with only the named placeholders (``{{``/``}}`` escape braces)."""
    return template.format_map(dict(values))
