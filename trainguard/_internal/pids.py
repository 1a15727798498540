"""Whether a process id names a process: the one helper of the lifecycle code (cgroups, the FUSE
daemon, checkouts, the Ray writer's driver, the test cluster's supervisor) that decides a
leftover's owner is gone."""

from __future__ import annotations

import os

import psutil

__all__ = ["pid_alive"]


def pid_alive(pid: int, *, zombie: bool = True) -> bool:
    """True while ``pid`` names a process (one of another user's included). A zombie (exited,
    not yet reaped by its parent) counts as alive, unless ``zombie`` is False: then it is gone,
    as it is to a parent that waits for its own child to exit. 0 and negative numbers name no
    process (to ``os.kill`` they name process groups)."""
    if pid <= 0:
        return False
    if not zombie:
        try:
            proc = psutil.Process(pid)
            return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
