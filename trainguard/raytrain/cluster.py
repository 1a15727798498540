"""A multi-node Ray cluster on one machine: a head and worker nodes, each a ``ray start --block``
of its own (separate raylets, object stores and resources), for drills that need nodes to lose.

The embedded one-node head (:class:`~trainguard.raytrain.local_ray.LocalRay`) stays what checks
use; this cluster is what trainguard's own tests (and a user who wants to rehearse node loss
before a staging cluster) start::

    with LocalRayCluster() as cluster:                 # head (0 CPUs) + nodes a, b (2 CPUs each)
        env = cluster.client_env()                     # RAY_ADDRESS + the cluster's auth token

Every node is a :class:`LocalRay` (a worker node joins the head with ``join=``): its own private
temp dir and ports, stopped by pid with nothing left. The head offers no CPUs, so every Train
worker runs on a worker node, and each worker node offers ``cpus`` CPUs and a custom resource
``tg_node_<name>`` (pin a worker to a node with ``resources_per_worker``). With the defaults
(2 + 2 CPUs, 1 CPU per worker) a 2-worker fit fits on either node alone: losing one node leaves
room for exactly 2 workers.

``NodeSpec(pid_namespace=True)`` (root) runs a worker node in a pid namespace of its own: the pids
Ray reports for its workers then name nothing on this machine, so only Ray's API reaches them --
what trainguard's tests use to prove that drills do not fall back to local pids.

Node death is noticed fast here (``system_config``: the GCS health-checks each raylet every
0.5 s and declares it dead after 3 misses) -- Ray's defaults take ~15-30 s, docs/ray-train.md.

A node stopped by a drill (``fault: node_loss`` kills its raylet through Ray) is restarted by
:meth:`LocalRayCluster.restart_lost` -- which :func:`restart_lost_nodes` calls for every cluster
this process started, as the node_loss fault does when it clears: the node comes back as a new
Ray node (a new node id) with the same resources.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import TracebackType

import psutil

from trainguard.raytrain.local_ray import LocalRay, RayCluster, SystemConfig, running_ray_processes

__all__ = ["FAST_NODE_DEATH", "PID_NAMESPACE", "LocalRayCluster", "NodeSpec", "pid_namespaces_available",
           "restart_lost_nodes"]

#: the head's Ray settings that make a lost node dead within ~2 s (Ray: 3 s x 5 misses + timeouts)
FAST_NODE_DEATH: dict[str, int] = {
    "health_check_initial_delay_ms": 1000,
    "health_check_period_ms": 500,
    "health_check_timeout_ms": 1000,
    "health_check_failure_threshold": 3,
}
_CLUSTERS: list[LocalRayCluster] = []
_CLUSTERS_LOCK = threading.Lock()


#: how a node gets a pid namespace of its own (root only): its processes' pids, which Ray
#: reports, then name nothing on this machine -- as for a node on another machine. ``unshare
#: --fork`` ignores SIGTERM (LocalRay signals the node's process group) and passes it on to its
#: child when it dies; when the node's ``ray start`` (pid 1 there) exits, the kernel ends every
#: process of the namespace.
PID_NAMESPACE = ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child=SIGTERM"]


def _pid_namespace(first_pid: int) -> list[str]:
    """:data:`PID_NAMESPACE` whose pids start after ``first_pid``: two nodes' workers never share
    a pid (a worker group restarted on the other node is told apart by its pids)."""
    return [*PID_NAMESPACE, "sh", "-c",
            f'echo {first_pid} > /proc/sys/kernel/ns_last_pid && exec "$0" "$@"']


def pid_namespaces_available() -> str | None:
    """None when worker nodes can run in pid namespaces here, else why not."""
    import os
    import shutil

    if shutil.which("unshare") is None:
        return "no `unshare` command (util-linux)"
    if os.geteuid() != 0:
        return "a new pid namespace needs root (CAP_SYS_ADMIN)"
    return None


@dataclass(frozen=True)
class NodeSpec:
    """One worker node: its name, the CPUs it offers, its custom resources (besides
    ``tg_node_<name>: 1``, which every worker node has) and whether it runs in a pid namespace of
    its own (:data:`PID_NAMESPACE`)."""

    name: str
    cpus: int = 2
    resources: dict[str, float] = field(default_factory=dict)
    pid_namespace: bool = False

    def all_resources(self) -> dict[str, float]:
        return {f"tg_node_{self.name}": 1.0, **self.resources}


class LocalRayCluster:
    """Start a head and worker nodes on this machine; stop them all on exit.

    Args:
        workers: the worker nodes (default: ``a`` and ``b``, 2 CPUs each).
        head_cpus: CPUs the head offers (0: no Train worker is placed there).
        system_config: the head's Ray settings (default :data:`FAST_NODE_DEATH`).
        object_store_mb: each node's object store.
        start_timeout / stop_timeout: per node, seconds.
    """

    def __init__(
        self,
        workers: Sequence[NodeSpec] = (NodeSpec("a"), NodeSpec("b")),
        *,
        head_cpus: int = 0,
        system_config: SystemConfig | None = None,
        object_store_mb: int = 100,
        start_timeout: float = 120.0,
        stop_timeout: float = 30.0,
    ) -> None:
        names = [w.name for w in workers]
        if len(set(names)) != len(names):
            raise ValueError(f"worker node names must differ, got {names}")
        why = pid_namespaces_available() if any(w.pid_namespace for w in workers) else None
        if why is not None:
            raise ValueError(f"NodeSpec(pid_namespace=True) cannot run here: {why}; use "
                             "pid_namespace=False")
        self.specs = {w.name: w for w in workers}
        self.head = LocalRay(num_cpus=head_cpus, dashboard=True, object_store_mb=object_store_mb,
                             system_config=FAST_NODE_DEATH if system_config is None else system_config,
                             resources={"tg_head": 1.0}, start_timeout=start_timeout,
                             stop_timeout=stop_timeout, use_ray_address=False)
        self.nodes: dict[str, LocalRay] = {}
        self.object_store_mb = object_store_mb
        self.start_timeout = start_timeout
        self.stop_timeout = stop_timeout
        self.cluster: RayCluster | None = None
        self.start_s: float | None = None
        self.stop_s: float | None = None
        #: (node name, seconds) of every restart of a lost node
        self.restarts: list[tuple[str, float]] = []
        #: what outlived the stop (should be empty): ``pid name`` per process
        self.leftover: list[str] = []
        self._lock = threading.Lock()  # a drill's thread and its caller may both restart nodes
        self._namespaces = 0  # pid namespaces started (each node start gets its own pid range)

    def __enter__(self) -> LocalRayCluster:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def start(self) -> RayCluster:
        """Start the head, then the worker nodes side by side; return the head's address."""
        if self.cluster is not None:
            return self.cluster
        t0 = time.monotonic()
        with _CLUSTERS_LOCK:
            _CLUSTERS.append(self)
        try:
            self.cluster = self.head.start()
            self._start_nodes(list(self.specs))
        except BaseException:
            self.stop()
            raise
        self.start_s = time.monotonic() - t0
        return self.cluster

    def _node(self, name: str) -> LocalRay:
        spec = self.specs[name]
        assert self.cluster is not None
        return LocalRay(num_cpus=spec.cpus, dashboard=False, object_store_mb=self.object_store_mb,
                        resources=spec.all_resources(), join=self.cluster,
                        start_timeout=self.start_timeout, stop_timeout=self.stop_timeout,
                        command_prefix=_pid_namespace(self._next_pid(name)) if spec.pid_namespace else None)

    def _next_pid(self, name: str) -> int:
        """Where the pids of node ``name``'s next namespace start: 4000 apart for each of 7
        starts in turn (the kernel's pid_max, 32768 by default, bounds a namespace's pids too)."""
        self._namespaces += 1
        return 2000 + 4000 * (self._namespaces % 7)

    def _start_nodes(self, names: list[str]) -> None:
        errors: list[BaseException] = []

        def start(name: str) -> None:
            try:
                self.nodes[name].start()
            except BaseException as exc:  # re-raised below, on the caller's thread
                errors.append(exc)

        for name in names:
            self.nodes[name] = self._node(name)
        threads = [threading.Thread(target=start, args=(n,), name=f"tg-ray-node-{n}") for n in names]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            raise errors[0]

    def client_env(self) -> dict[str, str]:
        """Environment of a driver or CLI that uses this cluster (``RAY_ADDRESS``, auth)."""
        if self.cluster is None:
            raise RuntimeError("the cluster is not started")
        return self.cluster.client_env()

    def lost(self) -> list[str]:
        """Names of the worker nodes whose ``ray start`` is no longer running."""
        return [name for name, node in self.nodes.items() if not node.running]

    def restart_lost(self) -> list[str]:
        """Start every lost worker node again (a new Ray node with the same resources); returns
        their names. The old node's leftovers are reaped first."""
        with self._lock:
            if self.cluster is None:
                return []
            names = self.lost()
            for name in names:
                self.nodes[name].stop()  # reaps what the dead node left (its workers exit with it)
            t0 = time.monotonic()
            if names:
                self._start_nodes(names)
                took = time.monotonic() - t0
                self.restarts += [(name, took) for name in names]
            return names

    def stop(self) -> None:
        """Stop the worker nodes, then the head; verify nothing of theirs is left. Idempotent."""
        t0 = time.monotonic()
        try:
            temp_dirs = [n.cluster.temp_dir for n in [*self.nodes.values(), self.head]
                         if n.cluster is not None and n.cluster.temp_dir is not None]
            for node in self.nodes.values():
                node.stop()
            self.head.stop()
            left = [*self.head.leftover, *(x for n in self.nodes.values() for x in n.leftover)]
            for temp in temp_dirs:
                for proc in running_ray_processes(temp):
                    with contextlib.suppress(psutil.Error):
                        left.append(f"{proc.pid} {proc.name()}")
            self.leftover = sorted(set(left))
        finally:
            self.cluster = None
            self.stop_s = time.monotonic() - t0
            with _CLUSTERS_LOCK:
                if self in _CLUSTERS:
                    _CLUSTERS.remove(self)


