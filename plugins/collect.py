"""Collecting job files as pytest items: one item per configured check (and one per fault drill,
``drill:<name>``, marked ``fault``), zero Python to write.

``trainguard.yaml`` and ``*.trainguard.yaml`` become a collector; each check becomes an item
carrying the check's marker (``pytest -m resume`` selects resume checks). A ``profile`` check
with a ``headroom:`` search also carries ``slow`` (its probes take minutes: ``-m "not slow"``
deselects it). Reference runs are shared between the checks of one job file within a pytest
process.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from trainguard.plugins.session import get_session

from trainguard.errors import CheckFailed, ConfigError

__all__ = ["CHECK_RESULT_PROPERTY", "CheckItem", "JobFileCollector"]

#: user_property carrying a check's result to the xdist controller (as JSON)
CHECK_RESULT_PROPERTY = "trainguard_check_result"

#: extra markers per check beyond the one named like it
_EXTRA_MARKERS = {"parallel": ("ddp",)}


class JobFileCollector(pytest.File):
    """A ``trainguard.yaml``: yields one :class:`CheckItem` per configured check."""

    def collect(self) -> Iterator[pytest.Item]:
        from trainguard.config import ProfileCheck, load_config
        from trainguard.config.preflight import preflight
        from trainguard.report import CheckId

        job_file = load_config(self.path)
        preflight(job_file)  # what a launch needs here (cwd, paths), as `trainguard validate`
        settings = get_session(self.config).settings
        for name, spec in job_file.enabled_checks():
            if getattr(spec, "fault", None) == "soak":  # one item per seed: a replay is one test
                from trainguard.faults.soak import soak_seeds

                for seed in soak_seeds(spec.params, settings.soak_seed):  # type: ignore[attr-defined]
                    item = CheckItem.from_parent(self, name=f"{name}[seed={seed}]", check_name=name,
                                                 soak_seed=seed)
                    item.add_marker(pytest.mark.fault("soak"))
                    yield item
                continue
            item = CheckItem.from_parent(self, name=name, check_name=name)
            if CheckId.parse(name).is_drill:  # a drill: `pytest -m fault` selects it
                item.add_marker(pytest.mark.fault(getattr(spec, "fault", "")))
                yield item
                continue
            item.add_marker(name)
            for extra in _EXTRA_MARKERS.get(name, ()):
                item.add_marker(extra)
            if isinstance(spec, ProfileCheck) and spec.headroom is not None:  # many probe runs
                item.add_marker("slow")
            yield item

    def repr_failure(self, excinfo: pytest.ExceptionInfo[BaseException]) -> Any:  # type: ignore[override]
        if isinstance(excinfo.value, ConfigError):
            return str(excinfo.value)
        return super().repr_failure(excinfo)


class CheckItem(pytest.Item):
    """One check of one job file."""

    def __init__(self, *, check_name: str, soak_seed: int | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.check_name = check_name
        self.soak_seed = soak_seed  # a soak drill's item: the seed it runs with

    def runtest(self) -> None:
        from trainguard.plugins.tracking import runner_for

        from trainguard.config import load_config
        from trainguard.session import run_check

        runner = runner_for(self.config, load_config(self.path))
        spec = dict(runner.job_file.enabled_checks())[self.check_name]
        if self.soak_seed is not None:
            spec = spec.model_copy(update={"params": {**spec.params, "seed": self.soak_seed, "seeds": None}})  # type: ignore[attr-defined]
        result = run_check(runner, self.check_name, spec)
        from dataclasses import asdict

        self.user_properties.append((CHECK_RESULT_PROPERTY, json.dumps(asdict(result), default=str)))
        if result.status == "skipped":
            pytest.skip(result.summary)
        if not result.ok:
            raise CheckFailed(_render(result), results=(result,))

    def repr_failure(self, excinfo: pytest.ExceptionInfo[BaseException], style: Any = None) -> Any:
        if isinstance(excinfo.value, (CheckFailed, ConfigError)):
            return str(excinfo.value)
        return super().repr_failure(excinfo, style=style)

    def reportinfo(self) -> tuple[Path, int | None, str]:
        return self.path, None, f"trainguard {self.check_name}: {self.path.name}"


def _render(result: Any) -> str:
    lines = [f"trainguard {result.name} {result.status}: {result.summary}"]
    for key, value in result.evidence.items():
        if value in (None, [], {}, ""):
            continue
        text = json.dumps(value, default=str) if not isinstance(value, str) else value
        if len(text) > 2000:
            text = text[:2000] + " ..."
        lines.append(f"  {key}: {text}")
    if result.reproduce:
        lines.append(f"  reproduce: {result.reproduce}")
    return "\n".join(lines)


def collect_job_file(file_path: Path, parent: pytest.Collector) -> JobFileCollector | None:
    """The ``pytest_collect_file`` implementation (the plugin calls it when collection is on)."""
    from trainguard.config import is_job_file_name

    if not is_job_file_name(file_path.name):
        return None
    if not get_session(parent.config).settings.collect_yaml:
        return None
    return JobFileCollector.from_parent(parent, path=file_path)
