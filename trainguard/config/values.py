"""Value coercions of the job file, with messages a person can act on.

A command is written as a string (split like a POSIX shell would) or a list of strings; env
values may be YAML scalars (``OMP_NUM_THREADS: 1``) and become strings; a metric regex must
compile and name the groups ``step`` and ``value``. :data:`Argv` and :data:`Env` are the
annotated types the section models use.
"""

from __future__ import annotations

import re
import shlex
from typing import Annotated, Any

from pydantic import BeforeValidator

from trainguard._internal.limits import brief

__all__ = ["Argv", "Env", "PathText", "Text", "check_regex", "compile_regex", "no_nul"]

def no_nul(value: str, what: str = "value") -> str:
    """``value`` unless it holds a NUL byte, which no path, argument or environment value can
    carry to the operating system."""
    if "\0" in value:
        raise ValueError(f"{brief(value)} holds a NUL byte (\\0), which no {what} can carry; remove it")
    return value


def _to_argv(value: Any) -> list[str]:
    """A command is a string (split like a POSIX shell would) or a list of strings."""
    if isinstance(value, str):
        no_nul(value, "command-line argument")
        try:
            return shlex.split(value)
        except ValueError as exc:  # unbalanced quotes
            raise ValueError(f"cannot split {brief(value)} like a shell would ({exc})") from None
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return [no_nul(v, "command-line argument") for v in value]
    if isinstance(value, list):
        bad = next(v for v in value if not isinstance(v, str))
        raise ValueError(
            f"expected a list of strings, but item {brief(bad)} is {type(bad).__name__}; quote it"
        )
    raise ValueError(
        f"expected a string or a list of strings, got {brief(value)} ({type(value).__name__})"
    )


def _to_env(value: Any) -> dict[str, str]:
    """Env values may be written as YAML scalars (``OMP_NUM_THREADS: 1``); they become strings."""
    if not isinstance(value, dict):
        raise ValueError(
            f"expected a mapping of variable name to value, got {brief(value)} ({type(value).__name__})"
        )
    out: dict[str, str] = {}
    for key, val in value.items():
        if not isinstance(key, str) or not key:
            raise ValueError(f"variable names must be non-empty strings, got {brief(key)}")
        if "=" in key or "\0" in key:
            raise ValueError(f"variable name {brief(key)} holds {'=' if '=' in key else 'a NUL byte'}, "
                             "which no environment variable name can; write `NAME: value`")
        if isinstance(val, bool):
            out[key] = "1" if val else "0"
        elif isinstance(val, str):
            out[key] = no_nul(val, f"environment value (of {_name(key)})")
        elif isinstance(val, int):
            out[key] = str(val) if abs(val) < 10 ** 4000 else _raise_long(key)
        elif isinstance(val, float):
            out[key] = str(val)
        else:
            raise ValueError(
                f"value of {_name(key)} must be a string or number, got {brief(val)} ({type(val).__name__})"
            )
    return out


def _name(key: str) -> str:
    """A variable name as written, or cut and quoted when long or unprintable."""
    return key if len(key) <= 40 and key.isprintable() else brief(key, 40)


def _raise_long(key: str) -> str:
    raise ValueError(f"value of {_name(key)} is an integer of over 4000 digits; quote it if meant")



#: how each named group of a metric regex is usually written
_GROUP_FORMS = {"step": r"(?P<step>\d+)", "value": r"(?P<value>\S+)"}


def check_regex(value: str, groups: tuple[str, ...] = ("step", "value"), *, count_hint: bool = True) -> str:
    """``value`` when it is a metric regex with the named ``groups`` (``step`` and ``value``,
    or ``value`` alone for a source whose step is given apart); ``ValueError`` naming what is
    wrong and the fix otherwise. ``count_hint``: point a regex without ``step`` to ``step:
    count`` (False where lines without a step cannot be read, as in a Slurm drill)."""
    pattern = compile_regex(value)
    missing = [g for g in groups if g not in pattern.groupindex]
    if missing:
        have = sorted(pattern.groupindex) or "none"
        forms = " and ".join(_GROUP_FORMS[g] for g in groups)
        hint = ""
        if "step" in missing and count_hint:
            hint = "; for lines without a step write `{regex: '...', step: count}` (docs/metrics.md)"
        raise ValueError(
            f"regex {brief(value)} lacks the named group(s) {', '.join(missing)} (it has: {have}); "
            f"write {'them' if len(groups) > 1 else 'it'} as {forms}{hint}"
        )
    return value


def compile_regex(value: str) -> re.Pattern[str]:
    """``value`` compiled; ``ValueError`` with the position of the mistake otherwise."""
    try:
        return re.compile(value)
    except re.error as exc:
        raise ValueError(f"{brief(value)} is not a valid regular expression: {exc}") from None
    except (OverflowError, RecursionError, MemoryError) as exc:  # a{4294967296}, deep nesting
        raise ValueError(f"{brief(value)} is not a usable regular expression: {exc}") from None


#: a command: a string split like a shell would, or a list of strings
Argv = Annotated[list[str], BeforeValidator(_to_argv)]
#: environment variables: scalar values become strings
Env = Annotated[dict[str, str], BeforeValidator(_to_env)]


def _to_path_text(value: Any) -> Any:
    return no_nul(value, "path") if isinstance(value, str) else value


#: a path written in the job file: a string without NUL bytes
PathText = Annotated[str, BeforeValidator(_to_path_text)]


def _to_text(value: Any) -> Any:
    return no_nul(value, "name or argument") if isinstance(value, str) else value


#: a name written in the job file, passed on to commands and paths: a string without NUL bytes
Text = Annotated[str, BeforeValidator(_to_text)]
