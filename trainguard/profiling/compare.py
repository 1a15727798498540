"""Profile baselines and regression expressions (pytest-benchmark's model).

A profile is saved as versioned JSON per machine and commit::

    .trainguard/profile/baselines/<machine-id>/<NNNN>_<commit>[_dirty].json

(the same naming and atomic, never-overwriting write as the canary baselines of
:mod:`trainguard.checks.baseline`, whose machine-id and git helpers are reused). ``--compare``
expressions such as ``p50_step_time:+10%`` or ``throughput@2:-5%`` are parsed once by
:func:`parse_regressions` into :class:`RegressionCheck` objects, used by the CLI, the check
and pytest alike. The sign says which way is bad: ``+10%`` fails when the value grew by more
than 10 %, ``-5%`` when it fell by more than 5 %; without ``%`` the limit is absolute (in the
metric's unit). Without ``@N`` the check applies to every world size both profiles measured.
"""

from __future__ import annotations

import datetime
import difflib
import json
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainguard._internal.gitstate import git_state
from trainguard._internal.machine import machine_id, machine_info
from trainguard._version import __version__
from trainguard.checks.baseline import baseline_files
from trainguard.errors import TrainguardError

__all__ = [
    "METRICS",
    "PROFILE_FORMAT_VERSION",
    "ProfileBaselineError",
    "Regression",
    "RegressionCheck",
    "RegressionExpressionError",
    "compare_profiles",
    "latest_profile_baseline",
    "load_profile_baseline",
    "parse_regression",
    "parse_regressions",
    "profile_baselines_dir",
    "profile_metrics",
    "save_profile_baseline",
]

#: Version of the profile baseline format; files of another version are refused.
PROFILE_FORMAT_VERSION = 1
_KIND = "trainguard-profile"

#: metric name -> (unit, description) of what ``profile_metrics`` extracts per world size
METRICS: dict[str, tuple[str, str]] = {
    "p50_step_time": ("s", "median step time"),
    "p90_step_time": ("s", "90th percentile step time"),
    "p99_step_time": ("s", "99th percentile step time"),
    "mean_step_time": ("s", "mean step time"),
    "throughput": ("samples/s", "samples per second"),
    "startup": ("s", "launch to the first step"),
    "peak_rss": ("MB", "largest per-rank peak RSS"),
    "peak_gpu": ("MB", "largest per-rank peak GPU memory"),
    "checkpoint_time": ("s", "cost of one checkpoint write"),
    "efficiency": ("", "scaling efficiency"),
}

_EXPR = re.compile(
    r"^\s*(?P<metric>[A-Za-z_][A-Za-z0-9_]*)(?:@(?P<size>\d+))?\s*:\s*"
    r"(?P<sign>[+-])\s*(?P<number>\d+(?:\.\d*)?|\.\d+)\s*(?P<pct>%)?\s*$"
)


class RegressionExpressionError(TrainguardError):
    """A ``--compare`` expression cannot be parsed; the message shows the accepted form."""


class ProfileBaselineError(TrainguardError):
    """A profile baseline file cannot be read."""


@dataclass(frozen=True)
class RegressionCheck:
    """One parsed ``METRIC[@N]:(+|-)LIMIT[%]`` expression."""

    expression: str
    metric: str
    world_size: int | None
    direction: int  # +1: growth is bad; -1: a fall is bad
    limit: float  # a fraction (relative) or an absolute amount
    relative: bool

    def judge(self, baseline: float, current: float) -> tuple[bool, float]:
        """(regressed, change): change is relative (a fraction) or absolute like the limit."""
        delta = current - baseline
        if self.relative:
            change = delta / abs(baseline) if baseline else math.copysign(math.inf, delta) if delta else 0.0
        else:
            change = delta
        return change * self.direction > self.limit, change

    def describe_limit(self) -> str:
        sign = "+" if self.direction > 0 else "-"
        unit = "%" if self.relative else f" {METRICS[self.metric][0]}".rstrip()
        amount = self.limit * 100 if self.relative else self.limit
        return f"{sign}{amount:g}{unit}"


def parse_regression(expression: str) -> RegressionCheck:
    """Parse one expression; :class:`RegressionExpressionError` says what is wrong and the form."""
    form = (
        "expected METRIC[@RANKS]:(+|-)LIMIT[%], e.g. 'p50_step_time:+10%', 'throughput:-5%' or "
        "'throughput@2:-5%'"
    )
    if not isinstance(expression, str) or not expression.strip():
        raise RegressionExpressionError(f"empty --compare expression; {form}")
    match = _EXPR.match(expression)
    if match is None:
        hint = ""
        if ":" not in expression:
            hint = " (no ':' between the metric and the limit)"
        elif re.search(r":\s*\d", expression):
            hint = " (the limit needs a sign: + when growth is the regression, - when a fall is)"
        raise RegressionExpressionError(f"bad --compare expression {expression!r}{hint}; {form}")
    metric = match.group("metric")
    if metric not in METRICS:
        close = difflib.get_close_matches(metric, list(METRICS), n=1)
        did = f" (did you mean {close[0]!r}?)" if close else ""
        raise RegressionExpressionError(
            f"unknown metric {metric!r} in --compare expression {expression!r}{did}; "
            f"known: {', '.join(METRICS)}"
        )
    size = match.group("size")
    if size is not None and int(size) < 1:
        raise RegressionExpressionError(f"{expression!r}: @{size} is not a world size; use @1, @2, ...")
    relative = match.group("pct") is not None
    number = float(match.group("number"))
    return RegressionCheck(
        expression=expression.strip(),
        metric=metric,
        world_size=int(size) if size is not None else None,
        direction=1 if match.group("sign") == "+" else -1,
        limit=number / 100 if relative else number,
        relative=relative,
    )


