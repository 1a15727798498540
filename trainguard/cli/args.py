"""Argument types of the ``trainguard`` command: each value checked where argparse reads it.

A bad value is argparse's usage error (exit 2) naming the option, the value (cut) and the valid
range -- never a traceback later, after work has started. The seed follows the job file's rule
for ``job.seed`` and the ``TRAINGUARD_SEED`` setting's (one parser:
:mod:`trainguard.config.settings`).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Sequence

__all__ = [
    "MAX_WAIT_S",
    "SEED_HELP",
    "dashdash_value",
    "metric_regex",
    "nonempty_path",
    "positive_int",
    "seconds",
    "seed",
    "text",
    "world_sizes",
    "written_path",
]

#: the help of every subcommand's ``--seed``
SEED_HELP = "seed for the runs, 0 to 2**32-1 as job.seed (default: TRAINGUARD_SEED or 0)"
#: the longest ``trainguard submit --wait`` (a day): waiting longer is a job for the queue's own UI
MAX_WAIT_S = 86400.0


def _shown(text: str, limit: int = 60) -> str:
    return repr(text) if len(text) <= limit else repr(text[:limit]) + f"... ({len(text)} characters)"


def dashdash_value(argv: Sequence[str]) -> str | None:
    """The usage error for an option written ``--opt=--`` in ``argv`` (before a lone ``--``),
    else None. argparse (3.11) strips the ``--`` and hands the option an empty list instead of a
    string, without calling its type: ``--only=--`` crashed the check it reached."""
    for token in argv:
        if token == "--":
            return None
        option, equals, value = token.partition("=")
        if option.startswith("-") and equals and value == "--":
            return (f"argument {option}: expected one argument ('{token}': '--' is read as the end "
                    "of the options, not as a value)")
    return None


def seed(text: str) -> int:
    """``--seed N``: an integer in [0, 2**32-1], the range of the job file's ``job.seed``."""
    from trainguard.config.settings import get_option

    try:
        return int(get_option("seed").parse(text))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"invalid seed {_shown(text)}: expected an integer between 0 and 4294967295 (2**32-1), "
            "the range of job.seed and TRAINGUARD_SEED"
        ) from None


def seconds(text: str) -> float:
    """A number of seconds: finite, >= 0 and at most :data:`MAX_WAIT_S`."""
    try:
        value = float(text.strip())
    except ValueError:
        value = math.nan
    if not 0 <= value <= MAX_WAIT_S:  # NaN fails both comparisons
        raise argparse.ArgumentTypeError(
            f"invalid number of seconds {_shown(text)}: expected a number from 0 to "
            f"{MAX_WAIT_S:g}, e.g. 30 (0: do not wait)"
        )
    return value


def positive_int(maximum: int | None = None) -> Callable[[str], int]:
    """An argument type: an integer >= 1 (and <= ``maximum`` when given)."""

    def parse(text: str) -> int:
        try:
            value = int(text.strip())
        except ValueError:
            value = 0
        if value < 1 or (maximum is not None and value > maximum):
            upper = f" and at most {maximum}" if maximum is not None else ""
            raise argparse.ArgumentTypeError(
                f"invalid value {_shown(text)}: expected an integer >= 1{upper}"
            )
        return value

    parse.__name__ = "positive integer"  # argparse names the type in some messages
    return parse


def metric_regex(value: str) -> str:
    """``--metric-regex RX``: a regular expression with the named groups ``step`` and ``value``
    (a metric line of a log); a bad pattern or a missing group is the usage error, saying how
    to write the groups."""
    from trainguard.config.values import check_regex

    try:
        return check_regex(value, count_hint=False)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


metric_regex.__name__ = "metric regex"


def nonempty_path(value: str) -> str:
    """A path argument: not empty and without a NUL byte (a file system can name neither). Bytes
    that are not UTF-8 are fine: Linux names files with any bytes."""
    if not value.strip():
        raise argparse.ArgumentTypeError("an empty path: name a file or directory")
    if "\0" in value:
        raise argparse.ArgumentTypeError(f"invalid value {_shown(value)}: it holds a NUL byte")
    return value


def written_path(value: str) -> str:
    """A path trainguard writes into a file it makes (``init``'s script and directory): a
    :func:`nonempty_path` that is also :func:`text`."""
    return text(nonempty_path(value))


def text(value: str) -> str:
    """A text argument trainguard writes into files: no NUL byte, and UTF-8 (a name made of
    bytes that are not UTF-8 reaches Python as lone surrogates, which no file can hold)."""
    if "\0" in value:
        raise argparse.ArgumentTypeError(f"invalid value {_shown(value)}: it holds a NUL byte")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise argparse.ArgumentTypeError(
            f"invalid value {ascii(value)[:80]}: not UTF-8 text; rename it with UTF-8 characters"
        ) from None
    return value


def world_sizes(value: str) -> list[int]:
    """``--world-sizes 1,2,4``: distinct world sizes, each from 1 to the most ranks a job may
    launch (``job.world_size``'s limit), sorted."""
    from trainguard._internal.limits import MAX_WORLD_SIZE

    try:
        sizes = sorted({int(v) for v in value.split(",") if v.strip()})
    except ValueError:
        sizes = []
    if not sizes or not 1 <= sizes[0] <= sizes[-1] <= MAX_WORLD_SIZE:
        raise argparse.ArgumentTypeError(
            f"invalid world sizes {_shown(value)}: expected integers from 1 to {MAX_WORLD_SIZE} "
            "separated by commas, e.g. 1,2,4"
        )
    return sizes


def only_names(values: Sequence[str] | None) -> list[str] | None:
    """``--only`` as given, repeated or comma-separated (``--only smoke,resume``)."""
    if not values:
        return None
    return [name.strip() for value in values for name in value.split(",") if name.strip()] or None