def restart_lost_nodes(wait_s: float = 0.0) -> list[str]:
    """Restart the lost worker nodes of every :class:`LocalRayCluster` this process started;
    returns their names. ``wait_s``: wait that long for a node to be lost (a node's ``ray start``
    exits a moment after its raylet). Nothing, at once, when this process started no cluster."""
    deadline = time.monotonic() + wait_s
    while True:
        with _CLUSTERS_LOCK:
            clusters = list(_CLUSTERS)
        if not clusters:
            return []
        names = [name for cluster in clusters for name in cluster.restart_lost()]
        if names or time.monotonic() >= deadline:
            return names
        time.sleep(0.25)


def main(argv: list[str] | None = None) -> int:
    """``python -m trainguard.raytrain.cluster [--env-file PATH]``: start a cluster, write the
    environment that points a driver (or ``trainguard drill``) at it, and keep it until Ctrl-C or
    SIGTERM; then stop it with nothing left. A lost node is started again ``--restart-after``
    seconds after it was lost (an autoscaler's part; the drill's process cannot do it here)."""
    import argparse
    import shlex
    import signal

    from trainguard._internal.atomic import atomic_write_text

    parser = argparse.ArgumentParser(prog="python -m trainguard.raytrain.cluster")
    parser.add_argument("--env-file", default=None, help="write `KEY=value` lines here (else stdout)")
    parser.add_argument("--cpus", type=int, default=2, help="CPUs of each worker node (default 2)")
    parser.add_argument("--nodes", type=int, default=2, help="worker nodes (default 2)")
    parser.add_argument("--restart-after", type=float, default=30.0,
                        help="seconds before a lost node is started again (default 30)")
    args = parser.parse_args(argv)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    cluster = LocalRayCluster([NodeSpec(chr(ord("a") + i), cpus=args.cpus) for i in range(args.nodes)])
    try:
        cluster.start()
        lines = "".join(f"{k}={shlex.quote(v)}\n" for k, v in cluster.client_env().items())
        if args.env_file:
            atomic_write_text(args.env_file, lines)
        else:
            print(lines, end="", flush=True)
        print(f"cluster of {args.nodes + 1} nodes up in {cluster.start_s:.1f} s; Ctrl-C stops it",
              file=sys.stderr, flush=True)
        lost_since: float | None = None
        while not stop.wait(1.0):
            if not cluster.lost():
                lost_since = None
            elif lost_since is None:
                lost_since = time.monotonic()
            elif time.monotonic() - lost_since >= args.restart_after:
                print(f"restarting lost node(s) {cluster.restart_lost()}", file=sys.stderr, flush=True)
                lost_since = None
    finally:
        cluster.stop()
        print(f"stopped in {cluster.stop_s or 0:.1f} s; left: {cluster.leftover or 'nothing'}",
              file=sys.stderr, flush=True)
    return 0 if not cluster.leftover else 1


if __name__ == "__main__":
    sys.exit(main())
