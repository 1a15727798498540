"""``network``: a Toxiproxy toxic (or the proxy going down) on the job's TCP connections to a service.

The job's traffic to a service goes through a proxy that speaks the Toxiproxy HTTP API: a real
Toxiproxy when ``TOXIPROXY_URL`` is set (staging), trainguard's embedded one otherwise
(:mod:`trainguard.faults.toxiproxy`). After step ``after_step`` the toxic is added -- it applies to
the connections already open too -- and :meth:`NetworkFault.clear` removes it.

Targets:

* ``service: mlflow`` -- trainguard starts a real ``mlflow server`` on loopback (sqlite store in the
  drill's work dir, its own process group, all of which is stopped in teardown), puts the proxy in
  front and points the job's ``MLFLOW_TRACKING_URI`` at the proxy. For a ``kind: ray_train`` job
  it also creates the drill's run on that server and points the Ray workers' designated writer
  (:mod:`trainguard.raytrain.tracking`) at it through the proxy: ``TRAINGUARD_MLFLOW_TRACKING_URI``,
  ``TRAINGUARD_MLFLOW_RUN_ID`` and ``TRAINGUARD_TRACKING=on`` (the drill's runs only; they win
  over the session's own tracking environment, which may be off);
* ``upstream: host:port`` -- any service the job reaches; the proxied ``host:port`` is given to the
  job in the environment variable named by ``env`` (default ``TRAINGUARD_PROXY_ADDR``) and is
  :meth:`NetworkFault.placeholders` ``proxy_addr`` for job files.

``down: true`` disables the proxy instead of adding a toxic: its listener closes and open
connections are dropped until the fault is cleared. See docs/faults-network.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, ClassVar

from trainguard._internal import envvars
from trainguard._internal.envvars import MLFLOW_RUN_ID, MLFLOW_TRACKING_URI
from trainguard._internal.signals import signals_deferred
from trainguard.config.fault_params import FaultParams
from trainguard.config.faults import Expectation
from trainguard.errors import UsageError
from trainguard.evidence import UNSET
from trainguard.faults.base import Fault, FaultContext, FaultUnavailable
from trainguard.faults.network_evidence import NetworkEvidence, RayWriterCheck
from trainguard.faults.toxiproxy.addresses import format_hostport, split_hostport
from trainguard.faults.toxiproxy.client import (
    TOXIPROXY_URL_ENV,
    ToxiproxyClient,
    ToxiproxyError,
    open_toxiproxy,
)
from trainguard.faults.toxiproxy.toxics import DIRECTIONS, TOXIC_ATTRIBUTES
from trainguard.launch.backend import CommandBackend, JobBackend
from trainguard.launch.procs import group_alive

if TYPE_CHECKING:  # pragma: no cover
    from trainguard.launch import Launcher, RunResult

__all__ = ["RAY_WRITER_ENV", "SERVICES", "LocalMlflowServer", "NetworkFault"]

#: services trainguard can host behind the proxy
SERVICES = ("mlflow",)
#: what ``service: mlflow`` adds for a job whose ranks log their own metrics (a ``ray_train``
#: job: the Ray workers' designated writer logs into the drill's run through the proxy)
RAY_WRITER_ENV = (MLFLOW_TRACKING_URI, MLFLOW_RUN_ID, "TRAINGUARD_TRACKING")
#: the experiment the drill's run is created in (on the drill's own MLflow server)
DRILL_EXPERIMENT = "trainguard-drills"

_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_MLFLOW_STARTUP_S = 180.0


class LocalMlflowServer:
    """A real ``mlflow server`` on 127.0.0.1 with a sqlite store under ``root``.

    It runs in its own session (process group): MLflow's server leaves huey consumer processes
    behind when only its main process is stopped, so :meth:`stop` signals the whole group and waits
    until no process of it is left.
    """

    def __init__(self, root: Path, *, startup_timeout: float = _MLFLOW_STARTUP_S) -> None:
        self.root = Path(root)
        self.startup_timeout = startup_timeout
        self.port: int | None = None
        self.popen: subprocess.Popen[bytes] | None = None
        self.started_in_s: float | None = None
        self._reservation: Any = None
        self._log: IO[bytes] | None = None

    @property
    def address(self) -> str:
        return format_hostport("127.0.0.1", self.port or 0)

    @property
    def url(self) -> str:
        return f"http://{self.address}"

    @property
    def log_path(self) -> Path:
        return self.root / "mlflow-server.log"

    def start(self) -> LocalMlflowServer:
        """Start the server and wait until ``/health`` answers (FaultUnavailable otherwise)."""
        if importlib.util.find_spec("mlflow") is None:
            raise FaultUnavailable(
                "the network fault's `service: mlflow` needs MLflow in the job's environment: "
                "pip install 'trainguard[tracking]'"
            )
        from trainguard.launch.ports import reserve_port

        self.root.mkdir(parents=True, exist_ok=True)
        self._reservation = reserve_port()
        self.port = self._reservation.port
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        started = time.monotonic()
        try:
            with signals_deferred():  # a signal inside Popen would leave a server stop() never sees
                self.popen = subprocess.Popen(
                    [sys.executable, "-m", "mlflow", "server",
                     "--backend-store-uri", f"sqlite:///{self.root / 'mlflow.db'}",
                     "--artifacts-destination", str(self.root / "mlartifacts"),
                     "--host", "127.0.0.1", "--port", str(self.port), "--workers", "1"],
                    cwd=self.root, stdout=self._log, stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL, start_new_session=True,
                    # MLflow's job runner (huey consumers) serves no tracking call: 8 fewer processes
                    # and a start several times faster; a user's own setting wins
                    env={"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", **os.environ},
                )
            deadline = started + self.startup_timeout
            while not self._healthy():
                if self.popen.poll() is not None or time.monotonic() > deadline:
                    why = (f"exited with code {self.popen.returncode}"
                           if self.popen.poll() is not None
                           else f"did not answer within {self.startup_timeout:g} s")
                    raise FaultUnavailable(
                        f"the MLflow server for the network fault {why}; its log "
                        f"({self.log_path}) ends with:\n{self._log_tail()}"
                    )
                time.sleep(0.2)
        except BaseException:
            self.stop()
            raise
        self.started_in_s = time.monotonic() - started
        return self

    def _api(self, endpoint: str, body: dict[str, Any]) -> Any:
        request = urllib.request.Request(
            f"{self.url}/api/2.0/mlflow/{endpoint}", data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=10) as resp:
            return json.loads(resp.read())

    def _get(self, endpoint: str, **query: str) -> Any:
        url = f"{self.url}/api/2.0/mlflow/{endpoint}?{urllib.parse.urlencode(query)}"
        with urllib.request.urlopen(url, timeout=10) as resp:
            return json.loads(resp.read())

    def create_run(self, run_name: str, experiment: str = DRILL_EXPERIMENT) -> str:
        """A new run in ``experiment`` (created when missing), made on the server directly, not
        through the proxy; returns its id."""
        try:
            experiment_id = self._api("experiments/create", {"name": experiment})["experiment_id"]
        except urllib.error.HTTPError as exc:
            if exc.code != 400:  # RESOURCE_ALREADY_EXISTS
                raise
            experiment_id = self._get("experiments/get-by-name",
                                      experiment_name=experiment)["experiment"]["experiment_id"]
        run = self._api("runs/create", {
            "experiment_id": experiment_id, "run_name": run_name,
            "start_time": int(time.time() * 1000),
            "tags": [{"key": "trainguard.kind", "value": "drill"}],
        })
        return str(run["run"]["info"]["run_id"])

    def end_run(self, run_id: str, status: str = "FINISHED") -> None:
        """Mark ``run_id`` ended (the drill is over)."""
        self._api("runs/update", {"run_id": run_id, "status": status,
                                  "end_time": int(time.time() * 1000)})

    def _history(self, run_id: str, key: str) -> set[int]:
        history = self._get("metrics/get-history", run_id=run_id, metric_key=key,
                            max_results="100000")
        return {int(m.get("step", 0)) for m in history.get("metrics", [])}

    def run_steps(self, run_id: str) -> dict[str, set[int]]:
        """Metric key -> every step logged for it in the run ``run_id``."""
        run = self._get("runs/get", run_id=run_id)["run"]
        return {m["key"]: self._history(run_id, m["key"])
                for m in run.get("data", {}).get("metrics", [])}

    def logged_steps(self) -> dict[str, set[int]]:
        """Metric key -> every step logged for it, over all runs of all experiments."""
        experiments = self._api("experiments/search", {"max_results": 1000}).get("experiments", [])
        ids = [e["experiment_id"] for e in experiments]
        steps: dict[str, set[int]] = {}
        token = None
        while ids:
            body: dict[str, Any] = {"experiment_ids": ids, "max_results": 1000}
            if token:
                body["page_token"] = token
            answer = self._api("runs/search", body)
            for run in answer.get("runs", []):
                run_id = run["info"]["run_id"]
                for metric in run.get("data", {}).get("metrics", []):
                    steps.setdefault(metric["key"], set()).update(
                        self._history(run_id, metric["key"]))
            token = answer.get("next_page_token")
            if not token:
                break
        return steps

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as resp:
                return bool(resp.status == 200)
        except OSError:
            return False

    def _log_tail(self, chars: int = 2000) -> str:
        if self._log is not None:
            self._log.flush()
        with contextlib.suppress(OSError):
            return self.log_path.read_text(errors="replace")[-chars:]
        return "(no log)"

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the server's whole process group (idempotent)."""
        popen, self.popen = self.popen, None
        if popen is not None:
            pgid = popen.pid  # start_new_session: the server leads its own group
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, signal.SIGTERM)
            deadline = time.monotonic() + timeout
            while group_alive(pgid) and time.monotonic() < deadline:
                popen.poll()  # reap the leader, or the group never looks empty
                time.sleep(0.05)
            if group_alive(pgid):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pgid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):  # SIGKILL cannot be ignored
                popen.wait(timeout)
        if self._reservation is not None:
            self._reservation.release()
            self._reservation = None
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> LocalMlflowServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _printed_steps(result: RunResult) -> dict[str, dict[int, set[int]]]:
    """Metric name -> rank -> the steps the job printed."""
    printed: dict[str, dict[int, set[int]]] = {}
    for point in result.points:
        printed.setdefault(point.name, {}).setdefault(point.rank, set()).add(point.step)
    return printed


