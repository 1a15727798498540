"""What a state file of ``.trainguard/`` (a canary baseline, a calibration) is keyed to, and how
its values are checked when it is read.

A baseline or a calibration measures one job: its command, its metrics, the job file it was
recorded for. Matching on the run's steps, seed, world size and args alone let a noisy job
file's calibration widen the tolerance of another job file beside it (``.trainguard/`` is shared
by every job file of a directory), so each file carries a :class:`JobKey` and a check uses only
files whose key is its job's. The values are data another program (or a person) may have
written: each number is checked finite and in range and each step inside the run it claims,
and a file that fails is refused with the key that is wrong, never trusted.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from trainguard.config import JobFile
    from trainguard.run.request import RunRequest

__all__ = [
    "LARGEST",
    "REQUEST_KEYS",
    "JobKey",
    "StoredRequest",
    "checked_count",
    "checked_numbers",
    "checked_steps",
    "checked_strings",
    "mapping_or_empty",
]

#: the largest magnitude a stored number may have: a band built from it (a few times it, plus
#: a mean) stays finite; 1e308 would make a band of ``inf`` that any run is inside
LARGEST = 1e300
#: the most steps a run of a state file may claim
MAX_STEPS = 10**12
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
#: the job's fields that change what its runs compute (the rest: other checks' settings)
_RUN_FIELDS = frozenset({"command", "cwd", "env", "metrics", "kind", "distributed_env"})


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def checked_count(value: Any, where: str, low: int, high: int) -> int:
    """``value`` as a whole number in ``[low, high]``; ValueError naming ``where`` otherwise."""
    if not _is_int(value) or not low <= value <= high:
        raise ValueError(f"{where} must be a whole number from {low} to {high}, not {_shown(value)}")
    return int(value)


def checked_strings(value: Any, where: str) -> list[str]:
    """``value`` as a list of strings."""
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{where} must be a list of strings, not {_shown(value)}")
    return list(value)


def checked_steps(value: Any, where: str, last: int) -> list[int]:
    """``value`` as step numbers of a run of ``last`` steps: at least one, whole, rising, each
    from 0 to ``last`` (a file whose values are on other steps than its run's is not of it)."""
    if not isinstance(value, list) or not value or len(value) > last + 1 or not all(_is_int(s) for s in value):
        raise ValueError(f"{where} must be a non-empty list of step numbers of the run's {last} steps")
    for before, step in zip([-1, *value], value):
        if not before < step <= last:
            raise ValueError(f"{where} holds step {_shown(step)} after step {before}: steps rise from 0 "
                             f"to the run's {last} steps")
    return list(value)


def checked_numbers(value: Any, where: str, size: int, *, non_negative: bool = False) -> list[float]:
    """``value`` as ``size`` finite numbers of magnitude at most :data:`LARGEST` (not below 0
    with ``non_negative``)."""
    if not isinstance(value, list) or len(value) != size:
        raise ValueError(f"{where} must be a list of {size} numbers")
    out = []
    for i, v in enumerate(value):
        number = _number(v)
        if number is None or (non_negative and number < 0):
            low = "0" if non_negative else f"-{LARGEST:g}"
            raise ValueError(f"{where}[{i}] is {_shown(v)}: each must be a finite number from {low} to {LARGEST:g}")
        out.append(number)
    return out


def _number(value: Any) -> float | None:
    """``value`` as a float when it is a finite number of magnitude at most :data:`LARGEST`."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if _is_int(value) and abs(value) > LARGEST:  # before float(): a huge integer overflows it
        return None
    number = float(value)
    return number if math.isfinite(number) and abs(number) <= LARGEST else None


#: the request fields two runs must share to be compared (env is stored for information)
REQUEST_KEYS = ("steps", "seed", "world_size", "args")


@dataclass(frozen=True)
class StoredRequest:
    """The request of a run as a state file stores it: steps, seed, world size and args (what
    a run compared with it must share), env for information."""

    steps: int
    seed: int
    world_size: int
    args: tuple[str, ...]
    env: dict[str, str]

    @classmethod
    def of(cls, request: RunRequest) -> StoredRequest:
        return cls(request.steps, request.seed, request.world_size, tuple(request.args), dict(request.env))

    @classmethod
    def from_dict(cls, value: Any, where: str = "request") -> StoredRequest:
        """The stored request, every value checked (ValueError naming the key)."""
        if not isinstance(value, dict):
            raise ValueError(f"{where} must be an object with steps, seed, world_size and args")
        env = value.get("env", {})
        if not isinstance(env, dict):
            raise ValueError(f"{where}.env must be an object")
        return cls(checked_count(value.get("steps"), f"{where}.steps", 1, MAX_STEPS),
                   checked_count(value.get("seed"), f"{where}.seed", 0, 2**32 - 1),
                   checked_count(value.get("world_size"), f"{where}.world_size", 1, 2**20),
                   tuple(checked_strings(value.get("args"), f"{where}.args")),
                   {str(k): str(v) for k, v in env.items()})

    def to_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "seed": self.seed, "world_size": self.world_size, "args": list(self.args),
                "env": dict(self.env)}

    def differences(self, other: StoredRequest) -> list[tuple[str, object, object]]:
        """(key, this value, the other's) of each compared field that differs, in :data:`REQUEST_KEYS` order."""
        pairs = [("steps", self.steps, other.steps), ("seed", self.seed, other.seed),
                 ("world_size", self.world_size, other.world_size), ("args", self.args, other.args)]
        return [(key, mine, theirs) for key, mine, theirs in pairs if mine != theirs]


def _shown(value: Any) -> str:
    text = repr(value) if not _is_int(value) or abs(value) < 10**30 else f"a {len(str(abs(value)))}-digit number"
    return text if len(text) <= 60 else text[:57] + "..."


@dataclass(frozen=True)
class JobKey:
    """The job a state file was recorded for: the job file's name (``.trainguard/`` sits beside
    it, so the name tells the job files sharing it apart, and stays the same in another
    checkout) and a SHA-256 of the job's fields that change what its runs compute (command,
    cwd, env, metrics, kind, distributed_env; not the checks' settings)."""

    file: str
    run_sha256: str
    #: shown in messages
    command: tuple[str, ...]
    metrics: tuple[str, ...]

    @classmethod
    def of(cls, job_file: JobFile) -> JobKey:
        """The key of ``job_file``."""
        fields = job_file.job.model_dump(mode="json", include=set(_RUN_FIELDS))
        text = json.dumps(fields, sort_keys=True, separators=(",", ":"))
        return cls(job_file.path.name, hashlib.sha256(text.encode()).hexdigest(),
                   tuple(job_file.job.command), tuple(job_file.job.metrics))

    def to_dict(self) -> dict[str, Any]:
        return {"file": self.file, "run_sha256": self.run_sha256, "command": list(self.command),
                "metrics": list(self.metrics)}

    @classmethod
    def from_dict(cls, value: Any, where: str = "job_key") -> JobKey:
        """A stored key, checked; ValueError naming the key otherwise."""
        if not isinstance(value, dict):
            raise ValueError(f"{where} is missing or not an object: the file does not say which job it was "
                             "recorded for")
        file, digest = value.get("file"), value.get("run_sha256")
        if not isinstance(file, str) or not 0 < len(file) <= 4096:
            raise ValueError(f"{where}.file must be the job file's name")
        if not isinstance(digest, str) or not _SHA256.match(digest):
            raise ValueError(f"{where}.run_sha256 must be 64 hex digits")
        return cls(file, digest, tuple(checked_strings(value.get("command"), f"{where}.command")),
                   tuple(checked_strings(value.get("metrics"), f"{where}.metrics")))

    def differences(self, other: JobKey) -> list[str]:
        """How this key differs from ``other`` (the run's), in words; empty when the same job."""
        if self.file != other.file:
            return [f"job file {_shown(self.file)} (this run: {other.file!r})"]
        if self.run_sha256 == other.run_sha256:
            return []
        out = [f"job.command {_command(self.command)} (this run: {_command(other.command)})"
               if self.command != other.command else "",
               f"job.metrics {', '.join(self.metrics)} (this run: {', '.join(other.metrics)})"
               if self.metrics != other.metrics else ""]
        return [d for d in out if d] or ["job.cwd, job.env, job.kind or the metrics' patterns (this run's differ)"]


def _command(argv: tuple[str, ...]) -> str:
    return _shown(" ".join(argv))


def mapping_or_empty(value: Any, where: str) -> Mapping[str, Any]:
    """``value`` when it is an object, {} when absent; ValueError otherwise."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValueError(f"{where} must be an object, not {_shown(value)}")
    return value
