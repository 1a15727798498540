"""The pieces of teardown the signal tests rely on, each with a real signal or a real kill:

* a signal while the FUSE layer's daemon mounts leaves neither the mount nor the daemon;
* the cgroups of a SIGKILLed trainguard (no teardown ran) are removed by the next oom fault
  that creates cgroups, and only those: a live trainguard's and a busy one stay;
* a runner closed while a reference run goes on in the background returns only once its ranks
  are gone, so an interpreter that exits right after (Ctrl-C) leaves none behind;
* a signal inside ``subprocess.Popen`` (after the fork) waits until the rank is recorded
  (:func:`trainguard._internal.signals.signals_deferred`), so the teardown reaches it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from tests.signals.watching import REPO, cgroups_of, mounts_under
from trainguard._internal.signals import restore_default_signals

pytestmark = [pytest.mark.timeout(120), pytest.mark.xdist_group("signals")]

ROOT = os.geteuid() == 0


def run_python(code: str, cwd: Path, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    # Ctrl-C's own state: SIGINT at its default (Python's KeyboardInterrupt), whatever pytest has
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, "PYTHONPATH": str(REPO)},
                          preexec_fn=restore_default_signals)


def _interrupted_and_nothing_left(done: subprocess.CompletedProcess[str], tmp_path: Path) -> None:
    """mount() raised KeyboardInterrupt with the layer cleaned up: no mount, no daemon."""
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("interrupted None"), done.stdout + done.stderr
    assert mounts_under(tmp_path) == []
    daemons = [p for p in psutil.process_iter(["cmdline"])
               if str(tmp_path / "point") in " ".join(p.info["cmdline"] or [])]
    assert daemons == [], [p.info["cmdline"] for p in daemons]


#: how Ctrl-C reaches mount(): a real SIGINT sent by a SIGALRM 50 ms in (the daemon, a Python
#: process, is still starting; a busy machine may land it inside Popen, where it is held), or
#: sent from inside Popen itself (the CI race made certain: held, then delivered as the block ends)
CTRL_C_DURING_MOUNT = {
    "after-50-ms": """
        def interrupt(signum, frame):
            os.kill(os.getpid(), signal.SIGINT)
        signal.signal(signal.SIGALRM, interrupt)
        signal.setitimer(signal.ITIMER_REAL, 0.05)
    """,
    "inside-popen": """
        real = subprocess.Popen
        def popen(*args, **kwargs):
            proc = real(*args, **kwargs)
            os.kill(os.getpid(), signal.SIGINT)
            return proc
        subprocess.Popen = popen
    """,
}


@pytest.mark.parametrize("when", sorted(CTRL_C_DURING_MOUNT))
def test_ctrl_c_while_the_fuse_layer_mounts_leaves_nothing(tmp_path: Path, when: str) -> None:
    from trainguard.faults.fusefs import fuse_unavailable

    why = fuse_unavailable()
    if why is not None:
        pytest.skip(why)
    done = run_python(f"""
        import os, signal, subprocess, sys
        from pathlib import Path
        from trainguard.faults.fusefs import FuseLayer

        root = Path({str(tmp_path)!r})
        layer = FuseLayer(root / "backing", root / "point", policy="disk_full", state_dir=root)
        {textwrap.dedent(CTRL_C_DURING_MOUNT[when]).strip().replace(chr(10), chr(10) + " " * 8)}
        try:
            layer.mount()
        except KeyboardInterrupt:
            print("interrupted", layer.proc)
            sys.exit(0)
        print("mounted before the signal")
    """, tmp_path)
    _interrupted_and_nothing_left(done, tmp_path)


@pytest.mark.skipif(not ROOT, reason="memory cgroups need root")
def test_the_cgroups_of_a_sigkilled_trainguard_are_removed_by_the_next_one(tmp_path: Path) -> None:
    from trainguard.faults.base import FaultUnavailable
    from trainguard.faults.cgroups import MemoryCgroups

    try:
        probe = MemoryCgroups(1)
    except FaultUnavailable as exc:
        pytest.skip(str(exc))
    # the reproducer: cgroups made, then SIGKILL (no finally, no atexit)
    victim = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import sys, time
        from trainguard.faults.cgroups import MemoryCgroups
        cgroups = MemoryCgroups(2)
        cgroups.create()
        print(cgroups.parent, flush=True)
        time.sleep(60)
    """)], stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        assert victim.stdout is not None
        left = Path(victim.stdout.readline().strip())
        assert left.is_dir() and (left / "rank1").is_dir()
    finally:
        victim.send_signal(signal.SIGKILL)
        victim.wait(10)
    assert cgroups_of(victim.pid) == [left]
    # a busy one (a process inside) and this live process's own are not touched
    busy = probe.base / f"trainguard-{victim.pid + 1_000_000}-busy"
    sleeper = subprocess.Popen(["sleep", "30"])
    mine = MemoryCgroups(1)
    try:
        busy.mkdir()
        (busy / "cgroup.procs").write_text(str(sleeper.pid))
        mine.create()
        fresh = MemoryCgroups(1)
        fresh.create()
        assert not left.exists(), "the dead trainguard's cgroups are still there"
        assert busy.is_dir() and mine.parent.is_dir()
        fresh.teardown()
    finally:
        sleeper.kill()
        sleeper.wait(10)
        mine.teardown()
        for _ in range(100):  # the killed sleeper leaves the cgroup a moment later
            try:
                busy.rmdir()
            except FileNotFoundError:
                break
            except OSError:
                time.sleep(0.05)


