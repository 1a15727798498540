"""Reading a job file: YAML without duplicate keys, then the schema, then the cross-checks.

:func:`load_config` reads a file (or the ``trainguard.yaml`` in a directory) and
:func:`parse_config` validates text; both raise one :class:`~trainguard.errors.ConfigError`
naming the file and every problem (:mod:`trainguard.config.problems`).
"""

from __future__ import annotations

import os
import stat
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

#: a job file is a page of YAML; a bigger file is a mistake (a log pasted in, the wrong file)
#: and would take seconds per megabyte to parse
MAX_FILE_BYTES = 1_000_000
#: values a document may hold once its aliases are expanded: nine levels of nine aliases fit in
#: 687 bytes and expand to 9**9, which no validator should walk
MAX_VALUES = 100_000


class _TooBig(Exception):
    pass


def _expanded_size(root: yaml.Node) -> int:
    """How many values ``root`` holds with every alias expanded, counted once per node (aliases
    share their node); raises :class:`_TooBig` past :data:`MAX_VALUES` or on an alias that
    contains itself."""
    sizes: dict[int, int] = {}
    active: set[int] = set()

    def size(node: yaml.Node) -> int:
        key = id(node)
        if key in sizes:
            return sizes[key]
        if key in active:
            raise _TooBig("an alias refers to a mapping or list that contains it (a recursive alias)")
        active.add(key)
        total = 1
        if isinstance(node, yaml.SequenceNode):
            children: list[yaml.Node] = list(node.value)
        elif isinstance(node, yaml.MappingNode):
            children = [n for pair in node.value for n in pair]
        else:
            children = []
        for child in children:
            total += size(child)
            if total > MAX_VALUES:
                raise _TooBig(f"it holds more than {MAX_VALUES:,} values once its aliases are expanded "
                              "(nested *aliases multiply); write the values out or use fewer aliases")
        active.discard(key)
        sizes[key] = total
        return total

    return size(root)


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


def _load_yaml(text: str) -> Any:
    """The one document in ``text``, built only after its size with aliases expanded is known
    to be bounded."""
    loader = _UniqueKeyLoader(text)
    try:
        node = loader.get_single_node()  # type: ignore[no-untyped-call]
        if node is None:
            return None
        _expanded_size(node)
        return loader.construct_document(node)  # type: ignore[no-untyped-call]
    finally:
        loader.dispose()  # type: ignore[no-untyped-call]


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
        info = target.stat()
        if not stat.S_ISREG(info.st_mode):
            raise ConfigError("not a regular file (a device, pipe or socket); pass the path of your "
                              "job file (e.g. trainguard.yaml)", path=str(target))
        if info.st_size > MAX_FILE_BYTES:
            raise ConfigError(f"the file is {info.st_size:,} bytes; a job file is at most "
                              f"{MAX_FILE_BYTES:,} (is this the right file?)", path=str(target))
        with open(target, encoding="utf-8") as handle:
            text = handle.read(MAX_FILE_BYTES + 1)
    except FileNotFoundError:
        raise ConfigError(
            "file not found; pass the path of your job file (e.g. trainguard.yaml)",
            path=str(target),
        ) from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"the file is not UTF-8 text (byte {exc.start}: {exc.reason}); save it as "
                          "UTF-8", path=str(target)) from None
    except OSError as exc:
        raise ConfigError(f"cannot read the file: {exc.strerror or exc}", path=str(target)) from None
    return parse_config(text, path=target)


def parse_config(text: str, *, path: str | os.PathLike[str] = "trainguard.yaml") -> JobFile:
    """Validate the text of a job file; ``path`` is used for messages and relative paths."""
    where = str(path)
    if len(text) > MAX_FILE_BYTES:
        raise ConfigError(f"the text is {len(text):,} characters; a job file is at most "
                          f"{MAX_FILE_BYTES:,} (is this the right file?)", path=where)
    if "\0" in text:
        raise ConfigError(f"the file holds a NUL byte at offset {text.index(chr(0))} (binary data?); a job "
                          "file is YAML text", path=where)
    try:
        data = _load_yaml(text)
    except _TooBig as exc:
        raise ConfigError(f"the YAML cannot be used: {exc}", path=where) from None
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

