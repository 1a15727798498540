"""pid_alive: the one helper that says whether a process id names a process, and whether a
zombie (exited, not reaped) counts."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from trainguard._internal.pids import pid_alive


def _zombie() -> subprocess.Popen[bytes]:
    """A child that has exited and is not reaped yet."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with open(f"/proc/{child.pid}/stat") as stat:
            if stat.read().rsplit(")", 1)[1].split()[0] == "Z":
                return child
        time.sleep(0.01)
    raise AssertionError("the child never exited")


def test_a_running_process_is_alive_either_way() -> None:
    assert pid_alive(os.getpid()) and pid_alive(os.getpid(), zombie=False)


def test_a_zombie_is_alive_until_reaped_unless_zombies_count_as_gone() -> None:
    child = _zombie()
    try:
        assert pid_alive(child.pid)
        assert not pid_alive(child.pid, zombie=False)
    finally:
        child.wait()
    assert not pid_alive(child.pid) and not pid_alive(child.pid, zombie=False)  # reaped: gone


def test_zero_and_negative_numbers_name_no_process() -> None:
    """To ``os.kill`` 0 is this process group and -1 every process: neither is a process id."""
    assert not pid_alive(0) and not pid_alive(-1) and not pid_alive(-os.getpgrp())
    assert not pid_alive(0, zombie=False) and not pid_alive(-1, zombie=False)
    assert pid_alive(os.getpid()) and pid_alive(os.getpid(), zombie=False)