def _missing(printed: dict[str, dict[int, set[int]]],
             stored: Mapping[str, set[int]]) -> list[tuple[str, set[int], list[int]]]:
    """(name, steps printed by the lowest rank that printed it, those not stored) per metric
    with missing steps."""
    out = []
    for name, by_rank in sorted(printed.items()):
        steps = by_rank[min(by_rank)]
        missing = sorted(steps - stored.get(name, set()))
        if missing:
            out.append((name, steps, missing))
    return out


def _shown(steps: list[int]) -> str:
    return ", ".join(map(str, steps[:10])) + (" ..." if len(steps) > 10 else "")


#: the largest toxic attribute (Toxiproxy's attributes are 32-bit integers)
_MAX_ATTRIBUTE = 2**31 - 1


def _brief(value: Any, limit: int = 60) -> str:
    """``repr(value)`` cut to ``limit`` characters: a value in an error message, not all of it."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def _toxic_problems(toxic: Any, down: Any) -> list[tuple[str, str]]:
    """What the fault does to the connections: a toxic Toxiproxy knows, or ``down: true``,
    exactly one of them."""
    problems = []
    if not isinstance(down, bool):
        problems.append(("down", f"expected true or false, got {down!r}"))
    if down and toxic is not None:
        problems.append(("toxic", "give either `toxic` (a toxic on the connections) or "
                         "`down: true` (the proxy disabled), not both"))
    elif not down and toxic is None:
        problems.append(("toxic", "missing: name the toxic, one of "
                         f"{', '.join(t for t in TOXIC_ATTRIBUTES if t != 'noop')}, "
                         "e.g. `toxic: latency, attributes: {latency: 500}`; or set `down: true`"))
    elif toxic is not None and (not isinstance(toxic, str) or toxic not in TOXIC_ATTRIBUTES):
        problems.append(("toxic", f"unknown toxic {_brief(toxic)}; expected one of "
                         f"{', '.join(TOXIC_ATTRIBUTES)}"))
    return problems


def _attribute_problems(toxic: Any, attributes: Any) -> list[tuple[str, str]]:
    """The toxic's ``attributes``: a mapping of the toxic's own attributes (checked once the
    toxic is one Toxiproxy knows), each an integer in range."""
    if not isinstance(attributes, Mapping):
        return [("attributes", f"expected a mapping of attribute: integer, got {attributes!r}")]
    if not isinstance(toxic, str) or toxic not in TOXIC_ATTRIBUTES:
        return []
    problems = []
    known = TOXIC_ATTRIBUTES[toxic]
    for key, value in attributes.items():
        if key not in known:
            problems.append((f"attributes.{key}", f"not an attribute of the {toxic} "
                             f"toxic; expected {', '.join(known) or '(none)'}"))
        elif not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= _MAX_ATTRIBUTE:
            problems.append((f"attributes.{key}", f"expected an integer from 0 to {_MAX_ATTRIBUTE} "
                             f"(ms, bytes or KB/s: see docs/faults-network.md), got {_brief(value)}"))
    return problems


def _endpoint_problems(service: Any, upstream: Any, env: Any, listen: Any) -> list[tuple[str, str]]:
    """The proxy's two ends: exactly one target (a service trainguard hosts, or the job's own
    ``host:port``), the variable that gives the job the proxy's address, and where it listens."""
    problems = []
    if (service is None) == (upstream is None):
        problems.append(("service", "give exactly one target: `service: mlflow` (trainguard "
                         "hosts it) or `upstream: host:port` (a service your job reaches)"))
    if service is not None and service not in SERVICES:
        problems.append(("service", f"unknown service {service!r}; expected one of "
                         f"{', '.join(SERVICES)}, or use `upstream: host:port`"))
    if upstream is not None:
        try:
            split_hostport(str(upstream))
        except ValueError:
            problems.append(("upstream", f"expected host:port, e.g. 127.0.0.1:6379, got "
                             f"{upstream!r}"))
    if not isinstance(env, str) or not _ENV_NAME.match(env):
        problems.append(("env", f"expected an environment variable name, got {env!r}"))
    if listen is not None:
        try:
            if not isinstance(listen, str):
                raise ValueError(listen)
            split_hostport(listen)
        except ValueError:
            problems.append(("listen", "expected host:port where the proxy listens, e.g. "
                             f"10.0.0.5:0 (this machine's address, any port), got {_brief(listen)}"))
    return problems