def parse_regressions(expressions: Iterable[str]) -> list[RegressionCheck]:
    """Parse every expression, reporting all bad ones at once."""
    checks: list[RegressionCheck] = []
    problems: list[str] = []
    for expression in expressions:
        try:
            checks.append(parse_regression(expression))
        except RegressionExpressionError as exc:
            problems.append(str(exc))
    if problems:
        raise RegressionExpressionError("\n".join(problems))
    return checks


def profile_metrics(profile: Mapping[str, Any]) -> dict[int, dict[str, float]]:
    """world size -> {metric: value} of a profile's JSON form (see :data:`METRICS`)."""
    out: dict[int, dict[str, float]] = {}
    table = {int(k): v for k, v in (profile.get("scaling", {}).get("table") or {}).items()}
    for size in profile.get("sizes", []):
        n = int(size["world_size"])
        step = size.get("step")
        values: dict[str, float | None] = {}
        if step:
            values.update(
                p50_step_time=step["p50_s"], p90_step_time=step["p90_s"],
                p99_step_time=step["p99_s"], mean_step_time=step["mean_s"],
            )
        values["throughput"] = size.get("throughput_sps")
        values["startup"] = size.get("startup_s")
        rss = size.get("peak_rss_mb") or {}
        gpu = size.get("peak_gpu_mb") or {}
        values["peak_rss"] = max(rss.values()) if rss else None
        values["peak_gpu"] = max(gpu.values()) if gpu else None
        values["checkpoint_time"] = (size.get("checkpoint") or {}).get("cost_s")
        values["efficiency"] = table.get(n, {}).get("efficiency")
        out[n] = {k: float(v) for k, v in values.items() if v is not None}
    return out


@dataclass(frozen=True)
class Regression:
    """One compared value."""

    check: RegressionCheck
    world_size: int
    baseline: float | None
    current: float | None
    change: float | None
    regressed: bool

    def describe(self) -> str:
        c = self.check
        unit = METRICS[c.metric][0]
        if self.baseline is None or self.current is None:
            side = "the baseline" if self.baseline is None else "this profile"
            return f"{c.metric}@{self.world_size}: not compared ({side} has no value)"
        shown = f"{self.change:+.1%}" if c.relative else f"{self.change:+.4g} {unit}".rstrip()
        verdict = "REGRESSION" if self.regressed else "ok"
        return (
            f"{c.metric}@{self.world_size}: {self.baseline:.4g} -> {self.current:.4g} {unit} "
            f"({shown}, limit {c.describe_limit()}): {verdict}"
        ).replace("  ", " ")


def compare_profiles(
    baseline: Mapping[str, Any], current: Mapping[str, Any], checks: Sequence[RegressionCheck]
) -> list[Regression]:
    """Apply each check to every world size both profiles measured (or its ``@N`` one)."""
    base, cur = profile_metrics(baseline), profile_metrics(current)
    out: list[Regression] = []
    for check in checks:
        sizes = [check.world_size] if check.world_size is not None else sorted(set(base) & set(cur))
        for n in sizes:
            b = base.get(n, {}).get(check.metric)
            c = cur.get(n, {}).get(check.metric)
            if b is None or c is None:
                out.append(Regression(check, n, b, c, None, False))
                continue
            regressed, change = check.judge(b, c)
            out.append(Regression(check, n, b, c, change, regressed))
    return out


# --------------------------------------------------------------------------------------------
# storing profiles
# --------------------------------------------------------------------------------------------


def profile_baselines_dir(state_dir: Path, machine: str | None = None) -> Path:
    """``<state_dir>/profile/baselines/<machine-id>``."""
    return state_dir / "profile" / "baselines" / (machine or machine_id())


def save_profile_baseline(state_dir: Path, job_dir: Path, profile: Mapping[str, Any]) -> Path:
    """Store ``profile`` (its JSON form) as this machine's next baseline; returns the path."""
    from trainguard.checks.baseline import write_numbered

    directory = profile_baselines_dir(state_dir)
    directory.mkdir(parents=True, exist_ok=True)
    git = git_state(job_dir)
    commit, dirty = git.commit, git.dirty
    data = {
        "format_version": PROFILE_FORMAT_VERSION,
        "kind": _KIND,
        "trainguard_version": __version__,
        "created_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine_info": machine_info(),
        "commit_info": {"id": commit, "dirty": dirty, "directory": str(job_dir)},
        "profile": dict(profile),
    }
    payload = (json.dumps(data, indent=2, default=str) + "\n").encode()
    suffix = (commit[:12] if commit else "nogit") + ("_dirty" if dirty else "")
    return write_numbered(directory, suffix, payload)


def load_profile_baseline(path: str | Path) -> dict[str, Any]:
    """A saved profile baseline file (the whole document; its profile under ``profile``)."""
    from trainguard.checks.baseline import VersionedDocument, read_versioned_json

    return read_versioned_json(path, VersionedDocument(
        _KIND, PROFILE_FORMAT_VERSION, ProfileBaselineError, what="profile baseline",
        kind_name="trainguard profile baseline", version_label="profile",
        fix="save a new one with `trainguard profile CONFIG --save`"))


def latest_profile_baseline(state_dir: Path) -> dict[str, Any] | None:
    """The newest readable profile baseline of this machine (with ``path``), or None."""
    for path in reversed(baseline_files(profile_baselines_dir(state_dir))):
        try:
            data = load_profile_baseline(path)
        except ProfileBaselineError:
            continue
        data["path"] = str(path)
        return data
    return None
