"""What is wrong with a job file, in words: every problem with its key path and the fix.

:func:`format_validation_error` turns pydantic's errors into ``(key, message)`` pairs (an
unknown key names the allowed ones and the closest match), :func:`cross_checks` finds what the
schema alone cannot -- placeholders, and what each configured check and drill needs from the
job -- and :func:`config_error` reports all of them at once as one
:class:`~trainguard.errors.ConfigError`, one per line.
"""

from __future__ import annotations

import difflib
import string
from typing import Any

from pydantic import BaseModel, ValidationError

from trainguard._internal.limits import brief
from trainguard.config.backends import backend_for
from trainguard.config.checks import Checks, ProfileCheck
from trainguard.config.faults import FaultNotInstalled, fault_class
from trainguard.config.registry import JobFacts, checks_model, registered
from trainguard.config.schema import (
    PLACEHOLDERS,
    RESUME_PLACEHOLDERS,
    Job,
    JobDocument,
    JobFile,
    MetricFile,
    MetricRegex,
    MetricSource,
    MetricTrainer,
)
from trainguard.errors import ConfigError
from trainguard.report import CheckId

__all__ = [
    "DEFAULT_REGEX_HINT",
    "config_error",
    "cross_checks",
    "drill_problems",
    "format_validation_error",
    "metric_problems",
    "one_process_problems",
    "profile_problems",
    "resume_problems",
]

DEFAULT_REGEX_HINT = "loss: 'step (?P<step>\\d+) loss (?P<value>\\S+)'"

def _placeholders_in(template: str) -> list[tuple[str, str]]:
    """``(field name, what follows it)`` for each field of a format template (``{run_dir:d}``
    -> ``("run_dir", ":d")``); raises ValueError on malformed braces."""
    fields = []
    for _, field, spec, conversion in string.Formatter().parse(template):
        if field is not None:
            fields.append((field, (f"!{conversion}" if conversion else "") + (f":{spec}" if spec else "")))
    return fields


def _field(text: str) -> str:
    """A placeholder's name as written, or cut and quoted when it is long or unprintable."""
    return text if len(text) <= 40 and text.isprintable() else brief(text, 40)


#: at most this many problems are listed, each cut to this many characters (a message is read
#: by a person; a 50 MB value or a thousand generated keys must not make a 50 MB message)
_MAX_PROBLEMS, _MAX_PROBLEM_CHARS = 25, 1500

_FIX: dict[str, str] = {
    "job": "add a `job:` mapping with at least `name`, `command` and `metrics`",
    "job.name": "give the job a short name, e.g. `name: mlp`",
    "job.command": 'the command that trains, e.g. "python train.py --steps {steps}"',
    "job.metrics": f"map metric names to a regex, e.g. {DEFAULT_REGEX_HINT}, or to {{file: metrics.jsonl}}, "
                   "{regex: ..., step: count} or {trainer: huggingface} (docs/metrics.md)",
    "job.record_samples": "true (the default: the start-up hook records each DataLoader batch's "
                          "sample indices) or false",
    "job.stop_after_steps": "true (the script has no option for its number of steps: trainguard ends "
                            "each run after the check's steps) or false (the default: job.command "
                            "passes {steps})",
    "job.record_steps": "true (the default: the start-up hook records each optimizer step, checkpoint "
                        "save and state restore of every rank) or false",
    "job.record_state_every": "a whole number from 1: the step records read the optimizer state and the "
                              "RNG states every this many steps (8, the default; 1: every step)",
    "job.world_size": "the number of ranks to launch, e.g. `world_size: 2`",
    "job.distributed_env": "true (the default: RANK, WORLD_SIZE, ... as torchrun sets them) or "
                           "false (one process started as a plain script)",
    "job.timeout": "seconds one run may take, e.g. `timeout: 600`",
    "job.stall_timeout": "seconds without a new metric line before the run counts as hung",
    "job.env": "a mapping such as `env: {OMP_NUM_THREADS: \"1\"}`",
    "checks.resume.after_step": "the step after which the run is killed, e.g. `after_step: 25`",
    "gate.max_straggler_ratio": "a ratio above 1, e.g. `max_straggler_ratio: 1.25` (block when a "
                                "rank named a straggler is over 25 % busier than the busiest other "
                                "rank), or remove the key: a straggler is then a warning",
}


