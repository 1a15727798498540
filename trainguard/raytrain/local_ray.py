"""An isolated, embedded Ray head on loopback that trainguard starts and always stops.

Why a ``ray start --head --block`` subprocess and not ``ray.init(address="local")``: the Jobs API
needs the dashboard, which ``ray.init`` would host inside our own process tree and tie to the
driver's lifetime; a separate head lives in its own process group that we own, can be reached
by the Jobs client, by drivers (``ray.init(address=...)``) and by job entrypoints alike, and is
torn down by one signal. ``--block`` makes the ``ray start`` process the owner of every Ray
process it spawns: on SIGTERM it kills them all, and its children die with it (Ray sets
``PR_SET_PDEATHSIG``).

Isolation: a private short temp dir (``/tmp/tg-ray-XXXXXX``: Ray's Unix socket paths must stay
under 107 bytes) so a stale ``/tmp/ray/ray_current_cluster`` is never read; every port chosen
free (two heads can run side by side); ``RAY_ADDRESS`` removed from the head's environment;
usage stats off; no drain wait on shutdown.

Authentication: Ray >= 2.59 turns token auth on by default for local clusters and writes the
token to ``~/.ray/auth_token``. We never touch that file: the head gets ``RAY_AUTH_MODE=token``
and a fresh random ``RAY_AUTH_TOKEN`` in its environment, clients get the same token as a bearer
header (Jobs API) or through :meth:`RayCluster.client_env` (drivers).

Never ``ray stop``: it kills every Ray process on the machine, including other users' heads.
We stop only the processes we started (the process group, the descendants we saw, anything
whose command line names our temp dir) and verify none remains.

Ray Train's pace: the head's processes, and the drivers through :meth:`RayCluster.client_env`,
get :data:`trainguard.raytrain.RAY_TRAIN_DEFAULTS` (a 0.25 s controller poll instead of Ray's
2 s) unless the environment sets them.

``RAY_ADDRESS`` set (and not ``local``): a real cluster; nothing is started, stopped or set.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

import psutil

from trainguard._internal import envvars
from trainguard._internal.signals import signals_deferred
from trainguard.errors import TrainguardError
from trainguard.launch.ports import PortReservation, reserve_port
from trainguard.raytrain import ray_train_defaults

__all__ = [
    "LocalRay",
    "RayCluster",
    "RayStartError",
    "SystemConfig",
    "ray_version",
    "running_ray_processes",
    "stopped_head_processes",
]

#: Ray's internal settings of a head (``ray start --system-config``, JSON): name -> value
SystemConfig = Mapping[str, int | float | bool | str]

#: process names of a Ray node; what a leftover check looks for
RAY_PROCESS_NAMES = ("raylet", "gcs_server", "dashboard", "ray::", "log_monitor", "monitor.py")
_MIN_OBJECT_STORE_MB = 80  # Ray refuses less than 75 MiB


class RayStartError(TrainguardError):
    """The embedded Ray head did not come up (the message carries the tail of its log)."""


def ray_version() -> str | None:
    """The installed Ray version, or None when Ray is not installed (no import of ray)."""
    import importlib.metadata as md

    try:
        return md.version("ray")
    except md.PackageNotFoundError:
        return None


@dataclass(frozen=True)
class RayCluster:
    """Where a Ray cluster is and how to talk to it.

    ``address`` is what ``ray.init(address=...)`` takes (the GCS address of an embedded head, or
    ``RAY_ADDRESS`` of a real cluster); ``jobs_address`` is what
    ``JobSubmissionClient(address=...)`` takes (the dashboard URL), None when the head was
    started without a dashboard.
    """

    address: str
    jobs_address: str | None
    owned: bool
    auth_token: str | None = field(default=None, repr=False)
    temp_dir: Path | None = None
    num_cpus: int | None = None
    num_gpus: int | None = None

    def auth_headers(self) -> dict[str, str]:
        """HTTP headers that authenticate against this cluster's dashboard / Jobs API."""
        return {"Authorization": f"Bearer {self.auth_token}"} if self.auth_token else {}

    def client_env(self) -> dict[str, str]:
        """Environment for a driver or CLI that connects to this cluster (``RAY_ADDRESS`` and,
        for an embedded head, its auth mode and token). Set it in a subprocess's env, or in
        this process before the first ``import ray`` (Ray reads the auth mode once)."""
        env = {"RAY_ADDRESS": self.address}
        if self.owned:
            # trainguard's own head: Ray Train's pace for short fits, unless this process's
            # environment sets it (a job's `env` is applied after this and wins too)
            env.update(ray_train_defaults(os.environ))
            if self.auth_token:
                env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=self.auth_token)
            else:
                env["RAY_AUTH_MODE"] = "disabled"
        if self.jobs_address:
            env["RAY_API_SERVER_ADDRESS"] = self.jobs_address
        return env


