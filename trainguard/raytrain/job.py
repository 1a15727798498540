"""The ``ray_train`` job kind: its job-file keys and the driver command it becomes.

A ``ray_train`` job names the user's function instead of a command::

    job:
      name: digits-ray
      kind: ray_train
      train_func: "ray_digits:train_func"      # module:function, importable from job.cwd
      config: {steps: "{steps}", seed: "{seed}", lr: 0.01}
      scaling: {num_workers: 2, use_gpu: false, resources_per_worker: {CPU: 1}}
      metrics: [loss]                           # keys of the dicts passed to ray.train.report

trainguard runs it as one launched process, :mod:`trainguard.raytrain.driver`, with
``num_workers`` = the check's world size and the storage path = the run's checkpoint directory
(so a resume is a new fit with the same ``RunConfig(name, storage_path)``, which is how Ray Train
V2 resumes); ``job.max_restarts`` becomes ``FailureConfig(max_failures=...)``.
"""

from __future__ import annotations

import json
import math
import re
import string
from collections.abc import Mapping
from typing import Any

from pydantic import Field

from trainguard._internal.limits import MAX_WORLD_SIZE, brief
from trainguard._internal.model import ConfigModel

__all__ = ["RAY_KEYS", "RayScaling", "expand_ray_job", "render_config"]

#: job keys that only a ``ray_train`` job has
RAY_KEYS = ("train_func", "config", "scaling")
_TRAIN_FUNC = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")


class RayScaling(ConfigModel):
    """``job.scaling`` of a ``ray_train`` job: Ray Train's ``ScalingConfig``."""

    num_workers: int = Field(1, ge=1, le=MAX_WORLD_SIZE)
    use_gpu: bool = False
    resources_per_worker: dict[str, float] | None = None


def _render(value: Any, values: Mapping[str, str | int]) -> Any:
    if isinstance(value, str):
        parsed = list(string.Formatter().parse(value))
        # exactly "{name}": the typed value (steps stays an int in train_loop_config)
        if len(parsed) == 1 and parsed[0][0] == "" and parsed[0][1] and not parsed[0][2] and not parsed[0][3]:
            return values[parsed[0][1]]
        return value.format_map(dict(values))
    if isinstance(value, Mapping):
        return {k: _render(v, values) for k, v in value.items()}
    if isinstance(value, list):
        return [_render(v, values) for v in value]
    return value


def render_config(config: Mapping[str, Any], values: Mapping[str, str | int]) -> dict[str, Any]:
    """``job.config`` with placeholders filled: a string that is exactly one placeholder takes the
    value's type (``"{steps}"`` -> 40), others are formatted as text."""
    return {k: _render(v, values) for k, v in config.items()}


def _placeholder_problems(value: Any, key: str, known: tuple[str, ...]) -> list[str]:
    if isinstance(value, str):
        if "\0" in value:
            return [f"{key}: {brief(value)} holds a NUL byte (\\0), which no command-line argument "
                    "can carry; remove it"]
        try:
            fields = [(f, spec, conv) for _, f, spec, conv in string.Formatter().parse(value) if f is not None]
        except ValueError as exc:
            return [f"{key}: {brief(value)}: {exc}; write a literal brace as {{{{ or }}}}"]
        problems = []
        for name, spec, conv in fields:
            if spec or conv:
                problems.append(f"{key}: {{{name}{'!' + conv if conv else ''}{':' + spec if spec else ''}}} in "
                                f"{brief(value)}: placeholders take no format spec or conversion; "
                                f"write {{{name}}}")
            elif name not in known:
                problems.append(f"{key}: unknown placeholder {{{name if len(name) <= 40 and name.isprintable() else brief(name, 40)}}} in {brief(value)}; known: "
                                + ", ".join(f"{{{k}}}" for k in known))
        return problems
    if isinstance(value, Mapping):
        return [p for k, v in value.items() for p in _placeholder_problems(v, f"{key}.{k}", known)]
    if isinstance(value, list):
        return [p for i, v in enumerate(value) for p in _placeholder_problems(v, f"{key}[{i}]", known)]
    return []


