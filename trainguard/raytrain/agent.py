"""trainguard's Ray client for drills: find a Train worker by world rank through Ray's state, and act
on it through Ray, from any machine that reaches the head (``python -m trainguard.raytrain.agent``).

Why a subprocess: a Ray client (``ray.init``) in trainguard's own process would tie Ray's threads,
signal handlers and shutdown to pytest's or the CLI's; the agent is one more process with an
owner (:class:`RayAgent`), a deadline on every request and a stop that reaps it.

What it does, all through Ray's APIs (nothing here needs trainguard on a worker's node):

* ``workers``: the workers of the newest live attempt of a Train run, by the run's name (the
  job's ``RunConfig(name)``), from Ray Train's state actor -- the source of the dashboard's
  ``/api/train/v2/runs`` -- which lists each worker's ``world_rank``, ``actor_id``, ``node_id``
  and ``pid`` (the fit's driver needs ``RAY_TRAIN_ENABLE_STATE_TRACKING=1``, which the drill
  sets); the state lags the workers' output (a worker prints steps before its attempt is
  recorded RUNNING), so the request asks again for ``wait_s`` seconds while the run is live and
  not yet recorded, has no running group, or (given the ``pid`` that printed the rank's steps)
  names another process for the rank, and only then answers that it is absent; when the dashboard answers, the target rank's actor is looked up again with
  ``ray.util.state.get_actor`` (state, node, pid);
* ``signal``: a zero-CPU actor pinned to the worker's node (``NodeAffinitySchedulingStrategy``,
  ``soft=False``; one per node, started by ``warm`` or on first use, owned by the agent) sends the
  signal to the pid there -- after checking that the pid is that node's Ray worker -- and reads
  the process state back from ``/proc``;
* ``stop_node``: the node's actor kills the node's raylet (its parent process), which takes the
  node down: ``ray start --block`` then stops the node's other processes and the workers exit
  with their raylet. The actor answers first and strikes ``delay`` seconds later.

Protocol: one JSON request per line on stdin (``{"id", "op", ...}``), one JSON answer per line on
stdout (``{"id", "ok", "result" | "error"}``); EOF on stdin ends it.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, TypedDict, TypeVar

from trainguard._internal.signals import signals_deferred
from trainguard.errors import TrainguardError

if TYPE_CHECKING:
    from ray.actor import ActorHandle

__all__ = [
    "STATE_TRACKING_ENV",
    "NodeEntry",
    "NodeSignal",
    "NodeStop",
    "RayAgent",
    "RayAgentError",
    "StateNotYet",
    "TrainWorkers",
    "WorkerEntry",
    "wait_for_state",
]

#: the driver's setting that makes Ray Train record its runs' workers in its state actor
STATE_TRACKING_ENV = {"RAY_TRAIN_ENABLE_STATE_TRACKING": "1"}
_READY = "trainguard-ray-agent ready"
T = TypeVar("T")


class AgentRequest(TypedDict, total=False):
    """One request line on the agent's stdin: ``id``, ``op`` and the op's arguments."""

    id: int
    op: str
    run_name: str
    rank: int | None
    pid: int | None
    wait_s: float
    node_id: str
    signal: int
    delay: float


class AgentAnswer(TypedDict, total=False):
    """One answer line on the agent's stdout (``ready`` only in the first, read from its ready
    line): ``result`` is the op's (a :class:`TrainWorkers`, a list of :class:`NodeEntry`, a
    :class:`NodeSignal`, a :class:`NodeStop`, True for ``warm``)."""

    id: int | None
    ok: bool
    result: Any
    error: str
    ready: bool


class WorkerEntry(TypedDict, total=False):
    """A Train worker as Ray Train's state lists it; the ``actor_*`` keys are Ray core's view of
    its actor, when the dashboard's state API answered."""

    world_rank: int
    actor_id: str
    node_id: str
    node_ip: str
    pid: int
    actor_state: str
    actor_node_id: str
    actor_pid: int


class TrainWorkers(TypedDict):
    """The answer to ``workers``: the newest running attempt of a live Train run, its workers."""

    run_id: str
    run_status: str
    attempt_id: str
    workers: list[WorkerEntry]


class NodeEntry(TypedDict):
    """A node of the cluster (``ray.nodes()``), the answer to ``nodes`` being a list of them."""

    node_id: str
    alive: bool
    resources: dict[str, float]
    head: bool


class NodeSignal(TypedDict, total=False):
    """What the node's actor saw when it signalled a pid there (``signal``): ``sent``, the
    process state before and after, ``why`` when nothing was sent."""

    host: str
    task_pid: int
    pid: int
    state_before: str | None
    sent: bool
    why: str
    state_after: str | None


