"""Limits on what a job file may ask for, and values cut to a length an error message can hold.

A job file is user input: a value in it may be megabytes long, an integer of thousands of digits
or a tree of YAML aliases. Messages repeat values through :func:`brief`, which never builds the
whole text of a big one.
"""

from __future__ import annotations

from typing import Any

__all__ = ["BRIEF_LIMIT", "MAX_SECONDS", "MAX_WORLD_SIZE", "brief"]

#: the most ranks one run may launch: every rank of a ``command`` job is a process on this
#: machine, so a larger number is a typo, not a test
MAX_WORLD_SIZE = 1024
#: the longest timeout a job file may give (a week); longer ones are typos
MAX_SECONDS = 7 * 24 * 3600.0

#: the longest value an error message repeats; the rest is cut (a value may be megabytes)
BRIEF_LIMIT = 80


def brief(value: Any, limit: int = BRIEF_LIMIT) -> str:
    """``repr(value)`` cut to about ``limit`` characters, never built whole for a big value
    (a 50 MB string, a deep YAML alias tree) and never raising."""
    if isinstance(value, str):
        text = repr(value[: limit + 1])
        return text if len(value) <= limit else f"{repr(value[:limit])[:-1]}...' ({len(value)} characters)"
    if isinstance(value, (bool, float)) or value is None:
        return repr(value)
    if isinstance(value, int):
        digits = len(str(value)) if abs(value) < 10 ** 4000 else 4000
        return str(value) if digits <= limit else f"an integer of {digits}+ digits"
    if isinstance(value, (list, tuple, dict, set)):
        kind = type(value).__name__
        return f"a {kind} of {len(value)} item(s)" if _too_big(value, limit) else _safe_repr(value, limit)
    return _safe_repr(value, limit)


def _too_big(value: Any, limit: int, depth: int = 0) -> bool:
    """Whether the repr of a container would pass ``limit``, judged without building it."""
    budget = [limit]

    def walk(v: Any, d: int) -> bool:
        budget[0] -= 2
        if budget[0] < 0 or d > 8:
            return True
        if isinstance(v, dict):
            return any(walk(k, d + 1) or walk(x, d + 1) for k, x in v.items())
        if isinstance(v, (list, tuple, set)):
            return any(walk(x, d + 1) for x in v)
        budget[0] -= min(len(v) if isinstance(v, str) else 8, limit + 1)
        return budget[0] < 0

    return walk(value, depth)


def _safe_repr(value: Any, limit: int) -> str:
    try:
        text = repr(value)
    except Exception:  # a value whose repr fails is still named
        return f"a {type(value).__name__}"
    return text if len(text) <= limit else text[:limit] + "..."
