"""What the signal tests share: a ``trainguard`` (or ``pytest``) command run in its own session,
watched while it runs, signalled at a chosen point, and the scans that prove nothing was left.

:class:`Watched` starts the command with ``start_new_session=True`` (so a SIGINT to its process
group is what a terminal's Ctrl-C sends) and a thread that records, every 50 ms, each process
whose parent chain leads to it and the TCP ports those processes listen on. After the signal and
the exit, :meth:`Watched.leftovers` lists what is still there: a recorded process alive (after a
short grace), a mount under the test's directories or of trainguard's own file systems, a
``trainguard-<pid>-*`` cgroup of the command, a recorded port still listening.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import psutil
import pytest

from trainguard._internal.signals import restore_default_signals

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "tests" / "data"
TOY = DATA / "jobs" / "toy_train.py"
HTTP_JOB = DATA / "faults" / "http_job.py"
#: the file systems trainguard mounts (FUSE layer, tmpfs of the disk_full fault)
OUR_FS = ("trainguard-fuse", "trainguard-disk-full")
CGROUP_ROOT = Path("/sys/fs/cgroup")  # every hierarchy under it: memory, cpu, the unified one
GRACE_S = 3.0  # what may still be exiting after trainguard itself has exited

TOY_JOB = """\
job:
  name: sig-toy
  command: "{python} {toy} --steps {{steps}} --seed {{seed}} --ckpt-dir {{checkpoint_dir}} --sleep {sleep} --spawn-child"
  resume_args: "--resume"
  world_size: 2
  env: {{OMP_NUM_THREADS: "1"}}
  metrics:
    loss: 'step (?P<step>\\d+) loss (?P<value>\\S+)'
  timeout: 120
  stall_timeout: 30