class NodeStop(TypedDict, total=False):
    """What the node's actor did to stop its node (``stop_node``): the raylet it strikes,
    ``sent``, ``why`` when it will not."""

    host: str
    task_pid: int
    raylet_pid: int
    raylet_cmdline: str
    sent: bool
    why: str


class RayAgentError(TrainguardError):
    """The agent could not start, or a request failed (the message says what Ray answered)."""


class RayAgent:
    """Owner of one agent process connected to the cluster that ``env`` points at.

    Args:
        env: the client environment (``RAY_ADDRESS`` and the cluster's auth settings):
            :meth:`trainguard.raytrain.local_ray.RayCluster.client_env` or the user's own.
        start_timeout / request_timeout: seconds before giving up on ``ray.init`` / one request.
    """

    def __init__(self, env: Mapping[str, str], *, start_timeout: float = 90.0,
                 request_timeout: float = 60.0) -> None:
        self.env = dict(env)
        self.start_timeout = start_timeout
        self.request_timeout = request_timeout
        self.start_s: float | None = None
        self._popen: subprocess.Popen[str] | None = None
        self._answers: queue.Queue[AgentAnswer | None] = queue.Queue()
        self._stderr: list[str] = []
        self._next_id = 0
        self._lock = threading.Lock()

    def __enter__(self) -> RayAgent:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> RayAgent:
        """Start the agent and wait until it is connected to Ray."""
        if self._popen is not None:
            return self
        t0 = time.monotonic()
        env = {**os.environ, **self.env, "RAY_DEDUP_LOGS": "0"}
        with signals_deferred():  # never an agent without its Popen
            self._popen = subprocess.Popen(
                [sys.executable, "-m", "trainguard.raytrain.agent"],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                text=True, env=env, start_new_session=True,
            )
        popen = self._popen
        threading.Thread(target=self._read, args=(popen,), daemon=True, name="tg-ray-agent-out").start()
        threading.Thread(target=self._read_err, args=(popen,), daemon=True, name="tg-ray-agent-err").start()
        try:
            first = self._answers.get(timeout=self.start_timeout)
        except queue.Empty:
            first = None
        if first is None or first.get("ready") is not True:
            self.stop()
            raise RayAgentError(
                f"the Ray agent did not connect to {self.env.get('RAY_ADDRESS', '(no RAY_ADDRESS)')} "
                f"within {self.start_timeout:.0f} s; its stderr:\n" + "\n".join(self._stderr[-20:])
            )
        self.start_s = time.monotonic() - t0
        return self

    def _read(self, popen: subprocess.Popen[str]) -> None:
        assert popen.stdout is not None
        for line in popen.stdout:
            line = line.strip()
            if line == _READY:
                self._answers.put({"ready": True})
            elif line.startswith("{"):
                with contextlib.suppress(ValueError):
                    self._answers.put(json.loads(line))
        self._answers.put(None)  # EOF: the agent is gone

    def _read_err(self, popen: subprocess.Popen[str]) -> None:
        assert popen.stderr is not None
        for line in popen.stderr:
            self._stderr.append(line.rstrip())
            del self._stderr[:-200]

    def request(self, op: str, **args: Any) -> Any:
        """Send one request and return its result; :class:`RayAgentError` on a failure."""
        with self._lock:  # one request at a time: answers come back in order
            popen = self._popen
            if popen is None or popen.stdin is None or popen.poll() is not None:
                raise RayAgentError(f"the Ray agent is not running (request {op!r})")
            self._next_id += 1
            ident = self._next_id
            try:
                popen.stdin.write(json.dumps({"id": ident, "op": op, **args}) + "\n")
                popen.stdin.flush()
            except OSError as exc:
                raise RayAgentError(f"the Ray agent is gone ({exc}); its stderr:\n"
                                    + "\n".join(self._stderr[-20:])) from None
            deadline = time.monotonic() + self.request_timeout
            while True:
                try:
                    answer = self._answers.get(timeout=max(0.01, deadline - time.monotonic()))
                except queue.Empty:
                    raise RayAgentError(f"the Ray agent did not answer {op!r} within "
                                        f"{self.request_timeout:.0f} s") from None
                if answer is None:
                    raise RayAgentError(f"the Ray agent exited during {op!r}; its stderr:\n"
                                        + "\n".join(self._stderr[-20:]))
                if answer.get("id") == ident:
                    break
        if not answer.get("ok"):
            raise RayAgentError(f"{op}: {answer.get('error')}")
        return answer.get("result")

    def stop(self) -> None:
        """End the agent (EOF, then SIGTERM, then SIGKILL to its process group). Idempotent."""
        popen, self._popen = self._popen, None
        if popen is None:
            return
        with contextlib.suppress(OSError):
            if popen.stdin is not None:
                popen.stdin.close()
        try:
            popen.wait(timeout=10)
        except subprocess.TimeoutExpired:
            for sig in (signal.SIGTERM, signal.SIGKILL):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(popen.pid, sig)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    popen.wait(timeout=5)
                    break


