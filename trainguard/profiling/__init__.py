"""Throughput and scaling profiles and resource-sizing reports (docs/profiling.md).

``run_profile`` measures a job at several world sizes; ``trainguard.profiling.sizing`` turns a
profile and the job file's ``target:`` into a recommendation with a goodput forecast
(``trainguard.profiling.goodput``) and recommended timeouts; ``parse_regressions`` and
``compare_profiles`` judge a profile against this machine's saved baseline.

Names are imported on first use, so ``trainguard --help`` does not load numpy or matplotlib.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Profile": "profile",
    "run_profile": "profile",
    "profile_job": "check",
    "run_profile_check": "check",
    "Regression": "compare",
    "RegressionCheck": "compare",
    "RegressionExpressionError": "compare",
    "compare_profiles": "compare",
    "parse_regression": "compare",
    "parse_regressions": "compare",
    "FailureInputs": "goodput",
    "measured_recovery": "goodput",
    "Sizing": "sizing",
    "apply_failure_inputs": "sizing",
    "checkpoint_interval_s": "sizing",
    "predict_duration_s": "sizing",
    "size_run": "sizing",
    "ScalingFit": "stats",
    "fit_scaling": "stats",
    "phrase_scaling": "stats",
    "scaling_table": "stats",
    "step_stats": "stats",
    "recommend_timeouts": "timeouts",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'trainguard.profiling' has no attribute {name!r}")
    return getattr(importlib.import_module(f"trainguard.profiling.{module}"), name)
