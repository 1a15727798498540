"""``python -m trainguard.cli``."""

from trainguard.cli.main import entry

entry()
