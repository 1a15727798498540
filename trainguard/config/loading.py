"""Reading a job file: YAML without duplicate keys, then the schema, then the cross-checks.

:func:`load_config` reads a file (or the ``trainguard.yaml`` in a directory) and
:func:`parse_config` validates text; both raise one :class:`~trainguard.errors.ConfigError`
naming the file and every problem (:mod:`trainguard.config.problems`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from trainguard.config.problems import config_error, cross_checks, format_validation_error
from trainguard.config.schema import JobDocument, JobFile
from trainguard.errors import ConfigError

__all__ = ["JOB_FILE_NAMES", "is_job_file_name", "load_config", "parse_config"]

#: File names the pytest plugin collects and ``trainguard check`` looks for in a directory.
JOB_FILE_NAMES = ("trainguard.yaml", "trainguard.yml")


def is_job_file_name(name: str) -> bool:
    """True for ``trainguard.yaml``/``.yml`` and ``*.trainguard.yaml``/``.yml``."""
    return name in JOB_FILE_NAMES or name.endswith((".trainguard.yaml", ".trainguard.yml"))


_MERGE_TAG = "tag:yaml.org,2002:merge"


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate keys (PyYAML silently keeps the last one)."""


def _construct_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False) -> Any:
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        if key_node.tag == _MERGE_TAG:  # `<<: *defaults`: PyYAML merges it below; explicit keys win
            continue
        key = loader.construct_object(key_node, deep=deep)  # type: ignore[no-untyped-call]
        try:
            hash(key)
        except TypeError:
            raise yaml.constructor.ConstructorError(
                None, None, f"unhashable key {key!r}", key_node.start_mark
            ) from None
        if key in seen:
            raise yaml.constructor.ConstructorError(
                f"key {key!r} first defined on line {seen[key] + 1}",
                None,
                f"duplicate key {key!r}",
                key_node.start_mark,
            )
        seen[key] = key_node.start_mark.line
    return loader.construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor(
    yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG,
    _construct_mapping,  # type: ignore[arg-type]
)


def load_config(path: str | os.PathLike[str]) -> JobFile:
    """Load and validate a job file (or the ``trainguard.yaml`` inside a directory)."""
    target = Path(path)
    if target.is_dir():
        for name in JOB_FILE_NAMES:
            if (target / name).is_file():
                target = target / name
                break
        else:
            raise ConfigError(
                f"no {' or '.join(JOB_FILE_NAMES)} in this directory; create one with "
                "`trainguard init` or pass the file's path",
                path=str(target),
            )
    try:
        text = target.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(
            "file not found; pass the path of your job file (e.g. trainguard.yaml)",
            path=str(target),
        ) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read the file: {exc}", path=str(target)) from None
    return parse_config(text, path=target)


def parse_config(text: str, *, path: str | os.PathLike[str] = "trainguard.yaml") -> JobFile:
    """Validate the text of a job file; ``path`` is used for messages and relative paths."""
    where = str(path)
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc)
        context = getattr(exc, "context", None)
        if context and getattr(exc, "problem", None):
            problem = f"{problem} ({context})"
        raise ConfigError(f"invalid YAML{at}: {problem}", path=where) from None
    except (ValueError, OverflowError, RecursionError) as exc:  # e.g. absurd timestamps
        raise ConfigError(f"invalid YAML: {exc}", path=where) from None
    if data is None:
        raise ConfigError("the file is empty; it needs a `job:` section", path=where, key="job")
    if not isinstance(data, dict):
        raise ConfigError(
            f"expected a mapping with a `job:` key at the top level, got {type(data).__name__}",
            path=where,
        )
    try:
        doc = JobDocument.model_validate(data)
    except ValidationError as exc:
        problems = format_validation_error(exc)
        raise config_error(where, problems) from None
    job_file = JobFile(path=Path(path).resolve(), job=doc.job, checks=doc.checks, target=doc.target, gate=doc.gate)
    problems = cross_checks(job_file)
    if problems:
        raise config_error(where, problems)
    return job_file