class NetworkFault(Fault):
    """A toxic on the job's connections to a service, through a Toxiproxy-compatible proxy."""

    kind: ClassVar[str] = "network"
    expectations: ClassVar[tuple[Expectation, ...]] = (Expectation.CONTINUE, Expectation.RECOVER, Expectation.FAIL_CLEAN)
    defaults: ClassVar[FaultParams] = FaultParams({
        "toxic": None,  # latency, bandwidth, slow_close, timeout, reset_peer, slicer, limit_data
        "attributes": {},
        "stream": "downstream",
        "toxicity": 1.0,
        "service": None,  # "mlflow"
        "upstream": None,  # "host:port"
        "env": envvars.PROXY_ADDR,
        "down": False,
        # where the proxy listens; another than loopback (this machine's LAN address) lets ranks
        # on other hosts reach it, and is allowed on the embedded server for this drill only
        "listen": None,
    })

    def __init__(self, params: FaultParams | None = None, **kwargs: Any) -> None:
        super().__init__(params, **kwargs)
        self.client: ToxiproxyClient | None = None
        self.mlflow: LocalMlflowServer | None = None
        self.proxy_name = f"trainguard-{uuid.uuid4().hex[:10]}"
        self.proxy_address: str | None = None
        self.upstream_address: str | None = None
        self.toxic_name: str | None = None
        self.toxic_answer: dict[str, Any] | None = None
        self.server_version: str | None = None
        self.inject_api_ms: float | None = None
        self.errors: list[str] = []
        #: ``service: mlflow`` on a ``ray_train`` job: the run the workers' writer logs into
        self.drill_run_id: str | None = None
        #: what :meth:`verify_continue` found for a ``ray_train`` job (the writer, the run's steps)
        self.ray_writer = RayWriterCheck()
        self._launcher: Launcher | None = None
        #: how the job's ranks run (set at :meth:`setup`): where the writer's record is
        self.backend: JobBackend = CommandBackend()
        self._stack = contextlib.ExitStack()
        self._active = False

    # -- validation ---------------------------------------------------------------------------

    @classmethod
    def validate(cls, params: FaultParams) -> list[tuple[str, str]]:
        problems = super().validate(params)
        p = params.over(cls.defaults)
        problems += _toxic_problems(p.raw("toxic"), p.raw("down"))
        problems += _attribute_problems(p.raw("toxic"), p.raw("attributes"))
        if str(p.raw("stream")).lower() not in DIRECTIONS:
            problems.append(("stream", f"expected upstream or downstream, got {p.raw('stream')!r}"))
        toxicity = p.raw("toxicity")
        if (not isinstance(toxicity, (int, float)) or isinstance(toxicity, bool)
                or not 0 <= toxicity <= 1):  # no float(): a 400-digit int would overflow
            problems.append(("toxicity", f"expected a number from 0 to 1, got {_brief(toxicity)}"))
        problems += _endpoint_problems(p.raw("service"), p.raw("upstream"), p.raw("env"), p.raw("listen"))
        return problems

    # -- the contract -------------------------------------------------------------------------

    def setup(self, ctx: FaultContext) -> None:
        """Start (or reach) the Toxiproxy server, the MLflow service if asked, and the proxy."""
        problems = self.validate(FaultParams({k: self.params.raw(k) for k in self.params if k in self.defaults}))
        if problems:
            raise UsageError("invalid network fault parameters: "
                             + "; ".join(f"{key}: {message}" for key, message in problems))
        self.backend = ctx.backend
        try:
            listen = self.params.optional_text("listen")
            self.client = self._stack.enter_context(
                open_toxiproxy(allow_remote_listen=listen is not None))
            self.server_version = str(self.client.version().get("version"))
            if self.params.optional_text("service") == "mlflow":
                self.mlflow = LocalMlflowServer(Path(ctx.work_dir) / "mlflow")
                self._stack.callback(self.mlflow.stop)
                self.mlflow.start()
                self.upstream_address = self.mlflow.address
            else:
                self.upstream_address = self.params.text("upstream")
            proxy = self.client.create_proxy(self.proxy_name, self.upstream_address,
                                             listen=listen or "127.0.0.1:0")
            self._stack.callback(self._delete_proxy)
            self.proxy_address = self.client.proxy_address(proxy)
            if self.mlflow is not None and ctx.backend.ranks_log_metrics():
                self._create_drill_run(ctx)
        except ToxiproxyError as exc:
            self.teardown()
            raise FaultUnavailable(f"the network fault's proxy could not be set up: {exc}") from None
        except BaseException:
            self.teardown()
            raise

    def _create_drill_run(self, ctx: FaultContext) -> None:
        """The run a ``ray_train`` job's designated writer logs into during the drill."""
        assert self.mlflow is not None
        mlflow = self.mlflow
        try:
            self.drill_run_id = mlflow.create_run(f"drill-{Path(ctx.work_dir).parent.name}")
        except (OSError, ValueError, KeyError) as exc:
            raise FaultUnavailable(f"the network fault could not create the drill's run on its "
                                   f"MLflow server ({mlflow.url}): {exc}") from None
        run_id = self.drill_run_id

        def end() -> None:  # before the server stops (the stack unwinds in reverse)
            with contextlib.suppress(OSError, ValueError):
                mlflow.end_run(run_id)

        self._stack.callback(end)

    def placeholders(self) -> dict[str, str]:
        """``{proxy_addr}`` for a job file's command or env (available after :meth:`setup`)."""
        return {"proxy_addr": self.proxy_address or ""}

    def launch_env(self, ctx: FaultContext) -> dict[str, str]:
        if self.proxy_address is None:
            return {}
        if self.params.optional_text("service") == "mlflow":
            url = f"http://{self.proxy_address}"
            env = {"MLFLOW_TRACKING_URI": url}
            if self.drill_run_id is not None:
                # a ray_train job: its workers' designated writer logs through the proxy into the
                # drill's run, even when the session's tracking is off (the runner lets this win
                # over its own tracking environment)
                env.update(dict(zip(RAY_WRITER_ENV, (url, self.drill_run_id, "on"), strict=True)))
            return env
        return {self.params.text("env"): self.proxy_address}

    def inject(self, launcher: Launcher) -> None:
        """Add the toxic (or disable the proxy): one API call on loopback, a few ms."""
        if self.client is None:
            raise FaultUnavailable("NetworkFault.inject() before setup()")
        self._launcher = launcher
        started = time.monotonic()
        try:
            if self.params.flag("down"):
                self.client.set_enabled(self.proxy_name, False)
            else:
                stream, toxic = self.params.text("stream"), self.params.text("toxic")
                self.toxic_name = f"trainguard_{toxic}_{stream}"
                self.toxic_answer = self.client.add_toxic(
                    self.proxy_name, toxic, self._attributes(),
                    stream=stream, toxicity=float(self.params.number("toxicity")), name=self.toxic_name,
                )
        except ToxiproxyError as exc:
            self.errors.append(f"inject: {exc}")
            raise
        self.inject_api_ms = (time.monotonic() - started) * 1000
        self.injected_at = launcher.elapsed()
        self._active = True

    def clear(self) -> None:
        """Remove the toxic (or enable the proxy again); idempotent."""
        if not self._active or self.client is None:
            return
        self._active = False
        try:
            if self.params.flag("down"):
                self.client.set_enabled(self.proxy_name, True)
            elif self.toxic_name is not None:
                self.client.remove_toxic(self.proxy_name, self.toxic_name)
        except ToxiproxyError as exc:
            self.errors.append(f"clear: {exc}")
            raise
        finally:
            if self._launcher is not None:
                self.cleared_at = self._launcher.elapsed()

    def teardown(self) -> None:
        """Delete the proxy, stop the MLflow server and the embedded Toxiproxy (never raises)."""
        self._active = False
        try:
            self._stack.close()
        except Exception as exc:  # teardown must not mask the drill's own outcome
            self.errors.append(f"teardown: {exc}")
        self._stack = contextlib.ExitStack()

    def _delete_proxy(self) -> None:
        if self.client is not None:
            with contextlib.suppress(ToxiproxyError):
                self.client.delete_proxy(self.proxy_name)

    # -- reporting ----------------------------------------------------------------------------

    def _attributes(self) -> dict[str, Any]:
        """The toxic's attributes, as the drill gave them (a mapping: :meth:`validate` says so)."""
        attributes = self.params.raw("attributes")
        return dict(attributes) if isinstance(attributes, Mapping) else {}

    def _target(self) -> str:
        if self.params.raw("service"):
            return f"the {self.params.raw('service')} server"
        return f"upstream {self.params.raw('upstream')}"

    def _what(self) -> str:
        if self.params.flag("down"):
            return "proxy-down"
        attrs = ", ".join(f"{k}={v}" for k, v in self._attributes().items())
        return f"{self.params.raw('toxic')}({attrs}) {self.params.raw('stream')}"

    def evidence(self) -> NetworkEvidence:
        client = self.client
        server = None
        if client is not None:
            server = ("embedded (trainguard)" if client.started_here
                      else f"real Toxiproxy at {client.url} (from {TOXIPROXY_URL_ENV})")
        return NetworkEvidence(
            *self.struck(),
            toxic=None if self.params.flag("down") else self.params.optional_text("toxic"),
            down=self.params.flag("down"),
            attributes=self._attributes(),
            stream=self.params.text("stream"),
            toxicity=self.params.number("toxicity"),
            target=self._target(),
            upstream=self.upstream_address,
            proxy=self.proxy_address,
            toxiproxy=server,
            toxiproxy_version=self.server_version,
            toxic_applied=self.toxic_answer,
            inject_api_ms=None if self.inject_api_ms is None else round(self.inject_api_ms, 2),
            mlflow_started_in_s=(None if self.mlflow is None or self.mlflow.started_in_s is None
                                 else round(self.mlflow.started_in_s, 2)),
            drill_run_id=self.drill_run_id or UNSET,
            ray_writer=dataclasses.replace(self.ray_writer) if self.ray_writer != RayWriterCheck() else UNSET,
            errors=list(self.errors),
        )

    def verify_continue(self, result: RunResult) -> list[str]:
        """For ``service: mlflow``: every step of every metric the job printed (on the lowest
        rank that printed it) must be in the MLflow store, in some run -- logged through the
        proxy during or after the fault, nothing dropped. Read from the server directly. For a
        ``ray_train`` job: in the drill's run, and the workers' writer must have run and dropped
        no row (:meth:`writer_problems`)."""
        if self.mlflow is None or self.mlflow.port is None:
            return []
        if self.drill_run_id is not None:
            return self._verify_ray_writer(result)
        printed = _printed_steps(result)
        try:
            stored = self.mlflow.logged_steps()
        except (OSError, ValueError) as exc:
            return [f"the MLflow store at {self.mlflow.url} could not be read to check that every "
                    f"metric arrived: {exc}"]
        if printed and not stored:
            return [f"the job logged no metric to MLflow (MLFLOW_TRACKING_URI=http://"
                    f"{self.proxy_address}): nothing arrived in the tracking store"]
        return [f"{len(missing)} of {len(steps)} steps of metric {name!r} printed by the job never "
                f"reached the MLflow store (steps {_shown(missing)})"
                for name, steps, missing in _missing(printed, stored)]

    def writer_problems(self, result: RunResult) -> list[str]:
        """A ``ray_train`` job: what the workers' designated writer recorded (its summary in the
        attempt's run directory, or its line on the driver's stderr) -- it must have run, logged
        into the drill's run and dropped nothing. Fills :attr:`ray_writer`."""
        summary, where = self.backend.writer_record(result)
        if summary is None:
            self.ray_writer.writer = None
            return [f"the Ray workers' designated MLflow writer (world rank 0) never ran: {where} "
                    "(mlflow missing in the workers? the workers' environment "
                    "without TRAINGUARD_MLFLOW_RUN_ID?)"]
        self.ray_writer.writer = {k: v for k, v in summary.to_dict().items()
                                     if k not in ("written_steps", "dropped_steps")}
        problems = []
        if summary.run_id and summary.run_id != self.drill_run_id:
            problems.append(f"the Ray workers' writer logged into run {summary.run_id}, not the "
                            f"drill's run {self.drill_run_id}")
        if summary.dropped_rows:
            steps = sorted(summary.dropped_steps)
            problems.append(f"the Ray workers' writer dropped {summary.dropped_rows} metric row(s) "
                            f"of {len(steps)} step(s) (steps {_shown(steps)}): "
                            f"{summary.reason or 'no reason recorded'}")
        return problems

    def _verify_ray_writer(self, result: RunResult) -> list[str]:
        """``service: mlflow`` on a ``ray_train`` job: the writer ran and dropped nothing, and
        every reported step of every metric is in the drill's run (read from the server)."""
        assert self.mlflow is not None and self.drill_run_id is not None
        problems = self.writer_problems(result)
        printed = _printed_steps(result)
        try:
            stored = self.mlflow.run_steps(self.drill_run_id)
        except (OSError, ValueError, KeyError) as exc:
            return [*problems, f"the drill's MLflow run {self.drill_run_id} at {self.mlflow.url} "
                    f"could not be read to check that every metric arrived: {exc}"]
        self.ray_writer.stored_steps = {k: len(v) for k, v in sorted(stored.items())}
        self.ray_writer.reported_steps = {k: len(v[min(v)]) for k, v in sorted(printed.items())}
        problems += [f"{len(missing)} of {len(steps)} steps of metric {name!r} reported by the Ray "
                     f"workers never reached the drill's MLflow run {self.drill_run_id} "
                     f"(steps {_shown(missing)})"
                     for name, steps, missing in _missing(printed, stored)]
        return problems

    def classify(self, result: RunResult) -> str:
        what, target = self._what(), self._target()
        if result.outcome == "hung":
            return (f"the job stopped making progress under the {what} fault on {target}: its "
                    f"calls to it block (no timeout?) -- {result.reason}")
        if result.outcome == "failed":
            return f"the job failed under the {what} fault on {target}: {result.reason}"
        return super().classify(result)