def external_cluster() -> RayCluster | None:
    """The real cluster ``RAY_ADDRESS`` names, or None when it is unset or ``local``.

    The Jobs address follows Ray's own CLI: ``RAY_API_SERVER_ADDRESS``, else ``RAY_ADDRESS``.
    Authentication is Ray's own (``RAY_AUTH_MODE``/``RAY_AUTH_TOKEN`` in the environment).
    """
    address = os.environ.get("RAY_ADDRESS", "").strip()
    if not address or address in ("local", "auto"):
        return None
    jobs = os.environ.get("RAY_API_SERVER_ADDRESS", "").strip() or address
    return RayCluster(address=address, jobs_address=jobs, owned=False)


def running_ray_processes(
    head_temp_dir: str | os.PathLike[str] | None = None,
) -> list[psutil.Process]:
    """Ray processes on this machine: all of them, or only those of the embedded head whose
    temp dir is ``head_temp_dir`` (its command line names the dir, or its environment carries
    ``TRAINGUARD_RAY_HEAD``). Used to prove nothing was left behind."""
    marker = str(head_temp_dir) if head_temp_dir is not None else None
    found = []
    me = os.getpid()
    for proc in psutil.process_iter(["name", "cmdline"]):
        if proc.pid == me:
            continue
        try:
            cmdline = " ".join(proc.info["cmdline"] or [])
            name = proc.info["name"] or ""
            if marker is None:
                text = f"{name} {cmdline}"
                if any(key in text for key in RAY_PROCESS_NAMES) and "ray" in text:
                    found.append(proc)
            elif marker in cmdline or proc.environ().get(envvars.RAY_HEAD) == marker:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def stopped_head_processes(before: Iterable[int] = ()) -> list[psutil.Process]:
    """Processes (not in ``before``) of embedded heads that have been stopped: their private
    temp dir (``TRAINGUARD_RAY_HEAD``, or a ``/tmp/tg-ray-*`` dir in the command line) is gone.
    On a machine where other sessions start and stop their own heads meanwhile, these -- not
    every new Ray process -- are what a stop left behind."""
    import re

    skip = set(before)
    found = []
    for proc in running_ray_processes():
        if proc.pid in skip:
            continue
        try:
            head = proc.environ().get(envvars.RAY_HEAD)
            dirs = [head] if head else re.findall(r"/tmp/tg-ray-\w+", " ".join(proc.cmdline()))
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        if dirs and not all(os.path.exists(d) for d in dirs):
            found.append(proc)
    return found