checks:
{checks}
"""


def toy_job(tmp_path: Path, checks: str, *, sleep: float = 0.1, name: str = "trainguard.yaml") -> Path:
    """A job file in ``tmp_path`` running tests/data/jobs/toy_train.py (2 ranks, each with a
    grandchild that sleeps 600 s, so a rank's whole group must be torn down)."""
    path = tmp_path / name
    path.write_text(TOY_JOB.format(python=sys.executable, toy=TOY, sleep=sleep, checks=checks))
    return path


class Watched:
    """A command in its own session, its descendants and their listening ports recorded."""

    def __init__(self, argv: Sequence[str], cwd: Path, env: dict[str, str] | None = None) -> None:
        self.cwd = cwd
        self.out = cwd / "watched.stdout"
        self.err = cwd / "watched.stderr"
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        with open(self.out, "wb") as out, open(self.err, "wb") as err:
            # a terminal's foreground job: SIGINT and SIGQUIT at their defaults, whatever pytest has
            self.popen = subprocess.Popen(list(argv), cwd=cwd, env=full_env, stdin=subprocess.DEVNULL,
                                          stdout=out, stderr=err, start_new_session=True,
                                          preexec_fn=restore_default_signals)
        self.root = psutil.Process(self.popen.pid)
        self.seen: dict[int, psutil.Process] = {}
        self.ports: set[int] = set()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    # -- recording -------------------------------------------------------------------------------

    def _watch(self) -> None:
        last_ports = 0.0
        while not self._stop.is_set():
            self.scan()
            if time.monotonic() - last_ports > 0.3:
                self._scan_ports()
                last_ports = time.monotonic()
            self._stop.wait(0.05)

    def scan(self) -> None:
        with contextlib.suppress(psutil.Error):
            for child in self.root.children(recursive=True):
                with self._lock:
                    self.seen.setdefault(child.pid, child)
        # a process that was re-parented (its parent died) stays recorded from an earlier scan;
        # its own children are still ours
        with self._lock:
            known = list(self.seen.values())
        for proc in known:
            with contextlib.suppress(psutil.Error):
                for child in proc.children(recursive=True):
                    with self._lock:
                        self.seen.setdefault(child.pid, child)

    def _scan_ports(self) -> None:
        with self._lock:
            pids = {self.popen.pid, *self.seen}
        with contextlib.suppress(psutil.Error, OSError):
            for conn in psutil.net_connections(kind="tcp"):
                if conn.status == psutil.CONN_LISTEN and conn.pid in pids and conn.laddr:
                    self.ports.add(conn.laddr.port)

    # -- waiting for a point ---------------------------------------------------------------------

    def text(self) -> str:
        return self.out.read_text(errors="replace") + self.err.read_text(errors="replace")

    def wait_for(self, what: str, ready: Callable[[], Any], timeout: float = 90.0) -> Any:
        """Wait until ``ready()`` is truthy (its value); fail naming ``what`` and the output."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = ready()
            if value:
                return value
            if self.popen.poll() is not None:
                pytest.fail(f"the command exited ({self.popen.returncode}) before {what}:\n{self.text()[-3000:]}")
            time.sleep(0.05)
        pytest.fail(f"no {what} within {timeout:g} s:\n{self.text()[-3000:]}")

    def wait_text(self, needle: str, timeout: float = 90.0) -> None:
        self.wait_for(repr(needle), lambda: needle in self.text(), timeout)

    def descendants(self) -> list[psutil.Process]:
        with self._lock:
            return [p for p in self.seen.values() if _running(p)]

    def cgroups(self) -> list[Path]:
        return cgroups_of(self.popen.pid)

    def mounts(self) -> list[str]:
        return mounts_under(self.cwd)

    # -- the signal and what follows -------------------------------------------------------------

    def interrupt(self, sig: int, *, group: bool = False) -> None:
        """Send ``sig`` to the command (``group``: to its whole process group, as a terminal's
        Ctrl-C does), after a last scan so nothing started just before is missed."""
        self.scan()
        self._scan_ports()
        if group:
            os.killpg(self.popen.pid, sig)
        else:
            self.popen.send_signal(sig)

    def wait(self, timeout: float = 60.0) -> int:
        try:
            code = self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill_all()
            pytest.fail(f"the command did not exit within {timeout:g} s of the signal:\n{self.text()[-3000:]}")
        self._stop.set()
        self._thread.join(5)
        return code

    def leftovers(self) -> list[str]:
        """Everything the command left behind (empty: nothing); then cleans it up."""
        with self._lock:
            procs = list(self.seen.values())
        _, alive = psutil.wait_procs(procs, timeout=GRACE_S)
        alive = [p for p in alive if _running(p)]
        found = [f"process {p.pid} {' '.join(_cmdline(p))[:160]}" for p in alive]
        found += [f"mount {m}" for m in self.mounts()]
        found += [f"cgroup {c}" for c in self.cgroups()]
        listening = listening_ports()
        found += [f"listening port {port}" for port in sorted(self.ports & listening)]
        self.kill_all()
        return found

    def kill_all(self) -> None:
        """Clean up after a failed test: SIGKILL what is left, unmount, remove cgroups."""
        self._stop.set()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.popen.pid, signal.SIGKILL)
        with self._lock:
            procs = list(self.seen.values())
        for proc in procs:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(5)
        for mount in self.mounts():
            subprocess.run(["umount", "-l", mount], capture_output=True, timeout=30, check=False)
        for cgroup in sorted(self.cgroups(), key=lambda p: -len(p.parts)):
            with contextlib.suppress(OSError):
                cgroup.rmdir()


def _running(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _cmdline(proc: psutil.Process) -> list[str]:
    try:
        return proc.cmdline()
    except psutil.Error:
        return ["?"]


def mounts_under(root: Path) -> list[str]:
    """Mount points under ``root`` (trainguard's file systems or any other)."""
    prefix = os.path.realpath(root) + "/"
    out = []
    for line in Path("/proc/self/mounts").read_text().splitlines():
        fields = line.split()
        if len(fields) > 1 and fields[1].startswith(prefix):
            out.append(fields[1])
    return out


def cgroups_of(pid: int) -> list[Path]:
    """The ``trainguard-<pid>-*`` cgroups the process ``pid`` created (their rank cgroups are
    inside)."""
    found: list[Path] = []
    with contextlib.suppress(OSError):
        found = [p for p in CGROUP_ROOT.rglob(f"trainguard-{pid}-*") if p.is_dir()]
    return sorted(found)


def listening_ports() -> set[int]:
    with contextlib.suppress(psutil.Error, OSError):
        return {c.laddr.port for c in psutil.net_connections(kind="tcp")
                if c.status == psutil.CONN_LISTEN and c.laddr}
    return set()


def report_checks(path: Path) -> dict[str, str]:
    """Check name -> status in the JSON report at ``path`` ({} when there is none)."""
    if not path.is_file():
        return {}
    data = json.loads(path.read_text())
    return {c["name"]: c["status"] for c in data.get("checks", [])}


def trainguard(*args: str) -> list[str]:
    return [sys.executable, "-m", "trainguard.cli", *args]


def watch_fixture(tmp_path: Path) -> Iterator[Callable[..., Watched]]:
    """The body of the ``watch`` fixture (tests/signals/conftest.py): ``watch(argv, env=...)``
    starts a :class:`Watched` command in ``tmp_path``; what is left at the end is cleaned up."""
    started: list[Watched] = []

    def start(argv: Sequence[str], env: dict[str, str] | None = None) -> Watched:
        watched = Watched(argv, tmp_path, env)
        started.append(watched)
        return watched

    try:
        yield start
    finally:
        for watched in started:
            watched.kill_all()