# pydantic names union branches and validators in error locations; they are not user keys
_BRANCH_NAMES = frozenset({"str", "MetricFile", "MetricRegex", "MetricTrainer", "list[str]", "dict[str,str]"})
#: the models behind branch names: the keys allowed under a metric source are its form's
_BRANCH_MODELS: dict[str, type[BaseModel]] = {
    "MetricFile": MetricFile, "MetricRegex": MetricRegex, "MetricTrainer": MetricTrainer,
}


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
        if isinstance(item, str) and item in _BRANCH_MODELS:
            current, in_mapping = _BRANCH_MODELS[item], False
            continue
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
        if current is Checks:  # its fields are the registered checks'
            current = checks_model()
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
    got = f"{brief(value)} ({type(value).__name__})"
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
        return f"expected a value {sym} {ctx.get(key)}, got {brief(value)}"
    if kind == "finite_number":
        return (f"expected a finite number, got {brief(value)}; an infinite tolerance or limit would "
                "switch its comparison off. Fix: give a finite value, or remove the key for the default")
    if kind in ("too_short", "string_too_short"):
        return f"must not be empty, got {brief(value)}"
    if kind in ("too_long", "string_too_long"):
        return f"is too long ({ctx.get('max_length')} at most), got {brief(value)}"
    return f"{str(error['msg'])[:300]} (got {got})"

def format_validation_error(exc: ValidationError) -> list[tuple[str, str]]:
    """pydantic's errors for a job file (or one of its sections) as ``(key path, message with
    the fix)`` pairs, in the order pydantic found them."""
    problems: list[tuple[str, str]] = []
    for error in exc.errors():
        loc = tuple(error["loc"])
        if loc and loc[-1] == "str" and isinstance(error.get("input"), dict):
            continue  # the str branch of "regex or {file: ...}"; the mapping branch reports it
        key = _key_path(loc)
        if error["type"] == "extra_forbidden":
            allowed = _allowed_keys(JobDocument, loc)
            unknown = str(loc[-1])
            close = difflib.get_close_matches(unknown, allowed, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            msg = f"unknown key '{unknown}'{hint}; allowed here: {', '.join(allowed)}"
        else:
            msg = _describe(error)
            fix = _FIX.get(key)
            if fix and not (loc == ("job",) and error["type"] == "value_error"):  # the kind's backend names its fix
                msg += f". Fix: {fix}"
        problems.append((key, msg))
    return problems


def config_error(where: str, problems: list[tuple[str, str]]) -> ConfigError:
    """One :class:`~trainguard.errors.ConfigError` for the file ``where`` naming every
    ``(key, message)`` problem: the key itself for one problem, one line each for several."""
    cut = [(_cut(key, 200), _cut(msg, _MAX_PROBLEM_CHARS)) for key, msg in problems[:_MAX_PROBLEMS]]
    if len(cut) == 1:
        key, msg = cut[0]
        return ConfigError(msg, path=where, key=key)
    lines = "\n".join(f"  {key}: {msg}" for key, msg in cut)
    more = f"\n  ... and {len(problems) - len(cut)} more" if len(problems) > len(cut) else ""
    return ConfigError(f"{len(problems)} problems:\n{lines}{more}", path=where)


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text) - limit} more characters)"


def cross_checks(job_file: JobFile) -> list[tuple[str, str]]:
    """Placeholders and what each configured check needs from the job."""
    job = job_file.job
    placeholders = _Placeholders()
    _scan_job_file(job_file, placeholders)
    problems = placeholders.problems
    command_text = " ".join(job.command) + " " + " ".join(job.resume_args)
    env_text = " ".join(job.env.values())
    if "batch_size" in placeholders.used and job.batch_size is None:
        problems.append(
            (
                "job.batch_size",
                "the command uses {batch_size} but job.batch_size is not set. "
                "Fix: add `batch_size: 32` (the global batch size) under job",
            )
        )
    problems += _steps_problems(job_file, command_text)
    facts = JobFacts(job_file, command_text, env_text, frozenset(placeholders.used))
    if not job.distributed_env:
        problems += one_process_problems(facts, [("job.world_size", job.world_size)])
    for check in registered():
        configured = getattr(job_file.checks, check.name, None)
        if configured is not None and configured != []:
            problems += check.requires(configured, facts)
    return problems


class _Placeholders:
    """The placeholders of a job file's templates, scanned one template at a time: the problems
    found, in order, and the names used where they are allowed."""

    def __init__(self) -> None:
        self.problems: list[tuple[str, str]] = []
        self.used: set[str] = set()

    def scan(self, key: str, template: str, allowed: set[str]) -> None:
        """Check the placeholders of ``template``, the value at ``key``, against ``allowed``."""
        try:
            fields = _placeholders_in(template)
        except ValueError as exc:
            self.problems.append((key, f"{brief(template)}: {exc}; write a literal brace as {{{{ or }}}}"))
            return
        for name, tail in fields:
            problem = _placeholder_problem(name, tail, template, allowed)
            if problem is None:
                self.used.add(name)
            else:
                self.problems.append((key, problem))


