"""trainguard: test ML training code before it spends days of GPU time.

``import trainguard`` is cheap: it never imports torch, ray or mlflow. The names below are
resolved on first use, so the pytest plugin (which imports this package) keeps pytest's start-up
fast and torch-free.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from trainguard._version import __version__
from trainguard.errors import (
    CheckFailed,
    ConfigError,
    RankFailure,
    TrainguardAssertionError,
    TrainguardError,
    UsageError,
)

# public name -> module that defines it (imported lazily)
_LAZY: dict[str, str] = {
    # seeding
    "seed_everything": "trainguard.unit.seeding",
    "deterministic_mode": "trainguard.unit.seeding",
    "seed_worker": "trainguard.unit.seeding",
    "make_generator": "trainguard.unit.seeding",
    # unit assertions
    "assert_finite": "trainguard.unit.outputs",
    "assert_tensor_meta": "trainguard.unit.outputs",
    "assert_grads_flow": "trainguard.unit.gradients",
    "assert_loss_connected": "trainguard.unit.gradients",
    "assert_batch_independent": "trainguard.unit.batches",
    "assert_can_overfit": "trainguard.unit.training",
    "assert_step_updates": "trainguard.unit.training",
    "assert_equivalent": "trainguard.unit.equivalence",
    # distributed (in-process ranks) and the training-state round trip
    "ddp_gradient_diff": "trainguard.unit.ddp",
    "assert_ddp_gradients_match": "trainguard.unit.ddp",
    "assert_state_roundtrip": "trainguard.unit.roundtrip",
    # job file and report
    "load_config": "trainguard.config",
    "JobFile": "trainguard.config",
    "Report": "trainguard.report",
    "CheckResult": "trainguard.report",
}

__all__ = [
    "CheckFailed",
    "CheckResult",
    "ConfigError",
    "JobFile",
    "RankFailure",
    "Report",
    "TrainguardAssertionError",
    "TrainguardError",
    "UsageError",
    "__version__",
    "assert_batch_independent",
    "assert_can_overfit",
    "assert_ddp_gradients_match",
    "assert_equivalent",
    "assert_finite",
    "assert_grads_flow",
    "assert_loss_connected",
    "assert_state_roundtrip",
    "assert_step_updates",
    "assert_tensor_meta",
    "ddp_gradient_diff",
    "deterministic_mode",
    "load_config",
    "make_generator",
    "seed_everything",
    "seed_worker",
    "track",
]


def __getattr__(name: str) -> Any:
    if name == "track":  # the training-loop helper module (trainguard.tracking.track.log(...))
        return importlib.import_module("trainguard.tracking.track")
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'trainguard' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY) | {"track"})


if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    from trainguard import track
    from trainguard.config import JobFile, load_config
    from trainguard.report import CheckResult, Report
    from trainguard.unit.batches import assert_batch_independent
    from trainguard.unit.ddp import assert_ddp_gradients_match, ddp_gradient_diff
    from trainguard.unit.equivalence import assert_equivalent
    from trainguard.unit.gradients import assert_grads_flow, assert_loss_connected
    from trainguard.unit.outputs import assert_finite, assert_tensor_meta
    from trainguard.unit.roundtrip import assert_state_roundtrip
    from trainguard.unit.seeding import (
        deterministic_mode,
        make_generator,
        seed_everything,
        seed_worker,
    )
    from trainguard.unit.training import assert_can_overfit, assert_step_updates
