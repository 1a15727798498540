"""A Ray Train function that reports what Ray Train's settings are in its worker
(tests/ray/test_ray_pace.py): each ``RAY_TRAIN_*`` variable of ``trainguard.raytrain.RAY_TRAIN_DEFAULTS``
as a number (NaN when unset). A worker's value comes from Ray Train's controller (which hands its
own to the workers it starts) or else from the head's environment, so it shows what the fit ran with.
"""

from __future__ import annotations

import math
import os
from typing import Any

import ray.train

KEYS = {"interval": "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "preemption_watcher": "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"}


def train_func(config: dict[str, Any]) -> None:
    for step in range(1, int(config.get("steps", 1)) + 1):
        values = {name: float(os.environ.get(key, math.nan)) for name, key in KEYS.items()}
        ray.train.report({"step": step, **values})
