"""A real one-node Slurm cluster on this machine, for trainguard's tests and for a person.

slurmctld + slurmd on localhost and a munged of its own, run as root from Debian's ``slurm-wlm``
and ``munge`` packages, with everything generated in one directory: ``slurm.conf`` (its own
ports, ``StateSaveLocation``, ``SlurmdSpoolDir``, pid and log files), a fresh munge key and
socket. The system's ``/etc/slurm`` and ``/run/munge`` are never read: clients (sbatch, squeue,
scontrol) find the cluster through ``SLURM_CONF`` (:meth:`SlurmCluster.env`).

A supervisor process owns the daemons (they are its children) and stops them, then removes the
directory, when it gets SIGTERM/SIGINT or when every registered user process has exited -- so a
test session killed outright (SIGKILL) leaves nothing behind either. pytest-xdist workers share
one cluster (:func:`shared_cluster`): the first one starts it under a file lock, each registers
itself, the last one to leave stops it.

By hand, from the repository root (as root)::

    .venv/bin/python -m tests.slurm.cluster          # prints `export SLURM_CONF=...`; Ctrl-C stops

The ``slurm_cluster`` fixture (tests/slurm/conftest.py) is the test-side entry point.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psutil

from trainguard._internal.locks import file_lock
from trainguard._internal.pids import pid_alive

__all__ = ["SlurmCluster", "missing_requirements", "our_daemons", "shared_cluster"]

DAEMONS = ("munged", "slurmctld", "slurmd")
PARTITION = "tg"
#: the partition's MaxTime: a gate's default ``--time`` (24 h without a sizing) fits under it
MAX_TIME = "2-00:00:00"
READY_TIMEOUT_S = 60.0


def _tool(name: str) -> str | None:
    """``name`` on PATH, or in the sbin directories Debian installs the daemons to (a PATH
    without them, as some CI environments have, must not hide an installed cluster)."""
    return shutil.which(name, path=f"{os.environ.get('PATH', '')}{os.pathsep}/usr/sbin{os.pathsep}/sbin")


def missing_requirements() -> str | None:
    """Why a cluster cannot start here (not root, a package missing), or None."""
    if os.geteuid() != 0:
        return "a local Slurm cluster runs its daemons as root; run the tests as root"
    absent = [name for name in (*DAEMONS, "sbatch", "squeue", "scontrol") if _tool(name) is None]
    if absent:
        return (f"{', '.join(absent)} not found: install Debian's packages with "
                "`apt-get install slurm-wlm munge` (.ci/run does)")
    return None


def _free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _meminfo_mb() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) // 1024
    return 1024


def render_conf(root: Path, name: str, node: str, ports: tuple[int, int], cpus: int, memory_mb: int) -> str:
    """The cluster's slurm.conf: one node (the machine's CPUs and memory), one partition."""
    return "\n".join([
        f"ClusterName={name}",
        f"SlurmctldHost={node}(127.0.0.1)",
        f"SlurmctldPort={ports[0]}",
        f"SlurmdPort={ports[1]}",
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        # cred_expire: a requeued batch job waits this long before it may start again (default 120)
        f"AuthInfo=socket={root}/munge/munge.socket,cred_expire=5",
        f"StateSaveLocation={root}/state",
        f"SlurmdSpoolDir={root}/spool",
        f"SlurmctldPidFile={root}/slurmctld.pid",
        f"SlurmdPidFile={root}/slurmd.pid",
        f"SlurmctldLogFile={root}/log/slurmctld.log",
        f"SlurmdLogFile={root}/log/slurmd.log",
        "SlurmctldDebug=info",
        "SlurmdDebug=info",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "JobCompType=jobcomp/filetxt",
        f"JobCompLoc={root}/log/jobcomp.txt",
        "SwitchType=switch/none",
        "MpiDefault=none",
        "SchedulerType=sched/backfill",
        "SchedulerParameters=sched_interval=2",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core",
        "ReturnToService=1",  # a node set DOWN stays down until `scontrol update ... RESUME`
        "JobRequeue=1",
        "EnforcePartLimits=ALL",  # sbatch refuses a job over the partition's limits (never pends)
        "MinJobAge=600",
        "KillWait=5",
        "SlurmdTimeout=30",
        "InactiveLimit=0",
        f"NodeName={node} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory={memory_mb} State=UNKNOWN",
        f"PartitionName={PARTITION} Nodes={node} Default=YES MaxTime={MAX_TIME} State=UP",
        "",
    ])


@dataclasses.dataclass
class SlurmCluster:
    """A started cluster, as its users see it: the directory, the conf, the node, the timings."""

    root: Path
    conf: Path
    node: str
    partition: str
    supervisor_pid: int
    start_s: float
    pids: dict[str, int]

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """``base`` (default: this process's environment) with ``SLURM_CONF`` set to the cluster's."""
        return {**(os.environ if base is None else base), "SLURM_CONF": str(self.conf)}

    def run(self, *argv: str, timeout: float = 30.0, check: bool = True) -> subprocess.CompletedProcess[str]:
        """A Slurm client command against this cluster (bounded by ``timeout``)."""
        proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout,
                              env=self.env(), stdin=subprocess.DEVNULL)
        if check and proc.returncode:
            raise RuntimeError(f"{' '.join(argv)} exited {proc.returncode}: {proc.stderr.strip()}")
        return proc

    def to_json(self) -> str:
        return json.dumps({**dataclasses.asdict(self), "root": str(self.root), "conf": str(self.conf)})

    @classmethod
    def from_json(cls, text: str) -> SlurmCluster:
        data = json.loads(text)
        return cls(**{**data, "root": Path(data["root"]), "conf": Path(data["conf"])})


def our_daemons(root: Path | str) -> list[int]:
    """Pids of the munged/slurmctld/slurmd processes whose command line names ``root`` (the
    cluster's directory) and of the slurmstepd processes (a job's batch shell and steps; their
    command line is ``slurmstepd: [JOB.STEP]``) whose environment names its slurm.conf: what
    must be gone after a stop."""
    conf = f"SLURM_CONF={root}/slurm.conf".encode()
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            exe = cmd.split(" ", 1)[0].rsplit("/", 1)[-1].rstrip(":")
            daemon = exe in DAEMONS and str(root) in cmd
            if daemon or (exe == "slurmstepd" and conf in (proc / "environ").read_bytes().split(b"\0")):
                found.append(int(proc.name))
        except OSError:
            continue
    return found


def _kill_steps(root: Path) -> None:
    """SIGKILL every slurmstepd of this cluster and the job processes under it (slurmd's stop
    leaves running steps alone, as Slurm means it to)."""
    for pid in our_daemons(root):
        try:
            stepd = psutil.Process(pid)
            if not stepd.name().startswith("slurmstepd"):
                continue
            tree = [*stepd.children(recursive=True), stepd]
        except psutil.Error:
            continue
        for proc in tree:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        psutil.wait_procs(tree, timeout=5)


# -- the supervisor (a process of its own) ---------------------------------------------------------


class _Stop(Exception):
    pass


def _raise_stop(signum: int, frame: object) -> None:
    raise _Stop


def _wait_for(what: str, predicate: object, deadline: float, procs: dict[str, subprocess.Popen[bytes]]) -> None:
    while not predicate():  # type: ignore[operator]
        for name, proc in procs.items():
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited {proc.returncode} while waiting for {what}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.1)


def supervise(root: Path) -> int:
    """Start munged, slurmctld and slurmd in ``root``; write ``root/ready.json``; stop them on
    SIGTERM/SIGINT or when no pid listed in ``root/users/`` is alive any more; remove ``root``."""
    signal.signal(signal.SIGTERM, _raise_stop)
    signal.signal(signal.SIGINT, _raise_stop)
    started = time.monotonic()
    procs: dict[str, subprocess.Popen[bytes]] = {}
    log = root / "log"
    try:
        for sub in ("munge", "state", "spool", "log", "users"):
            (root / sub).mkdir(mode=0o700, exist_ok=True)
        key = root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        node = socket.gethostname().split(".")[0]
        ports = _free_ports(2)
        conf = root / "slurm.conf"
        conf.write_text(render_conf(root, f"tg{os.getpid()}", node, (ports[0], ports[1]),
                                    os.cpu_count() or 1, max(256, _meminfo_mb() - 1024)))
        env = {**os.environ, "SLURM_CONF": str(conf)}
        out = open(log / "daemons.out", "ab")  # noqa: SIM115 (closed at the end)
        deadline = time.monotonic() + READY_TIMEOUT_S

        def spawn(name: str, argv: list[str]) -> None:
            procs[name] = subprocess.Popen([_tool(name) or name, *argv[1:]], env=env, stdin=subprocess.DEVNULL, stdout=out,
                                           stderr=subprocess.STDOUT)

        sock = root / "munge" / "munge.socket"
        spawn("munged", ["munged", "-F", "--force", f"--socket={sock}", f"--key-file={key}",
                         f"--pid-file={root}/munge/munged.pid", f"--log-file={log}/munged.log",
                         f"--seed-file={root}/munge/munged.seed", "--num-threads=2"])
        _wait_for("munged's socket", sock.exists, deadline, procs)
        spawn("slurmctld", ["slurmctld", "-D", "-i", "-f", str(conf)])
        spawn("slurmd", ["slurmd", "-D", "-f", str(conf), "-N", node])

        def node_up() -> bool:
            proc = subprocess.run(["sinfo", "--noheader", "-N", "-o", "%T"], capture_output=True,
                                  text=True, env=env, timeout=10)
            return proc.returncode == 0 and proc.stdout.strip().rstrip("*") in ("idle", "mixed", "allocated")

        _wait_for("the node to be idle", node_up, deadline, procs)
        cluster = SlurmCluster(root=root, conf=conf, node=node, partition=PARTITION,
                               supervisor_pid=os.getpid(), start_s=round(time.monotonic() - started, 2),
                               pids={name: p.pid for name, p in procs.items()})
        tmp = root / ".ready.json"
        tmp.write_text(cluster.to_json())
        os.replace(tmp, root / "ready.json")
        idle_since: float | None = None
        while True:  # until signalled, or every user is gone (1 s of none: a user may be joining)
            for name, proc in procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited {proc.returncode}; see {log}")
            users = [int(p.name) for p in (root / "users").iterdir() if p.name.isdigit()]
            if any(pid_alive(pid, zombie=False) for pid in users):
                idle_since = None
            elif idle_since is None:
                idle_since = time.monotonic()
            elif time.monotonic() - idle_since > 1.0:
                return 0
            time.sleep(0.5)
    except _Stop:
        return 0
    except Exception as exc:  # said in the error file the starter reads
        (root / "error.txt").write_text(f"{type(exc).__name__}: {exc}")
        return 1
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        _kill_steps(root)  # jobs still running: their steps, then the daemons
        _stop_daemons(procs)
        _kill_steps(root)  # a step that started meanwhile
        if not (root / "keep").exists() and not (root / "error.txt").exists():
            shutil.rmtree(root, ignore_errors=True)


def _stop_daemons(procs: dict[str, subprocess.Popen[bytes]]) -> None:
    """slurmd, then slurmctld, then munged: SIGTERM, 10 s, SIGKILL; every one reaped."""
    for name in ("slurmd", "slurmctld", "munged"):
        proc = procs.get(name)
        if proc is None or proc.poll() is not None:
            continue
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


# -- starting and sharing ----------------------------------------------------------------------------


def start(root: Path, *, timeout: float = READY_TIMEOUT_S + 10) -> SlurmCluster:
    """Start a supervisor for a new cluster in ``root`` (an empty directory) and wait until it is
    ready; raises RuntimeError with the daemons' logs' tail when it is not."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "users").mkdir(exist_ok=True)
    (root / "users" / str(os.getpid())).touch()
    # its own session: Ctrl-C in this terminal reaches the users, who stop it, not the daemons
    proc = subprocess.Popen([sys.executable, __file__, "--supervise", str(root)],
                            stdin=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + timeout
    while not (root / "ready.json").exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            if proc.poll() is None:
                proc.terminate()
                proc.wait(20)
            error = (root / "error.txt").read_text() if (root / "error.txt").exists() else "no ready file"
            logs = "".join(f"\n--- {p.name}:\n" + "\n".join(p.read_text(errors="replace").splitlines()[-15:])
                           for p in sorted((root / "log").glob("*.log")))
            raise RuntimeError(f"the local Slurm cluster did not start ({error}){logs}")
        time.sleep(0.1)
    return SlurmCluster.from_json((root / "ready.json").read_text())


def stop(cluster: SlurmCluster, timeout: float = 40.0) -> float:
    """SIGTERM the supervisor and wait for its directory to go; the seconds it took."""
    started = time.monotonic()
    with contextlib.suppress(ProcessLookupError):
        os.kill(cluster.supervisor_pid, signal.SIGTERM)
    while pid_alive(cluster.supervisor_pid, zombie=False) and time.monotonic() - started < timeout:
        time.sleep(0.1)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(cluster.supervisor_pid, os.WNOHANG)
    return time.monotonic() - started


@contextlib.contextmanager
def shared_cluster(base: Path) -> Iterator[tuple[SlurmCluster, bool]]:
    """The cluster in ``base/slurm`` shared by every process that enters this block (pytest-xdist
    workers): started by the first, stopped by the last to leave (each registers its pid under
    ``users/``; the supervisor also stops once none of them is alive). Yields the cluster and
    whether this process started it."""
    root = base / "slurm"
    base.mkdir(parents=True, exist_ok=True)
    lock = base / "slurm.lock"
    me = str(os.getpid())
    with file_lock(lock):
        ready = root / "ready.json"
        cluster = SlurmCluster.from_json(ready.read_text()) if ready.exists() else None
        if cluster is not None and not pid_alive(cluster.supervisor_pid, zombie=False):
            cluster = None
        if cluster is None:
            if root.exists():
                shutil.rmtree(root, ignore_errors=True)
            cluster = start(root)
            started_here = True
        else:
            (root / "users" / me).touch()
            started_here = False
    try:
        yield cluster, started_here
    finally:
        with file_lock(lock):
            with contextlib.suppress(FileNotFoundError):
                (root / "users" / me).unlink()
            users = (root / "users").glob("*") if (root / "users").exists() else []
            others = [p for p in users if p.name.isdigit() and pid_alive(int(p.name), zombie=False)]
            if not others:
                stop(cluster)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="a local one-node Slurm cluster (Ctrl-C stops it)")
    parser.add_argument("--supervise", metavar="DIR", help=argparse.SUPPRESS)
    parser.add_argument("--dir", help="the cluster's directory (default: a new temp directory)")
    args = parser.parse_args(argv)
    if args.supervise:
        return supervise(Path(args.supervise))
    why = missing_requirements()
    if why:
        print(f"cannot start: {why}", file=sys.stderr)
        return 2
    # set, not inherited: a parent that ignores SIGINT/SIGTERM (a pytest-xdist worker does)
    # would pass that on, and Ctrl-C would leave the cluster up
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _interrupt)
    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="tg-slurm-"))
    cluster = start(root)  # interrupted here: the supervisor sees its only user gone and stops
    print(f"local Slurm cluster up in {cluster.start_s:.1f} s (node {cluster.node}, partition "
          f"{cluster.partition}); in another shell:\n  export SLURM_CONF={cluster.conf}\n"
          "Ctrl-C stops it and removes its directory.", flush=True)
    try:
        while pid_alive(cluster.supervisor_pid, zombie=False):
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        took = stop(cluster)
        print(f"stopped in {took:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
