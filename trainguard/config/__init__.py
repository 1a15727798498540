"""The job file: its schema, loading it and reporting what is wrong with it (docs/config.md).

The sections' models are in :mod:`~trainguard.config.schema` (``job:``, ``target:`` and the
loaded :class:`JobFile`), :mod:`~trainguard.config.checks` (``checks:``) and
:mod:`~trainguard.config.gate` (``gate:``), all on one base, :class:`ConfigModel`;
:mod:`~trainguard.config.loading` reads a file and :mod:`~trainguard.config.problems` words
what is wrong with it. Settings (flags, ini keys, environment) are in
:mod:`~trainguard.config.settings`. The registries whose names the schema accepts (each a
:class:`~trainguard._internal.registry.Registry`): checks in :mod:`~trainguard.config.registry`,
fault kinds and expectations in :mod:`~trainguard.config.faults`, job kinds in
:mod:`~trainguard.config.backends`, queues in :mod:`~trainguard.config.queues`.
"""

from __future__ import annotations

from trainguard._internal.model import ConfigModel
from trainguard.config.checks import (
    CanaryCheck,
    Checks,
    CheckSpec,
    DeterminismCheck,
    DrillSpec,
    HeadroomSearch,
    ParallelCheck,
    ProfileCheck,
    ReshardCheck,
    ResumeCheck,
    SmokeCheck,
)
from trainguard.config.gate import GatePolicy, OnMissing, Thresholds, gate_checks
from trainguard.config.loading import JOB_FILE_NAMES, is_job_file_name, load_config, parse_config
from trainguard.config.problems import (
    config_error,
    drill_problems,
    format_validation_error,
    profile_problems,
)
from trainguard.config.schema import (
    PLACEHOLDERS,
    Job,
    JobFile,
    JobKind,
    MetricFile,
    MetricRegex,
    MetricTrainer,
    Target,
    render_placeholders,
)

__all__ = [
    "JOB_FILE_NAMES",
    "PLACEHOLDERS",
    "CanaryCheck",
    "CheckSpec",
    "Checks",
    "ConfigModel",
    "DeterminismCheck",
    "DrillSpec",
    "GatePolicy",
    "HeadroomSearch",
    "Job",
    "JobFile",
    "JobKind",
    "MetricFile",
    "MetricRegex",
    "MetricTrainer",
    "OnMissing",
    "ParallelCheck",
    "ProfileCheck",
    "ReshardCheck",
    "ResumeCheck",
    "SmokeCheck",
    "Target",
    "Thresholds",
    "config_error",
    "drill_problems",
    "format_validation_error",
    "gate_checks",
    "is_job_file_name",
    "load_config",
    "parse_config",
    "profile_problems",
    "render_placeholders",
]