def _placeholder_problem(name: str, tail: str, template: str, allowed: set[str]) -> str | None:
    """What is wrong with the field ``{name<tail>}`` of ``template``; None when it is an allowed
    placeholder."""
    if tail:  # {run_dir:d}, {seed!z}: str.format would apply it to the value at launch
        return (f"{{{_field(name)}{_field(tail)}}} in {brief(template)}: "
                "placeholders take no format spec or conversion (trainguard fills "
                f"them as text); write {{{_field(name)}}}")
    if name in RESUME_PLACEHOLDERS and name not in allowed:
        return (f"{{{name}}} in {brief(template)}: only a resumed run has a latest "
                "checkpoint (the newest complete one under {checkpoint_dir}), so it "
                "belongs in job.resume_args, e.g. `resume_args: "
                "\"--resume_from_checkpoint {latest_checkpoint}\"`")
    if name not in allowed:
        hint = difflib.get_close_matches(name, sorted(allowed), n=1)
        extra = f" (did you mean {{{hint[0]}}}?)" if hint else ""
        return (f"unknown placeholder {{{_field(name)}}} in {brief(template)}{extra}; known: "
                + ", ".join(f"{{{p}}}" for p in sorted(allowed))
                + "; write a literal brace as {{ or }}")
    return None


def _scan_job_file(job_file: JobFile, placeholders: _Placeholders) -> None:
    """Scan every template of the job file, in the file's order, and note what each metric's
    source needs from the job where the metric comes."""
    job = job_file.job
    known = set(PLACEHOLDERS)
    # {latest_checkpoint} exists only when a run resumes: everywhere but resume_args it is refused
    fresh = known - set(RESUME_PLACEHOLDERS)
    for i, token in enumerate(job.command):
        placeholders.scan(f"job.command[{i}]", token, fresh)
    for i, token in enumerate(job.resume_args):
        placeholders.scan(f"job.resume_args[{i}]", token, known)
    for var, val in job.env.items():
        placeholders.scan(f"job.env.{var}", val, fresh)
    placeholders.scan("job.checkpoint_dir", job.checkpoint_dir, fresh - {"checkpoint_dir"})
    for metric, source in job.metrics.items():
        if isinstance(source, MetricFile):
            placeholders.scan(f"job.metrics.{metric}.file", source.file, fresh | {"rank"})
        placeholders.problems += _metric_source_problems(job, metric, source)
    for name, spec in job_file.enabled_checks():
        for i, token in enumerate(spec.args):
            placeholders.scan(f"{_check_key(job_file, name)}.args[{i}]", token, fresh)
        for var, val in spec.env.items():
            placeholders.scan(f"{_check_key(job_file, name)}.env.{var}", val, fresh)


def _metric_source_problems(job: Job, metric: str, source: MetricSource) -> list[tuple[str, str]]:
    """What the source of the metric ``metric`` needs from the job: a step counted from the
    lines cannot survive a resume; a trainer's metrics come from command jobs only."""
    problems = []
    if isinstance(source, MetricRegex) and source.step_group == "count" and job.resume_args:
        problems.append((f"job.metrics.{metric}.step", _counted_resume_problem(source)))
    if isinstance(source, MetricTrainer) and not backend_for(job.kind).rank_at_start():
        problems.append((
            f"job.metrics.{metric}",
            f"`{{trainer: {source.trainer}}}` is recorded by the start-up hook of `kind: command` jobs "
            "only; a ray_train job's metrics are the keys it passes to ray.train.report, e.g. "
            "`metrics: [loss]` (docs/ray-train.md)",
        ))
    return problems


def _steps_problems(job_file: JobFile, command_text: str) -> list[tuple[str, str]]:
    """Each enabled check whose run length trainguard cannot choose: neither the job's command
    nor the check's own args pass ``{steps}``, and trainguard is not asked to end the runs
    itself (``job.stop_after_steps``); or both at once."""
    if job_file.job.stop_after_steps:
        passed = "{steps}" in command_text or any("{steps}" in a for _, spec in job_file.enabled_checks()
                                                   for a in spec.args)
        return [("job.stop_after_steps", "is true (trainguard ends each run after the check's steps) but "
                 "the command passes {steps} to the script, which then stops by itself. Fix: remove one: "
                 "`stop_after_steps: true` or the {steps} placeholder")] if passed else []
    return [
        (
            f"{_check_key(job_file, name)}.steps",
            f"the check runs {spec.steps} steps but job.command has no {{steps}} "
            "placeholder, so trainguard cannot choose the run length. Fix: pass it to "
            "your script, e.g. add `--steps {steps}` to job.command, or, when the script has no "
            "option for its number of steps (it runs by epochs), add `stop_after_steps: true` under "
            "job: trainguard then ends each run after the check's steps (docs/any-script.md)",
        )
        for name, spec in job_file.enabled_checks()
        if "{steps}" not in command_text and not any("{steps}" in a for a in spec.args)
    ]