def _json_problems(value: Any, key: str) -> list[str]:
    """What in ``job.config`` cannot travel to the workers as JSON: dates, binary, sets, non-text
    keys, NaN and infinities (YAML reads `2024-01-01` as a date and `!!binary` as bytes)."""
    if isinstance(value, bool) or value is None or isinstance(value, (str, int)):
        return []
    if isinstance(value, float):
        return [] if math.isfinite(value) else [
            f"{key}: {value!r} is not a number JSON can carry to the workers; write a finite number "
            "or quote it as text"]
    if isinstance(value, Mapping):
        out = []
        for k, v in value.items():
            if not isinstance(k, str):
                out.append(f"{key}: key {brief(k, 40)} ({type(k).__name__}) must be text; quote it")
                continue
            out += _json_problems(v, f"{key}.{k}")
        return out
    if isinstance(value, list):
        return [p for i, v in enumerate(value) for p in _json_problems(v, f"{key}[{i}]")]
    return [f"{key}: {brief(value, 40)} is a {type(value).__name__}, which cannot travel to the workers as "
            "JSON; quote it as text (e.g. \"2024-01-01\") or write a number, list or mapping"]


def expand_ray_job(data: Mapping[str, Any], placeholders: tuple[str, ...]) -> dict[str, Any]:
    """A ``kind: ray_train`` job mapping rewritten as the command job trainguard launches: the
    driver with the job's function, config, scaling and failure budget; ``world_size`` from
    ``scaling.num_workers``; ``metrics: [loss, ...]`` (names of reported keys) as report-line
    regexes. Raises ValueError naming the key and the fix."""
    from trainguard.raytrain import metric_regex

    problems: list[str] = []
    for key in ("command", "resume_args", "world_size"):
        if key in data:
            problems.append(f"job.{key}: a ray_train job has no {key} (trainguard runs the function "
                            "with TorchTrainer; set scaling.num_workers for the workers); remove it")
    train_func = data.get("train_func")
    if not isinstance(train_func, str) or not _TRAIN_FUNC.match(train_func):
        problems.append(f"job.train_func: expected 'module:function' (importable from job.cwd), "
                        f"got {brief(train_func)}; e.g. `train_func: \"train:train_func\"`")
    config = data.get("config", {})
    if not isinstance(config, Mapping):
        problems.append(f"job.config: expected a mapping (Ray Train's train_loop_config), got {brief(config)}")
        config = {}
    problems += _json_problems(dict(config), "job.config")
    problems += _placeholder_problems(dict(config), "job.config", placeholders)
    try:
        scaling = RayScaling.model_validate(data.get("scaling") or {})
    except ValueError as exc:
        first = str(exc).splitlines()
        problems.append(f"job.scaling: {' '.join(first[1:3]).strip() or first[0]}; keys: num_workers, "
                        "use_gpu, resources_per_worker")
        scaling = RayScaling.model_validate({})
    metrics = data.get("metrics")
    if isinstance(metrics, list):
        if not all(isinstance(m, str) and m for m in metrics):
            problems.append(f"job.metrics: expected names of reported keys, got {brief(metrics)}")
        else:
            metrics = {m: metric_regex(m) for m in metrics}
    if problems:
        raise ValueError("; ".join(problems))
    out = {k: v for k, v in data.items() if k not in ("kind", *RAY_KEYS)}
    # the config travels as JSON inside one argument; its own placeholders are filled by the
    # driver (typed: "{steps}" stays an int), so its braces are escaped from the command's
    escaped = json.dumps(dict(config), sort_keys=True).replace("{", "{{").replace("}", "}}")
    out["command"] = [
        "python", "-m", "trainguard.raytrain.driver",
        "--train-func", str(train_func), "--config", escaped,
        "--steps", "{steps}", "--seed", "{seed}", "--num-workers", "{world_size}",
        "--storage-path", "{checkpoint_dir}", "--run-dir", "{run_dir}",
        "--name", str(data.get("name", "job")), "--max-failures", str(data.get("max_restarts", 0)),
    ]
    if "batch_size" in data:
        out["command"] += ["--batch-size", "{batch_size}"]
    if scaling.use_gpu:
        out["command"].append("--use-gpu")
    if scaling.resources_per_worker:
        out["command"] += ["--resources-per-worker",
                           json.dumps(scaling.resources_per_worker, sort_keys=True).replace("{", "{{").replace("}", "}}")]
    out["kind"] = "ray_train"
    out["resume_args"] = ["--resume"]
    out["world_size"] = scaling.num_workers
    if metrics is not None:
        out["metrics"] = metrics
    return out