# -- the agent process ---------------------------------------------------------------------------


def _proc_state(pid: int) -> str | None:
    """The process's state letter from /proc (R, S, T: stopped, Z ...), None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def _signal_here(pid: int, signum: int) -> NodeSignal:
    """Runs on the worker's node: signal ``pid`` if it is a Ray worker process there."""
    import socket

    name = _cmdline(pid)
    out: NodeSignal = {"host": socket.gethostname(), "task_pid": os.getpid(), "pid": pid,
                       "state_before": _proc_state(pid)}
    if out["state_before"] is None:
        return {**out, "sent": False, "why": f"no process {pid} on this node (it exited)"}
    if "ray::" not in name and "default_worker" not in name:
        return {**out, "sent": False, "why": f"pid {pid} is not a Ray worker here ({name[:80]!r})"}
    os.kill(pid, signum)
    # delivery is asynchronous: wait for the state the signal leads to (0.5 s at most)
    done: set[str | None]
    if signum == signal.SIGSTOP:
        done = {"T", "t"}
    elif signum == signal.SIGCONT:
        done = {"R", "S", "D", None}
    else:
        done = {"Z", "X", None}
    for _ in range(50):
        if _proc_state(pid) in done:
            break
        time.sleep(0.01)
    return {**out, "sent": True, "state_after": _proc_state(pid)}


def _stop_node_here(signum: int, delay: float) -> NodeStop:
    """Runs on the node to stop: kill its raylet (this worker's parent) ``delay`` s from now."""
    import socket

    raylet = os.getppid()
    name = _cmdline(raylet)
    out: NodeStop = {"host": socket.gethostname(), "task_pid": os.getpid(), "raylet_pid": raylet,
                     "raylet_cmdline": name[:200]}
    if "raylet" not in name:
        return {**out, "sent": False, "why": f"this task's parent (pid {raylet}) is not a raylet"}
    threading.Timer(delay, os.kill, (raylet, signum)).start()
    return {**out, "sent": True}


class _NodeHand:
    """A zero-CPU actor pinned to one node: acts there without starting a process per request
    (a task would wait for a new Ray worker process, seconds on a busy node)."""

    def ping(self) -> int:
        return os.getpid()

    def signal(self, pid: int, signum: int) -> NodeSignal:
        return _signal_here(pid, signum)

    def stop_node(self, signum: int, delay: float) -> NodeStop:
        return _stop_node_here(signum, delay)


_HANDS: dict[str, ActorHandle[_NodeHand]] = {}


def _hand(node_id: str) -> ActorHandle[_NodeHand]:
    """The node's hand, started on first use (it lives as long as this agent, its owner)."""
    import ray
    from ray.actor import ActorHandle
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    hand = _HANDS.get(node_id)
    if hand is None:
        started = ray.remote(_NodeHand).options(
            num_cpus=0, max_restarts=0, max_task_retries=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node_id, soft=False),
        ).remote()
        assert isinstance(started, ActorHandle)  # an actor class's remote() starts an actor
        ray.get(started.ping.remote(), timeout=45)
        _HANDS[node_id] = hand = started
    return hand


def _on_node(node_id: str, method: str, *args: Any) -> Any:
    """Call the node's hand; one more try with a new hand when the old one is gone."""
    import ray

    for last in (False, True):
        try:
            return ray.get(getattr(_hand(node_id), method).remote(*args), timeout=45)
        except ray.exceptions.RayActorError:
            _HANDS.pop(node_id, None)
            if last:
                raise
    raise AssertionError("unreachable")


class StateNotYet(LookupError):
    """Ray Train's state has not caught up with a run that is still live: no live run of that name
    is recorded yet (an ended one of the same name may be: the drill's reference run), or its
    newest attempt has no running worker group yet (a worker prints its first steps before the
    controller records its attempt RUNNING). Worth asking again."""


def wait_for_state(lookup: Callable[[], T], wait_s: float, *, interval: float = 0.25,
                   clock: Callable[[], float] = time.monotonic,
                   sleep: Callable[[float], None] = time.sleep) -> T:
    """``lookup()``, asked again every ``interval`` s while it raises :class:`StateNotYet`, for
    ``wait_s`` s at most; then that absence is real: a LookupError saying how long it was asked.
    Any other LookupError (no state actor: tracking is off) is raised at once."""
    deadline = clock() + wait_s
    asked = 0
    while True:
        asked += 1
        try:
            return lookup()
        except StateNotYet as exc:
            if clock() >= deadline:
                raise LookupError(f"{exc} (asked {asked} times over {wait_s:g} s)") from None
        sleep(interval)


