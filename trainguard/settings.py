"""Compatibility path: the public names of :mod:`trainguard.config.settings` (docs/architecture.md, re-export modules)."""

from __future__ import annotations

from trainguard.config.settings import (
    OPTIONS,
    Option,
    Settings,
    get_option,
    options_table,
    read_limits,
    resolve,
)

__all__ = [
    "OPTIONS",
    "Option",
    "Settings",
    "get_option",
    "options_table",
    "read_limits",
    "resolve",
]