class LocalRay:
    """Start an isolated local Ray head (or attach to ``RAY_ADDRESS``); stop it on exit.

    >>> with LocalRay() as cluster:                       # doctest: +SKIP
    ...     JobSubmissionClient(cluster.jobs_address, headers=cluster.auth_headers())

    Args:
        num_cpus: CPUs the head offers; default: the CPUs this process may run on.
        num_gpus: GPUs the head offers; default: Ray's own detection.
        object_store_mb: shared-memory object store size (bounded; Ray's default is 30% of RAM).
        dashboard: start the dashboard (the Jobs API needs it; ~0.3 GB more memory).
        auth: ``"token"`` (a fresh random token) or ``"disabled"``.
        start_timeout / stop_timeout: seconds before giving up (and cleaning up).
        use_ray_address: attach to ``RAY_ADDRESS`` when it is set instead of starting a head.
        keep_temp_dir: keep the temp dir (logs) after stopping; it is always kept when a process
            outlived the stop (a failed start puts the log's tail in its error).
        resources: custom resources the node offers (``ray start --resources``).
        system_config: Ray's internal settings for the cluster (a head only; e.g. faster
            node-death detection for tests).
        join: a head this process should join as a *worker node* (``ray start --address``, the
            head's auth token) instead of starting a head; see :mod:`trainguard.raytrain.cluster`.
        command_prefix: run ``ray start`` under this command (e.g. ``unshare --pid --fork
            --mount-proc``: a node whose processes have pids of their own, as on another machine).
    """

    # documented keyword-only constructor (docs/queue.md): its options are its parameters (pyproject.toml, PLR0913)
    def __init__(  # noqa: PLR0913
        self,
        *,
        num_cpus: int | None = None,
        num_gpus: int | None = None,
        object_store_mb: int = 200,
        dashboard: bool = True,
        auth: str = "token",
        start_timeout: float = 120.0,
        stop_timeout: float = 30.0,
        use_ray_address: bool = True,
        keep_temp_dir: bool = False,
        extra_env: dict[str, str] | None = None,
        resources: dict[str, float] | None = None,
        system_config: SystemConfig | None = None,
        join: RayCluster | None = None,
        command_prefix: list[str] | None = None,
    ) -> None:
        if auth not in ("token", "disabled"):
            raise ValueError(f"auth must be 'token' or 'disabled', got {auth!r}")
        if object_store_mb < _MIN_OBJECT_STORE_MB:
            raise ValueError(
                f"object_store_mb must be >= {_MIN_OBJECT_STORE_MB} (Ray's minimum is 75 MiB), "
                f"got {object_store_mb}"
            )
        self.num_cpus = num_cpus if num_cpus is not None else _usable_cpus()
        self.num_gpus = num_gpus
        self.object_store_mb = object_store_mb
        self.dashboard = dashboard
        self.auth = auth
        self.start_timeout = start_timeout
        self.stop_timeout = stop_timeout
        self.use_ray_address = use_ray_address
        self.keep_temp_dir = keep_temp_dir
        self.extra_env = dict(extra_env or {})
        self.resources = dict(resources or {})
        self.system_config = dict(system_config or {})
        self.join = join
        self.command_prefix = list(command_prefix or [])
        if join is not None and (system_config or dashboard):
            raise ValueError("a worker node (join=...) takes neither system_config nor a dashboard: "
                             "both belong to the head")
        self.cluster: RayCluster | None = None
        self.start_s: float | None = None
        self.stop_s: float | None = None
        #: pids (with names) that survived SIGTERM and had to be SIGKILLed, then any that
        #: survived even that (the latter should always be empty)
        self.killed: list[str] = []
        self.leftover: list[str] = []
        self._popen: subprocess.Popen[bytes] | None = None
        self._temp_dir: Path | None = None
        self._ports: list[PortReservation] = []
        self._seen: dict[int, psutil.Process] = {}

    # -- context manager ---------------------------------------------------------------------

    def __enter__(self) -> RayCluster:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # -- start -------------------------------------------------------------------------------

    def start(self) -> RayCluster:
        """Start the head (or attach to ``RAY_ADDRESS``) and return where it is."""
        if self.cluster is not None and (not self.cluster.owned or self._popen is not None):
            return self.cluster  # already running (a stopped head is started afresh)
        if self.use_ray_address and self.join is None:
            external = external_cluster()
            if external is not None:
                self.cluster = external
                return external
        t0 = time.monotonic()
        try:
            self.cluster = self._start_head()
        except BaseException:
            self.stop()  # Ctrl-C or a failed start leaves nothing running
            raise
        self.start_s = time.monotonic() - t0
        atexit.register(self.stop)
        return self.cluster

    def _start_head(self) -> RayCluster:
        self._temp_dir = Path(tempfile.mkdtemp(prefix="tg-ray-", dir="/tmp"))
        names = ["gcs", "object_manager", "node_manager", "client_server", "dashboard",
                 "agent_listen", "agent_grpc", "runtime_env_agent", "metrics"]  # fmt: skip
        self._ports = [reserve_port("127.0.0.1") for _ in names]
        port = {name: res.port for name, res in zip(names, self._ports)}
        if self.join is not None:
            token = self.join.auth_token
            role = ["--address", self.join.address]
        else:
            token = secrets.token_hex(24) if self.auth == "token" else None
            role = ["--head", "--port", str(port["gcs"]),
                    "--ray-client-server-port", str(port["client_server"])]

        argv = [
            *self.command_prefix, *_ray_cli(), "start", *role, "--block",
            "--node-ip-address", "127.0.0.1",
            "--object-manager-port", str(port["object_manager"]),
            "--node-manager-port", str(port["node_manager"]),
            "--dashboard-agent-listen-port", str(port["agent_listen"]),
            "--dashboard-agent-grpc-port", str(port["agent_grpc"]),
            "--runtime-env-agent-port", str(port["runtime_env_agent"]),
            "--metrics-export-port", str(port["metrics"]),
            # 0: workers bind OS-chosen ports (Ray's fixed default range would clash between
            # two heads on one machine)
            "--min-worker-port", "0", "--max-worker-port", "0",
            "--temp-dir", str(self._temp_dir),
            "--num-cpus", str(self.num_cpus),
            "--object-store-memory", str(self.object_store_mb * 1024 * 1024),
            "--disable-usage-stats",
        ]  # fmt: skip
        if self.join is None:
            argv += ["--include-dashboard", "true" if self.dashboard else "false"]
        if self.resources:
            argv += ["--resources", json.dumps(self.resources)]
        if self.system_config:
            argv += ["--system-config", json.dumps(self.system_config)]
        if self.dashboard:
            argv += ["--dashboard-host", "127.0.0.1", "--dashboard-port", str(port["dashboard"])]
        if self.num_gpus is not None:
            argv += ["--num-gpus", str(self.num_gpus)]

        env = self.head_env(self._temp_dir, token)
        log_path = self._temp_dir / "ray-start.log"
        with open(log_path, "wb") as log, signals_deferred():  # never a head without its Popen
            self._popen = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=self._temp_dir,
                start_new_session=True,  # own process group: one signal reaches every process
            )
        gcs = self.join.address if self.join is not None else f"127.0.0.1:{port['gcs']}"
        jobs = f"http://127.0.0.1:{port['dashboard']}" if self.dashboard else None
        cluster = RayCluster(
            address=gcs,
            jobs_address=jobs,
            owned=True,
            auth_token=token,
            temp_dir=self._temp_dir,
            num_cpus=self.num_cpus,
            num_gpus=self.num_gpus,
        )
        self._wait_ready(cluster, log_path)
        return cluster

    def head_env(self, temp_dir: Path, token: str | None) -> dict[str, str]:
        """The environment of the ``ray start`` process, which every process of the head
        inherits: this process's, without ``RAY_ADDRESS`` and Ray auth settings, plus the
        head's own (temp dir marker, auth token, usage stats off, no drain wait), the
        :data:`~trainguard.raytrain.RAY_TRAIN_DEFAULTS` this environment does not set, and
        ``extra_env``."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
        for key in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS"):
            env.pop(key, None)
        venv_bin = str(Path(sys.executable).parent)
        env.update(
            # job entrypoints run `python`/`torchrun` from this interpreter's environment
            PATH=os.pathsep.join([venv_bin, env.get("PATH", os.defpath)]),
            # inherited by every process of the head (workers rename themselves ray::IDLE, so
            # their command line no longer names the temp dir): how stop() finds them all
            RAY_USAGE_STATS_ENABLED="0",
            RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S="0",  # a test head has nothing to drain
            RAY_AUTH_MODE="token" if token else "disabled",
        )
        env[envvars.RAY_HEAD] = str(temp_dir)
        if token:
            env["RAY_AUTH_TOKEN"] = token
        # Ray Train's pace for short fits (a Ray Job's driver on this head gets it too); a
        # driver's own value still wins: Ray Train hands the driver's to its controller and workers
        env.update(ray_train_defaults(env))
        env.update(self.extra_env)
        return env

    def _wait_ready(self, cluster: RayCluster, log_path: Path) -> None:
        assert self._popen is not None
        deadline = time.monotonic() + self.start_timeout
        started = False
        while time.monotonic() < deadline:
            self._remember_processes()
            code = self._popen.poll()
            if code is not None:
                raise RayStartError(
                    f"`ray start --head` exited with code {code} before the head was ready.\n"
                    f"Its log ({log_path}):\n{_tail(log_path)}"
                )
            if not started:
                started = b"Ray runtime started" in log_path.read_bytes()
            if started and (cluster.jobs_address is None or _jobs_api_ready(cluster)):
                return
            time.sleep(0.25)
        raise RayStartError(
            f"the local Ray head was not ready within {self.start_timeout:.0f} s "
            f"(a busy machine needs more: LocalRay(start_timeout=...)).\n"
            f"Its log ({log_path}):\n{_tail(log_path)}"
        )

    @property
    def running(self) -> bool:
        """True while the ``ray start --block`` process this object started runs (False once it
        was stopped, or exited: a worker node whose raylet died takes its node down with it)."""
        return self._popen is not None and self._popen.poll() is None

    # -- stop --------------------------------------------------------------------------------

    def stop(self) -> None:
        """Stop every process of the head, verify none is left, release its ports.

        Idempotent; a no-op for an attached ``RAY_ADDRESS`` cluster. Leftovers (which should
        never happen) are SIGKILLed and listed in :attr:`leftover`.
        """
        popen = self._popen
        if popen is None:
            self._release()
            return
        t0 = time.monotonic()
        try:
            self._remember_processes()
            with contextlib.suppress(ProcessLookupError, PermissionError):
                if self.command_prefix:  # `unshare --fork` ignores SIGTERM: its group gets it
                    os.killpg(popen.pid, signal.SIGTERM)
                else:
                    popen.send_signal(signal.SIGTERM)  # the leader stops its children gracefully
            with contextlib.suppress(subprocess.TimeoutExpired):
                popen.wait(timeout=self.stop_timeout)
            alive = [p for p in self._seen.values() if _running(p)]
            _, alive = psutil.wait_procs(alive, timeout=5.0)
            survivors = list({p.pid: p for p in [*alive, *self._owned_now()]}.values())
            if survivors or popen.poll() is None:
                self.killed = [_describe(p) for p in survivors]
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(popen.pid, signal.SIGKILL)
                for proc in survivors:
                    with contextlib.suppress(psutil.Error):
                        proc.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    popen.wait(timeout=5.0)
                psutil.wait_procs(survivors, timeout=5.0)
            self.leftover = [_describe(p) for p in self._owned_now()]
            self._popen = None
        finally:
            self.stop_s = time.monotonic() - t0
            if self._popen is None:  # done; an interrupted stop is finished again at exit
                self._release()
                atexit.unregister(self.stop)

    def _release(self) -> None:
        for res in self._ports:
            res.release()
        self._ports = []
        temp, self._temp_dir = self._temp_dir, None
        if temp is not None and not self.keep_temp_dir and not self.leftover:
            shutil.rmtree(temp, ignore_errors=True)

    # -- process bookkeeping -----------------------------------------------------------------

    def _remember_processes(self) -> None:
        """Record every descendant of the leader: Ray workers rename themselves (``ray::IDLE``)
        and job entrypoints may start new sessions, so neither the process group nor the
        command line alone finds them all at stop time."""
        if self._popen is None:
            return
        try:
            leader = psutil.Process(self._popen.pid)
            procs = [leader, *leader.children(recursive=True)]
        except psutil.Error:
            return
        for proc in procs:
            self._seen.setdefault(proc.pid, proc)

    def _owned_now(self) -> list[psutil.Process]:
        """Live processes that are ours: seen descendants still running, plus any process whose
        command line names our temp dir (a process forked after the last snapshot)."""
        owned = {p.pid: p for p in self._seen.values() if _running(p)}
        if self._temp_dir is not None:
            for proc in running_ray_processes(self._temp_dir):
                owned.setdefault(proc.pid, proc)
        return [p for p in owned.values() if _running(p)]

    def memory_mb(self) -> float:
        """Proportional set size (PSS) of the head's processes in MiB (0 when not ours)."""
        self._remember_processes()
        total = 0
        for proc in self._seen.values():
            with contextlib.suppress(psutil.Error):
                info = proc.memory_full_info()
                total += getattr(info, "pss", info.rss)
        return total / 2**20


def _usable_cpus() -> int:
    """CPUs this process may run on (the affinity mask, not the host's count)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _ray_cli() -> list[str]:
    """The ``ray`` CLI of this interpreter's environment (never another one on PATH)."""
    beside = Path(sys.executable).with_name("ray")
    if beside.exists():
        return [str(beside)]
    return [sys.executable, "-m", "ray.scripts.scripts"]


def _jobs_api_ready(cluster: RayCluster) -> bool:
    """True once the dashboard's job module answers (it starts after the dashboard itself)."""
    assert cluster.jobs_address is not None
    request = urllib.request.Request(
        f"{cluster.jobs_address}/api/jobs/", headers=cluster.auth_headers()
    )
    try:
        with urllib.request.urlopen(request, timeout=2.0) as response:
            json.loads(response.read() or b"[]")
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError, ValueError):
        return False


def _running(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _describe(proc: psutil.Process) -> str:
    try:
        return f"{proc.pid} {proc.name()}"
    except psutil.Error:
        return str(proc.pid)


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"