def _train_workers(run_name: str, rank: int | None = None, pid: int | None = None) -> TrainWorkers:
    import ray
    from ray.train.v2._internal.state.state_actor import get_state_actor

    actor = get_state_actor()
    if actor is None:
        raise LookupError("Ray Train's state actor does not exist: the fit's driver must run with "
                          "RAY_TRAIN_ENABLE_STATE_TRACKING=1 (trainguard's drills set it)")
    get: Any = ray.get  # untyped results: the state actor's pydantic models
    runs = get(actor.get_train_runs.remote(), timeout=30)
    attempts = get(actor.get_train_run_attempts.remote(), timeout=30)
    live = [r for r in runs.values() if r.name == run_name and not r.status.is_terminal()]
    if not live:
        # not recorded yet: the controller may not have registered the run; a run of the same
        # name that ended is no answer (a drill's reference run has the job's name too)
        raise StateNotYet(f"no live Train run named {run_name!r} (runs: "
                          f"{sorted({(r.name, r.status.value) for r in runs.values()})})")
    groups = [(a.start_time_ns, r.start_time_ns, a, r) for r in live for a in attempts.get(r.id, {}).values()
              if a.status.value == "RUNNING" and a.workers]
    if not groups:
        run = max(live, key=lambda r: r.start_time_ns)
        raise StateNotYet(f"the Train run {run_name!r} ({run.status.value}) has no running "
                          "worker group now")
    if pid is not None and rank is not None:
        # the group whose worker of ``rank`` is the process that printed the steps: a run of the
        # same name that ended (the drill's reference) may still be recorded RUNNING for a while
        mine = [g for g in groups if any(w.world_rank == rank and w.pid == pid for w in g[2].workers)]
        if not mine:
            named = sorted({w.pid for g in groups for w in g[2].workers if w.world_rank == rank})
            raise StateNotYet(f"Ray Train's state names pid(s) {named} for rank {rank} of {run_name!r}, "
                              f"not the worker that printed its steps (pid {pid})")
        groups = mine
    _, _, attempt, run = max(groups, key=lambda g: (g[1], g[0]))
    workers: list[WorkerEntry] = [{"world_rank": w.world_rank, "actor_id": w.actor_id, "node_id": w.node_id,
                                   "node_ip": w.node_ip, "pid": w.pid} for w in attempt.workers]
    for w in workers:  # Ray core's view of the same actor, when the dashboard's state API answers
        if rank is not None and w["world_rank"] != rank:
            continue
        with contextlib.suppress(Exception):
            from ray.util.state import get_actor

            state = get_actor(w["actor_id"], timeout=5)
            if state is not None:
                w["actor_state"] = state.state
                w["actor_node_id"] = state.node_id
                w["actor_pid"] = state.pid
    return {"run_id": run.id, "run_status": run.status.value, "attempt_id": attempt.attempt_id,
            "workers": workers}


def _nodes() -> list[NodeEntry]:
    import ray

    return [{"node_id": n["NodeID"], "alive": n["Alive"], "resources": n.get("Resources", {}),
             "head": "node:__internal_head__" in n.get("Resources", {})} for n in ray.nodes()]


def _serve(request: AgentRequest) -> Any:
    op = request.get("op")
    if op == "workers":
        rank = request.get("rank")
        pid = request.get("pid")
        return wait_for_state(
            lambda: _train_workers(str(request["run_name"]), None if rank is None else int(rank),
                                   None if pid is None else int(pid)),
            float(request.get("wait_s", 0.0)),
        )
    if op == "nodes":
        return _nodes()
    if op == "warm":
        return _hand(str(request["node_id"])) is not None  # started and answering
    if op == "signal":
        pid = request.get("pid")
        if pid is None:
            raise ValueError("signal: no pid to signal")
        return _on_node(str(request["node_id"]), "signal", int(pid), int(request["signal"]))
    if op == "stop_node":
        node_id = str(request["node_id"])
        done = _on_node(node_id, "stop_node", int(request["signal"]), float(request.get("delay", 0.3)))
        _HANDS.pop(node_id, None)  # it goes down with its node
        return done
    raise ValueError(f"unknown op {op!r}")


def main() -> int:
    """The agent process: connect to ``RAY_ADDRESS``, then answer requests until EOF."""
    import logging

    import ray

    ray.init(address=os.environ.get("RAY_ADDRESS") or "auto", log_to_driver=False,
             logging_level=logging.WARNING)
    print(_READY, flush=True)
    try:
        for line in sys.stdin:
            if not line.strip():
                continue
            request: AgentRequest = {}
            try:
                request = json.loads(line)
                answer = {"id": request.get("id"), "ok": True, "result": _serve(request)}
            except Exception as exc:  # the answer carries it; the agent goes on
                answer = {"id": request.get("id"), "ok": False, "error": f"{type(exc).__name__}: {exc}"}
            print(json.dumps(answer, default=str), flush=True)
    finally:
        ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
