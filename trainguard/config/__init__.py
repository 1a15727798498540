"""The job file: its schema, loading it and reporting what is wrong with it (docs/config.md)."""

from __future__ import annotations

from trainguard.config.schema import (
    CHECK_NAMES,
    JOB_FILE_NAMES,
    PLACEHOLDERS,
    CanaryCheck,
    Checks,
    CheckSpec,
    DeterminismCheck,
    DrillSpec,
    HeadroomSearch,
    Job,
    JobFile,
    MetricFile,
    ParallelCheck,
    ProfileCheck,
    ResumeCheck,
    SmokeCheck,
    Target,
    is_job_file_name,
    load_config,
    parse_config,
)

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