ESCAPER = """\
import subprocess, sys, time
# like torchrun's workers: a helper in a session of its own, out of reach of the rank's group
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", "escaper-" + sys.argv[2]],
                 start_new_session=True)
for step in range(1, int(sys.argv[1]) + 1):
    time.sleep(0.05)
    print(f"step {step} loss {1.0 / step}", flush=True)
"""


def test_a_closed_runner_leaves_no_background_rank(tmp_path: Path) -> None:
    """Close a runner while its prefetched reference runs, and exit the interpreter at once,
    as the CLI does after Ctrl-C: the reference's ranks and the helpers they started in
    sessions of their own are gone (the background run's teardown finished before close()
    returned; before, the daemon thread died with the interpreter, mid-teardown)."""
    (tmp_path / "escaper.py").write_text(ESCAPER)
    job = tmp_path / "trainguard.yaml"
    job.write_text(textwrap.dedent(f"""\
        job:
          name: bg
          command: "{sys.executable} escaper.py {{steps}} {tmp_path}"
          world_size: 2
          metrics:
            loss: 'step (?P<step>\\d+) loss (?P<value>\\S+)'
          timeout: 60
        checks:
          smoke: {{steps: 5}}
    """))
    done = run_python(f"""
        import time
        from trainguard.config import load_config
        from trainguard.run.request import RunRequest
        from trainguard.run.runner import JobRunner

        runner = JobRunner(load_config({str(job)!r}))
        runner.scheduling.prefetch(RunRequest(steps=400, seed=0, world_size=2))
        deadline = time.monotonic() + 30
        while not (runner._inflight and all(l.points for l in runner._inflight)):
            assert time.monotonic() < deadline, "no background run"
            time.sleep(0.02)
        time.sleep(1.0)  # the launcher has seen the helpers
        runner.close()
        print("closed", flush=True)
    """, tmp_path)
    assert "closed" in done.stdout, done.stdout + done.stderr
    time.sleep(0.5)
    survivors = [p for p in psutil.process_iter(["cmdline", "status"])
                 if f"escaper-{tmp_path}" in " ".join(p.info["cmdline"] or [])
                 and p.info["status"] != psutil.STATUS_ZOMBIE]
    for proc in survivors:
        proc.kill()
    assert survivors == [], [p.info["cmdline"] for p in survivors]


def test_signals_deferred_delivers_the_signal_after_the_block() -> None:
    """A real SIGINT and SIGTERM sent inside the block: the block runs to its end, then the
    handlers that were in place get them (here: KeyboardInterrupt, and a recorded SIGTERM)."""
    from trainguard._internal.signals import signals_deferred

    seen: list[str] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: seen.append("SIGTERM handler"))
    # Ctrl-C's own state (pytest started as a background job has SIGINT ignored)
    previous_int = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt), signals_deferred():
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)  # a handler would have run by now
            seen.append("end of the block")
        assert seen == ["end of the block"]  # SIGINT first: its KeyboardInterrupt ends delivery
        with signals_deferred():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)
            seen.append("second block")
        assert seen == ["end of the block", "second block", "SIGTERM handler"]
    finally:
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGINT, previous_int)


STARTS = """\
import os, random, signal, sys, time
from pathlib import Path
from trainguard.launch import Launcher, LaunchSpec

# SIGINT at a random moment of the start of 6 ranks, 15 times: every rank started is stopped
root = Path(sys.argv[1])
rng = random.Random(0)
for trial in range(15):
    spec = LaunchSpec(argv=[sys.executable, "-c", "import time; time.sleep(60)", f"startrank-{root}"],
                      run_dir=root / f"run{trial}", world_size=6, timeout=30, grace_period=1.0)
    signal.setitimer(signal.ITIMER_REAL, rng.uniform(0.001, 0.05))
    signal.signal(signal.SIGALRM, lambda *a: os.kill(os.getpid(), signal.SIGINT))
    try:
        Launcher(spec).run()
    except KeyboardInterrupt:
        pass
    signal.setitimer(signal.ITIMER_REAL, 0)
print("done")
"""


def test_ctrl_c_while_ranks_start_leaves_none(tmp_path: Path) -> None:
    """Ctrl-C at random moments of the start of 6 ranks (some land inside Popen, after the
    fork): no rank is left. Without :func:`signals_deferred` around the launcher's Popen, 6 were
    left (of 15 starts), no Popen object to tear them down."""
    done = run_python(STARTS.replace("sys.argv[1]", repr(str(tmp_path))), tmp_path, timeout=110)
    assert "done" in done.stdout, done.stdout + done.stderr
    survivors = [p for p in psutil.process_iter(["cmdline"]) if f"startrank-{tmp_path}" in " ".join(p.info["cmdline"] or [])]
    for proc in survivors:
        proc.kill()
    assert survivors == [], len(survivors)