def resume_problems(facts: JobFacts, what: str) -> list[tuple[str, str]]:
    """What a check that resumes the job (``what``, e.g. ``checks.resume``) needs: resume args
    and a checkpoint directory."""
    problems = []
    if not facts.job_file.job.resume_args:
        problems.append(("job.resume_args", f"{what} needs to know how to resume the job. Fix: set "
                         'job.resume_args to the flags that make the script resume, e.g. "--resume"'))
    if not facts.checkpoints:
        problems.append(("job.command", f"{what} needs the job to write checkpoints where trainguard "
                         "can find them. Fix: pass {checkpoint_dir} to the script, e.g. `--ckpt-dir "
                         "{checkpoint_dir}` in job.command or `CKPT_DIR: \"{checkpoint_dir}\"` in job.env"))
    return problems


def metric_problems(facts: JobFacts, key: str, name: str | None) -> list[tuple[str, str]]:
    """``key`` names a metric (``name``) that job.metrics lacks."""
    metrics = facts.job_file.job.metrics
    if name is None or name in metrics:
        return []
    return [(key, f"{name!r} is not one of job.metrics (it has: {', '.join(metrics)}). "
             f"Fix: add a `{name}` regex to job.metrics or name one of those")]


def one_process_problems(facts: JobFacts, asks: list[tuple[str, int]]) -> list[tuple[str, str]]:
    """``distributed_env: false`` launches one plain process: each ``(key, ranks)`` that asks
    for more ranks is a problem."""
    if facts.job_file.job.distributed_env:
        return []
    fix = ("a job launched without the distributed environment (job.distributed_env: false) "
           "runs as one process")
    return [(key, f"{fix}, but this asks for {n} ranks. Fix: use 1 (and remove checks.parallel), "
             "or drop `distributed_env: false` if the script can run under torchrun")
            for key, n in asks if n > 1]


def _counted_resume_problem(source: MetricRegex) -> str:
    """Why ``step: count`` and ``job.resume_args`` cannot go together, and the alternatives."""
    given = "step: count" if source.step == "count" else "no step group (so `step: count`)"
    return (f"{given} numbers a rank's matching lines from 1 in every launch, but job.resume_args "
            "is set: a resumed run (smoke's and resume's resume, a drill's restart) continues at "
            "step k + 1 and would be counted from 1 again, so it could never match the "
            "uninterrupted run. Fix: read the step from the line (a `(?P<step>\\d+)` group, or "
            "`step: <group>` naming the group that holds it), use a source that carries the step "
            "(`{file: metrics.jsonl}` or `{trainer: huggingface}`), or remove job.resume_args "
            "(and the checks that resume)")


def _check_key(job_file: JobFile, name: str) -> str:
    """``checks.resume`` for a check, ``checks.drills[2]`` for the drill ``drill:<name>``."""
    check_id = CheckId.parse(name)
    if check_id.is_drill:
        for i, drill in enumerate(job_file.checks.drills):
            if drill.name == check_id.drill:
                return f"checks.drills[{i}]"
    return f"checks.{name}"

def drill_problems(job_file: JobFile, command_text: str, env_text: str) -> list[tuple[str, str]]:
    """Unique names, ranks that exist, what recover/fail_clean need, each fault's parameters.

    ``command_text`` and ``env_text`` are the job's command (with its resume args) and env values
    joined by spaces, where the placeholders a drill needs are looked for."""
    job = job_file.job
    backend = backend_for(job.kind)
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
        if drill.expectation in ("recover", "fail_clean", "save_and_exit"):
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
        unavailable = cls.unavailable_for(backend)
        if unavailable is not None:  # the drill could only be skipped
            problems.append((f"{key}.fault", f"{unavailable} (job.kind: {job.kind})"))
        try:
            found = cls.validate(drill.fault_params)
        except Exception as exc:  # a fault's own rules tripped over a value: still a clear error
            found = [("", f"could not be checked ({type(exc).__name__}: {str(exc)[:200]}); see the "
                      f"{drill.fault} fault's parameters in the docs")]
        if not found:  # e.g. a soak's schedule: ranks that exist, a fault per seed
            found = cls.plan_problems(drill.fault_params, drill.steps, world_size)
        for param, message in found:
            problems.append((f"{key}.params{'.' + param if param else ''}", message))
    return problems


def profile_problems(job_file: JobFile, spec: ProfileCheck, used: set[str]) -> list[tuple[str, str]]:
    """What ``checks.profile`` needs: known metric names and a way to count samples.

    ``used`` names the placeholders the job's command uses (``batch_size`` matters here)."""
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
