"""A job backend written outside trainguard (docs/backends.md): every rank's command runs
through a launcher shim, as ``srun``, ``mpirun`` or a container runtime would wrap it.

The shim (``wrapped_shim.py``) notes the rank it starts in the file ``$WRAPPED_LOG`` names, then
becomes the rank's command; everything else -- torchrun's environment, trainguard restarting the
group, the ranks being the launched processes -- is the command backend's, inherited. Registered
by name (``register_backend("wrapped", WrappedBackend)``), it runs any job file that says
``kind: wrapped``.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence
from pathlib import Path

from trainguard.launch import LaunchSpec
from trainguard.launch.backend import CommandBackend

SHIM = Path(__file__).resolve().with_name("wrapped_shim.py")


def through_shim(argv: Sequence[str]) -> list[str]:
    """``argv`` started by the shim."""
    return [sys.executable, str(SHIM), "--", *argv]


class WrappedBackend(CommandBackend):
    """``kind: wrapped``: the command backend with each rank started through :data:`SHIM`."""

    title = "wrapped"

    def launch_spec(self, spec: LaunchSpec) -> LaunchSpec:
        return dataclasses.replace(spec, argv=through_shim(spec.argv))

    def reproduce_argv(self, argv: Sequence[str], world_size: int) -> list[str]:
        return super().reproduce_argv(through_shim(argv), world_size)
