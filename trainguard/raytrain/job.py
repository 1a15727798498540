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
import string
import sys
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["RayScaling", "driver_argv", "render_config"]


class RayScaling(BaseModel):
    """``job.scaling`` of a ``ray_train`` job: Ray Train's ``ScalingConfig``."""

    model_config = ConfigDict(extra="forbid", strict=True)

    num_workers: int = Field(1, ge=1)
    use_gpu: bool = False
    resources_per_worker: dict[str, float] | None = None


def _render(value: Any, values: Mapping[str, object]) -> Any:
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


def render_config(config: Mapping[str, Any], values: Mapping[str, object]) -> dict[str, Any]:
    """``job.config`` with placeholders filled: a string that is exactly one placeholder takes the
    value's type (``"{steps}"`` -> 40), others are formatted as text."""
    return {k: _render(v, values) for k, v in config.items()}


def driver_argv(
    *,
    train_func: str,
    config: Mapping[str, Any],
    scaling: RayScaling,
    num_workers: int,
    storage_path: str,
    name: str,
    max_failures: int,
) -> list[str]:
    """The driver's command line for one fit."""
    argv = [
        sys.executable, "-m", "trainguard.raytrain.driver",
        "--train-func", train_func,
        "--config", json.dumps(dict(config), sort_keys=True),
        "--num-workers", str(num_workers),
        "--storage-path", storage_path,
        "--name", name,
        "--max-failures", str(max_failures),
    ]
    if scaling.use_gpu:
        argv.append("--use-gpu")
    if scaling.resources_per_worker:
        argv += ["--resources-per-worker", json.dumps(scaling.resources_per_worker, sort_keys=True)]
    return argv
