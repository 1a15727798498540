"""Collecting job files as pytest items: one item per configured check (and one per fault drill,
``drill:<name>``, marked ``fault``; with a ``gate:`` section, the invariants check ``trainguard
gate`` adds), zero Python to write.

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

class JobFileCollector(pytest.File):
    """A ``trainguard.yaml``: yields one :class:`CheckItem` per configured check."""

    def collect(self) -> Iterator[pytest.Item]:
        from trainguard.config import load_config
        from trainguard.config.preflight import preflight
        from trainguard.config.registry import check_for

        job_file = load_config(self.path)
        preflight(job_file)  # what a launch needs here (cwd, paths), as `trainguard validate`
        settings = get_session(self.config).settings
        configured = dict(job_file.enabled_checks())
        for name, spec in _checks_of(job_file):
            check = check_for(name)
            variants = check.items(spec, settings.soak_seed) if check is not None and check.items else [("", spec)]
            for suffix, variant in variants:  # a soak: one item per seed (a replay is one test)
                item = CheckItem.from_parent(self, name=f"{name}{suffix}", check_name=name,
                                             spec=variant if suffix or name not in configured else None)
                for marker, args in (check.pytest_marks(variant) if check is not None else [(name, ())]):
                    _known_marker(self.config, marker)
                    item.add_marker(getattr(pytest.mark, marker)(*args))
                yield item

    def repr_failure(self, excinfo: pytest.ExceptionInfo[BaseException]) -> Any:  # type: ignore[override]
        if isinstance(excinfo.value, ConfigError):
            return str(excinfo.value)
        return super().repr_failure(excinfo)


def _checks_of(job_file: Any) -> list[tuple[str, Any]]:
    """The checks a job file's items run: those it configures; with a ``gate:`` section, what
    ``trainguard gate`` runs (:func:`~trainguard.gate.policy.gate_checks_to_run`: the invariants
    check added where another check makes the run it reads), so the summary's gate verdict
    weighs the same checks."""
    if job_file.gate is None:
        return list(job_file.enabled_checks())
    from trainguard.gate.policy import gate_checks_to_run

    return list(gate_checks_to_run(job_file))


def _known_marker(config: pytest.Config, marker: str) -> None:
    """A check registered outside trainguard marks its items with its name: registered here, so
    ``--strict-markers`` accepts it and ``pytest -m <name>`` selects it."""
    if not any(line.split(":")[0].split("(")[0].strip() == marker for line in config.getini("markers")):
        config.addinivalue_line("markers", f"{marker}: the {marker} check of a job file")


class CheckItem(pytest.Item):
    """One check of one job file."""

    def __init__(self, *, check_name: str, spec: Any = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.check_name = check_name
        self.spec = spec  # one of several items of one spec (a soak's seed): its own spec

    def runtest(self) -> None:
        from trainguard.plugins.tracking import runner_for

        from trainguard.config import load_config
        from trainguard.session import run_check

        runner = runner_for(self.config, load_config(self.path))
        spec = self.spec if self.spec is not None else dict(runner.job_file.enabled_checks())[self.check_name]
        result = run_check(runner, self.check_name, spec)

        self.user_properties.append((CHECK_RESULT_PROPERTY, json.dumps(result.to_dict(), default=str)))
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
    for key, value in result.to_dict()["evidence"].items():  # what the report says, key by key
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
