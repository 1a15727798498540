"""trainguard's settings: one table, three spellings, one precedence.

Each setting ``name`` is the flag ``--trainguard-name`` (dashes), the ini key ``trainguard_name``
and the environment variable ``TRAINGUARD_<NAME>``. Precedence: command line > environment > ini
file > default. The pytest plugin and the CLI both resolve settings through :func:`resolve`, and
docs/markers-and-options.md is generated from :data:`OPTIONS` (tests check it is up to date).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from trainguard._internal.readers import ReadLimits
from trainguard.errors import ConfigError

__all__ = ["OPTIONS", "Option", "Settings", "get_option", "options_table", "read_limits", "resolve"]

#: the largest count a setting takes (``keep_runs``)
MAX_COUNT = 1_000_000
#: the longest time a setting gives in seconds (a week, as a job file's timeouts)
MAX_SECONDS = 7 * 24 * 3600.0
#: the largest ``timeout_scale``
MAX_TIMEOUT_SCALE = 1000.0

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def _parse_bool(text: str) -> bool:
    low = text.strip().lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise ValueError("expected one of 1/0, true/false, yes/no, on/off")


def _integer(text: str, low: int, high: int, words: str) -> int:
    """``text`` as an integer in [low, high]; ``ValueError`` saying ``words`` otherwise (int()'s
    own message would repeat the whole text, maybe thousands of digits)."""
    try:
        value = int(text.strip())
    except ValueError:
        raise ValueError(f"expected {words}") from None
    if not low <= value <= high:
        raise ValueError(f"expected {words}")
    return value


def _parse_seed(text: str) -> int:
    return _integer(text, 0, 2**32 - 1, "an integer between 0 and 2**32-1 (as job.seed)")


def _parse_positive_int(text: str) -> int:
    return _integer(text, 1, MAX_COUNT, f"an integer from 1 to {MAX_COUNT}")


def _positive_float(maximum: float) -> Callable[[str], float]:
    """A parser of a number > 0 and at most ``maximum`` (so never NaN or infinite: a timeout of
    1e300 s overflows every wait it reaches)."""

    def parse(text: str) -> float:
        try:
            value = float(text.strip())
        except ValueError:
            value = math.nan
        if not 0 < value <= maximum:  # NaN fails both comparisons
            raise ValueError(f"expected a number > 0 and at most {maximum:g}")
        return value

    return parse


def _parse_tracking(text: str) -> str:
    low = text.strip().lower()
    if low in ("on", "off", "auto"):
        return low
    if low in _TRUE:
        return "on"
    if low in _FALSE:
        return "off"
    raise ValueError("expected on, off or auto")


def _parse_path(text: str) -> Path | None:
    if "\0" in text:
        raise ValueError("a path cannot hold a NUL byte")
    if not text.strip():
        return None
    try:
        return Path(text).expanduser()
    except RuntimeError:  # ~nosuchuser, or ~ without a HOME
        raise ValueError(f"cannot expand {text.split('/')[0]!r}: no such user's home directory; "
                         "write the path in full") from None


def _parse_log_mb(text: str) -> float:
    try:
        value = float(text.strip())
    except ValueError:
        value = -1.0
    if not 0 <= value <= 1_000_000:  # NaN fails too
        raise ValueError("expected a number of MB from 0 (no cap) to 1000000")
    return value


@dataclass(frozen=True)
class Option:
    """One setting. ``help`` is the single text used by the flag, the ini key and the docs."""

    name: str
    help: str
    default: Any
    parse: Callable[[str], Any]
    metavar: str = "VALUE"

    @property
    def flag(self) -> str:
        """The command-line flag, ``--trainguard-<name>`` (dashes)."""
        return "--trainguard-" + self.name.replace("_", "-")

    @property
    def ini(self) -> str:
        """The ini-file key, ``trainguard_<name>``."""
        return "trainguard_" + self.name

    @property
    def env(self) -> str:
        """The environment variable, ``TRAINGUARD_<NAME>``."""
        return "TRAINGUARD_" + self.name.upper()

    def spelling(self, source: str) -> str:
        """How the value from ``source`` (a :attr:`Settings.sources` value: ``command line``,
        ``environment``, ``ini file``) was written: the flag, the variable or the ini key."""
        return {"command line": self.flag, "environment": self.env, "ini file": self.ini}.get(source, self.flag)


OPTIONS: tuple[Option, ...] = (
    Option(
        "seed",
        "Seed for @pytest.mark.seeded tests without an explicit seed, the tg_seed fixture and "
        "the {seed} of job runs.",
        0,
        _parse_seed,
        "N",
    ),
    Option(
        "soak_seed",
        "Seed of every chaos soak's fault schedule (`fault: soak` drills), instead of each "
        "drill's params.seed: the same seed replays the same faults (kind, rank, step).",
        None,
        _parse_seed,
        "N",
    ),
    Option(
        "deterministic",
        "Run @pytest.mark.seeded tests and tg_seed in deterministic mode "
        "(torch.use_deterministic_algorithms, cuDNN and cuBLAS settings).",
        False,
        _parse_bool,
        "BOOL",
    ),
    Option(
        "collect_yaml",
        "Collect trainguard.yaml and *.trainguard.yaml files as test items (one per check).",
        True,
        _parse_bool,
        "BOOL",
    ),
    Option(
        "report_json",
        "Write the session's trainguard report (JSON) to this path.",
        None,
        _parse_path,
        "PATH",
    ),
    Option(
        "keep_runs",
        "Run directories kept under .trainguard/runs/ per job; older ones are deleted.",
        20,
        _parse_positive_int,
        "N",
    ),
    Option(
        "rank_log_mb",
        "The most each rank's stdout and stderr log file in a run directory keeps, in MB: "
        "the first and the last half; the bytes between are dropped behind a marker line and "
        "counted in the report (logs_truncated). Metric parsing still sees every line. 0: no cap.",
        64.0,
        _parse_log_mb,
        "MB",
    ),
    Option(
        "ddp_timeout",
        "Seconds a @pytest.mark.ddp test may run on its ranks before their stacks are dumped "
        "and they are torn down.",
        120.0,
        _positive_float(MAX_SECONDS),
        "SECONDS",
    ),
    Option(
        "timeout_scale",
        "Multiply every job timeout and stall timeout by this factor (slow CI machines).",
        1.0,
        _positive_float(MAX_TIMEOUT_SCALE),
        "FACTOR",
    ),
    Option(
        "tracking",
        "Log every run trainguard launches to MLflow: on, off, or auto (on when mlflow is "
        "installed). The store is MLFLOW_TRACKING_URI when set, else .trainguard/mlflow.db next "
        "to the job file.",
        "auto",
        _parse_tracking,
        "on|off|auto",
    ),
    Option(
        "read_max_mb",
        "The largest file trainguard reads of those it did not write (checkpoints, Trainer "
        "state, logs, records), in MB; a larger one is reported as 'skipped: over the limit' and "
        "a comparison that skipped it is never equal (docs/security.md).",
        4096.0,
        _positive_float(1_000_000.0),
        "MB",
    ),
    Option(
        "read_max_files",
        "The most entries trainguard lists in one directory it reads (a checkpoint); a larger "
        "directory is reported as 'skipped: over the limit' (docs/security.md).",
        10_000,
        _parse_positive_int,
        "N",
    ),
    Option(
        "read_timeout",
        "Seconds one read of a file or checkpoint trainguard did not write may take; a longer "
        "one stops and is reported as 'skipped: over the limit' (docs/security.md).",
        120.0,
        _positive_float(MAX_SECONDS),
        "SECONDS",
    ),
    Option(
        "save_baseline",
        "Save the canary's trajectory as this machine's new baseline (docs/baselines.md) "
        "instead of comparing it with the saved one; only a run that passes is saved.",
        False,
        _parse_bool,
        "BOOL",
    ),
)

_BY_NAME = {opt.name: opt for opt in OPTIONS}


@dataclass(frozen=True)
class Settings:
    """Resolved settings; ``sources`` records where each value came from."""

    seed: int = 0
    soak_seed: int | None = None
    deterministic: bool = False
    collect_yaml: bool = True
    report_json: Path | None = None
    keep_runs: int = 20
    rank_log_mb: float = 64.0
    ddp_timeout: float = 120.0
    timeout_scale: float = 1.0
    tracking: str = "auto"
    read_max_mb: float = 4096.0
    read_max_files: int = 10_000
    read_timeout: float = 120.0
    save_baseline: bool = False
    sources: Mapping[str, str] = field(default_factory=dict, compare=False)


#: a setting as the command line or the ini file gives it: text, a value the flag's parser already
#: typed, a list of lines (an ini key), None when not given
RawSetting = str | int | float | bool | Sequence[str] | None


def resolve(
    *,
    cli: Mapping[str, RawSetting] | None = None,
    ini: Mapping[str, RawSetting] | None = None,
    environ: Mapping[str, str] | None = None,
) -> Settings:
    """Resolve every option: CLI > environment > ini > default.

    ``cli`` and ``ini`` map option names to raw values (None = not given); CLI values may
    already be typed. Invalid values raise :class:`ConfigError` naming where the value came from.
    """
    cli = cli or {}
    ini = ini or {}
    environ = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for opt in OPTIONS:
        candidates = (
            ("command line", opt.flag, cli.get(opt.name)),
            ("environment", opt.env, environ.get(opt.env)),
            ("ini file", opt.ini, ini.get(opt.name)),
        )
        for source, spelled, raw in candidates:
            if raw is None or (isinstance(raw, (list, tuple)) and not raw):
                continue
            if source == "environment" and isinstance(raw, str) and not raw.strip():
                continue  # VAR= (empty) reads as unset, as most tools treat it
            values[opt.name] = _parse(opt, raw, source, spelled)
            sources[opt.name] = source
            break
        else:
            values[opt.name] = opt.default
            sources[opt.name] = "default"
    return Settings(**values, sources=sources)


def _parse(opt: Option, raw: RawSetting, source: str, spelled: str) -> Any:
    if not isinstance(raw, str):
        raw = str(raw)
    try:
        return opt.parse(raw)
    except ValueError as exc:
        raise ConfigError(
            f"invalid value {_shown(raw)} for {spelled} (from the {source}): {exc}. "
            f"Fix the {source} value; the default is {opt.default!r}",
            key=spelled,
        ) from None


def _shown(text: str, limit: int = 80) -> str:
    """``text`` as a message repeats it: quoted, cut to ``limit`` characters."""
    return repr(text) if len(text) <= limit else repr(text[:limit]) + f"... ({len(text)} characters)"


def read_limits(settings: Settings) -> ReadLimits:
    """The limits on reading files trainguard did not write, from ``read_max_mb``,
    ``read_max_files`` and ``read_timeout``."""
    return ReadLimits(int(settings.read_max_mb * 1024 * 1024), settings.read_max_files, settings.read_timeout)


def get_option(name: str) -> Option:
    """The :class:`Option` called ``name``."""
    return _BY_NAME[name]


def options_table() -> str:
    """Markdown table of every option (the reference in docs/markers-and-options.md)."""
    rows = [
        "| flag | ini key | env var | default | what it does |",
        "|---|---|---|---|---|",
    ]
    for opt in OPTIONS:
        rows.append(
            f"| `{opt.flag}` | `{opt.ini}` | `{opt.env}` | `{opt.default!r}` | {opt.help} |"
        )
    return "\n".join(rows)


assert {f.name for f in fields(Settings)} - {"sources"} == set(_BY_NAME), "Settings out of sync"
