"""Whether a process id names a process: the one helper of the lifecycle code (cgroups, the FUSE
daemon, checkouts) that decides a leftover's owner is gone."""

from __future__ import annotations

import os

__all__ = ["pid_alive"]


def pid_alive(pid: int) -> bool:
    """True while ``pid`` names a process (one of another user's included; a zombie counts as
    alive until it is reaped)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
