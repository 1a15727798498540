"""The ``trainguard`` command: one module per subcommand (docs/cli.md)."""

from __future__ import annotations

from trainguard.cli.main import (
    build_parser,
    entry,
    main,
)

__all__ = [
    "build_parser",
    "entry",
    "main",
]
