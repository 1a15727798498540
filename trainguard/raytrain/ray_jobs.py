"""Submit a promoted job to a Ray cluster through the Ray Jobs API (``ray.job_submission``).

The cluster is a real one (``RAY_ADDRESS``/``RAY_API_SERVER_ADDRESS``, Ray's own auth from the
environment) or the embedded head of :class:`~trainguard.raytrain.local_ray.LocalRay` (its token is
sent as a bearer header). Needs ``ray[default]`` (the Jobs API is served by the dashboard).

A job whose entrypoint asks for more GPUs/CPUs than any node has stays PENDING in Ray forever
(and Ray's ``stop_job`` does not stop a job whose supervisor was never scheduled). So before
submitting, the cluster's alive nodes are read and an infeasible request is refused with the
numbers; and after submitting, a job still PENDING after ``pending_timeout`` is reported --
``unschedulable`` (and stopped) when no node can hold it, ``pending`` when it is only waiting for
resources in use by other jobs. Nothing here waits without a deadline.

It is the queue backend ``ray`` (:func:`trainguard.queue.backends.get_backend` names it by its
``module:attr`` line, resolved on first use); :meth:`RayJobsBackend.submit_and_follow` is the gate's
``--submit`` to it. It lives in ``raytrain/``, above ``queue/`` (docs/architecture.md).
"""

from __future__ import annotations

import json
import shlex
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainguard.queue.base import Submission, SubmissionError, SubmissionSpec, torchrun_argv
from trainguard.raytrain.local_ray import LocalRay, RayCluster, external_cluster

__all__ = ["ClusterResources", "RayJobsBackend", "cluster_resources"]

_RAY_STATUS = {
    "PENDING": "pending",
    "RUNNING": "running",
    "STOPPED": "stopped",
    "SUCCEEDED": "succeeded",
    "FAILED": "failed",
}


@dataclass(frozen=True)
class ClusterResources:
    """Totals of the cluster's alive nodes (what it could ever give, not what is free now)."""

    nodes: list[dict[str, float]]

    @property
    def total_gpus(self) -> float:
        return sum(n.get("GPU", 0.0) for n in self.nodes)

    @property
    def total_cpus(self) -> float:
        return sum(n.get("CPU", 0.0) for n in self.nodes)

    def largest(self, resource: str) -> float:
        return max((n.get(resource, 0.0) for n in self.nodes), default=0.0)

    def fits_one_node(self, cpus: float, gpus: float) -> bool:
        return any(n.get("CPU", 0.0) >= cpus and n.get("GPU", 0.0) >= gpus for n in self.nodes)

    def describe(self) -> str:
        per_node = ", ".join(f"{n.get('CPU', 0):g} CPU/{n.get('GPU', 0):g} GPU" for n in self.nodes)
        return f"{len(self.nodes)} alive node(s): {per_node or 'none'}"


def cluster_resources(
    jobs_address: str, headers: dict[str, str] | None = None, timeout: float = 10.0
) -> ClusterResources:
    """Per-node resource totals of the alive nodes, from the dashboard's state API."""
    url = f"{jobs_address.rstrip('/')}/api/v0/nodes?limit=10000&detail=1"
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            payload = json.loads(response.read())
    except urllib.error.HTTPError as exc:
        raise SubmissionError(
            f"the Ray dashboard at {jobs_address} refused the node listing ({exc.code} "
            f"{exc.reason}); with token auth set RAY_AUTH_MODE=token and RAY_AUTH_TOKEN"
        ) from None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise SubmissionError(
            f"cannot read the Ray cluster's nodes from {jobs_address}: {exc}; is the "
            "dashboard (ray[default]) running and RAY_API_SERVER_ADDRESS/RAY_ADDRESS right?"
        ) from None
    rows = payload.get("data", {}).get("result", {}).get("result", [])
    nodes = [
        {k: float(v) for k, v in (row.get("resources_total") or {}).items()}
        for row in rows
        if row.get("state") == "ALIVE"
    ]
    return ClusterResources(nodes=nodes)


class RayJobsBackend:
    """The ``ray`` queue backend.

    Args:
        cluster: where to submit; default: ``RAY_ADDRESS`` (a real cluster). For the embedded
            head pass ``LocalRay().start()`` (and keep it running while the job runs).
        pending_timeout: seconds a submitted job may stay PENDING before it is reported.
        check_resources: refuse (without submitting) a request no alive node can hold. Turn
            off for an autoscaling cluster that adds nodes on demand; the PENDING watch then
            reports a job nothing picks up.
        stop_unschedulable: stop a submitted job found unschedulable (best effort: Ray may
            keep a never-scheduled job PENDING).
        poll_interval: seconds between status polls.
    """

    name = "ray"

    def __init__(
        self,
        cluster: RayCluster | None = None,
        *,
        pending_timeout: float = 60.0,
        check_resources: bool = True,
        stop_unschedulable: bool = True,
        poll_interval: float = 0.5,
    ) -> None:
        if cluster is None:
            cluster = external_cluster()
        if cluster is None or not cluster.jobs_address:
            raise SubmissionError(
                "no Ray cluster with a Jobs API to submit to: set RAY_ADDRESS (or "
                "RAY_API_SERVER_ADDRESS) to the cluster's dashboard, e.g. http://head:8265, or "
                "start an embedded head with trainguard.raytrain.local_ray.LocalRay(dashboard=True)"
            )
        self.cluster = cluster
        self.jobs_address: str = cluster.jobs_address
        self.pending_timeout = pending_timeout
        self.check_resources = check_resources
        self.stop_unschedulable = stop_unschedulable
        self.poll_interval = poll_interval
        self._client: Any = None

    # -- the Jobs client -------------------------------------------------------------------

    @classmethod
    def submit_and_follow(cls, spec: SubmissionSpec, *, state_dir: Path, wait_s: float) -> Submission:
        """The gate's submission: to the cluster ``RAY_ADDRESS`` names; without one, to an
        embedded head, for a dry run of the submission path on this machine, watched for
        ``wait_s`` seconds (the job lives only as long as the head, which stops on return)."""
        del state_dir  # Ray keeps its jobs' records
        if external_cluster() is not None:
            return cls().submit(spec)
        with LocalRay(dashboard=True) as cluster:
            backend = cls(cluster=cluster, pending_timeout=min(wait_s, 60.0))
            submission = backend.submit(spec)
            if submission.job_id and not submission.terminal and wait_s > 0:
                submission = backend.wait(submission.job_id, wait_s)
            submission.note = (f"submitted to an embedded local Ray head (no RAY_ADDRESS) and watched for "
                               f"{wait_s:g} s; the head stops with the gate. Set RAY_ADDRESS to submit to a "
                               "real cluster")
            return submission

    @property
    def client(self) -> Any:
        """The ``JobSubmissionClient`` (created on first use; imports ray)."""
        if self._client is None:
            try:
                from ray.job_submission import JobSubmissionClient
            except ImportError as exc:
                raise SubmissionError(
                    f"the Ray backend needs ray[default] ({exc}); install trainguard[ray]"
                ) from None
            try:
                self._client = JobSubmissionClient(
                    self.jobs_address, headers=self.cluster.auth_headers() or None
                )
            except Exception as exc:  # ray raises ConnectionError/RuntimeError/AuthenticationError
                raise SubmissionError(
                    f"cannot reach the Ray Jobs API at {self.jobs_address}: {exc}"
                ) from None
        return self._client

    def resources(self) -> ClusterResources:
        return cluster_resources(self.jobs_address, self.cluster.auth_headers())

    # -- submit ----------------------------------------------------------------------------

    def entrypoint(self, spec: SubmissionSpec) -> tuple[str, float, float]:
        """The entrypoint command and the CPUs/GPUs it reserves.

        ``torchrun``: the entrypoint runs all ranks on one node, so it reserves them all (Ray
        Jobs cannot spread one entrypoint over nodes). ``direct``: the entrypoint is a driver
        (e.g. a Ray Train ``TorchTrainer.fit``) that asks for its workers' resources itself; it
        reserves one CPU at most.
        """
        argv = spec.rank_argv()
        if spec.launcher == "torchrun":
            if spec.nodes > 1:
                raise SubmissionError(
                    f"{spec.job_name}: a torchrun job on {spec.nodes} nodes cannot be one Ray "
                    "Jobs entrypoint; use nodes=1, the slurm backend, or a Ray Train job"
                )
            if spec.world_size > 1:  # one rank runs as is, as trainguard's runner does
                argv = torchrun_argv(argv, nproc_per_node=spec.world_size)
            return (
                shlex.join(argv),
                spec.num_cpus * spec.world_size,
                spec.num_gpus * spec.world_size,
            )
        return shlex.join(argv), min(spec.num_cpus, 1.0), 0.0

    def submit(self, spec: SubmissionSpec) -> Submission:
        """Submit ``spec`` and watch it for at most ``pending_timeout`` seconds.

        Returns ``unschedulable`` without submitting when no node can hold the request, else
        the job id with its status once it left PENDING (``running``/``succeeded``/``failed``),
        or ``pending``/``unschedulable`` when it did not within ``pending_timeout``.
        """
        command, cpus, gpus = self.entrypoint(spec)
        evidence: dict[str, Any] = {
            "entrypoint_num_cpus": cpus,
            "entrypoint_num_gpus": gpus,
            "workers_gpus": spec.num_gpus * spec.world_size,
            "jobs_address": self.jobs_address,
        }
        resources: ClusterResources | None
        try:
            resources = self.resources()
        except SubmissionError:
            if self.check_resources:
                raise
            resources = None  # the PENDING watch still bounds the wait
        evidence["cluster"] = resources.describe() if resources else "unknown"
        infeasible = self._infeasible(spec, cpus, gpus, resources) if resources else None
        if infeasible and self.check_resources:
            return Submission(
                backend=self.name,
                status="unschedulable",
                message=f"not submitted: {infeasible}",
                script=command,
                evidence=evidence,
            )

        # trainguard's state (run dirs, checkpoints, the MLflow store) is not the job's code
        runtime_env: dict[str, str | list[str] | dict[str, str]] = {
            "working_dir": str(spec.working_dir), "excludes": [".trainguard", "__pycache__"]}
        if spec.env:
            runtime_env["env_vars"] = dict(spec.env)
        t0 = time.monotonic()
        try:
            job_id = self.client.submit_job(
                entrypoint=command,
                runtime_env=runtime_env,
                metadata=spec.labels(),
                entrypoint_num_cpus=cpus,
                entrypoint_num_gpus=gpus,
            )
        except SubmissionError:
            raise
        except Exception as exc:
            raise SubmissionError(
                f"the Ray Jobs API at {self.jobs_address} refused {spec.job_name}: {exc}"
            ) from None
        submitted = Submission(
            backend=self.name,
            status="submitted",
            message=f"submitted {spec.job_name} as {job_id}",
            job_id=job_id,
            links=self.links(job_id),
            script=command,
            evidence=evidence,
            submitted_at=time.time(),
        )
        state = self._wait_while_pending(job_id, self.pending_timeout)
        evidence["seconds_to_leave_pending"] = (
            round(time.monotonic() - t0, 3) if state.status != "pending" else None
        )
        if state.status != "pending":
            submitted.status, submitted.message = state.status, state.message
            return submitted
        # still PENDING after the bound: infeasible -> unschedulable (stopped), else queued
        if infeasible:
            stopped = self._stop(job_id) if self.stop_unschedulable else False
            submitted.status = "unschedulable"
            submitted.message = (
                f"{job_id} still PENDING after {self.pending_timeout:g} s: {infeasible}"
                + ("; stop requested" if stopped else "")
                + " (Ray keeps a job it can never schedule PENDING; it will not start here)"
            )
        else:
            submitted.status = "pending"
            submitted.message = (
                f"{job_id} still PENDING after {self.pending_timeout:g} s: the cluster "
                f"({evidence['cluster']}) can hold it, so its resources are in use or the "
                f"runtime env is still being set up; Ray says: {state.message}"
            )
        return submitted

    def _infeasible(
        self, spec: SubmissionSpec, cpus: float, gpus: float, resources: ClusterResources
    ) -> str | None:
        if not resources.fits_one_node(cpus, gpus):
            return (
                f"the entrypoint asks for {cpus:g} CPU and {gpus:g} GPU on one node, but the "
                f"cluster has {resources.describe()}; fix: lower num_gpus/world_size, or "
                "submit to a cluster with GPU nodes (RAY_ADDRESS)"
            )
        need = spec.num_gpus * spec.world_size
        if spec.launcher == "direct" and need > resources.total_gpus:
            return (
                f"{spec.world_size} worker(s) x {spec.num_gpus:g} GPU = {need:g} GPU, but the "
                f"cluster has {resources.total_gpus:g} GPU in all ({resources.describe()})"
            )
        return None

    # -- status ----------------------------------------------------------------------------

    def status(self, job_id: str) -> Submission:
        """The job's state and Ray's message (``unknown`` when Ray has no such job)."""
        try:
            info = self.client.get_job_info(job_id)
        except Exception as exc:
            return Submission(
                backend=self.name,
                status="unknown",
                message=f"Ray has no job {job_id} at {self.jobs_address}: {exc}",
                job_id=job_id,
            )
        status = _RAY_STATUS.get(str(getattr(info.status, "value", info.status)), "unknown")
        evidence = {
            "ray_status": str(getattr(info.status, "value", info.status)),
            "metadata": info.metadata or {},
            "start_time_ms": info.start_time,
            "end_time_ms": info.end_time,
            "driver_exit_code": getattr(info, "driver_exit_code", None),
        }
        return Submission(
            backend=self.name,
            status=status,  # type: ignore[arg-type]
            message=info.message or status,
            job_id=job_id,
            links=self.links(job_id),
            script=info.entrypoint,
            evidence=evidence,
        )

    def wait(
        self,
        job_id: str,
        timeout: float,
        *,
        until: Callable[[Submission], bool] = lambda s: s.terminal,
    ) -> Submission:
        """Poll until ``until(status)`` (default: a terminal state) or ``timeout`` seconds;
        returns the last status either way (never waits longer)."""
        deadline = time.monotonic() + timeout
        state = self.status(job_id)
        while not until(state) and time.monotonic() < deadline:
            time.sleep(min(self.poll_interval, max(0.0, deadline - time.monotonic())))
            state = self.status(job_id)
        return state

    def logs(self, job_id: str) -> str:
        """The job's driver log (stdout and stderr of the entrypoint)."""
        return str(self.client.get_job_logs(job_id))

    def stop(self, job_id: str) -> bool:
        """Ask Ray to stop the job (fire and forget)."""
        return self._stop(job_id)

    def links(self, job_id: str) -> dict[str, str]:
        base = self.jobs_address.rstrip("/")
        return {"dashboard": f"{base}/#/jobs/{job_id}", "logs": f"{base}/api/jobs/{job_id}/logs"}

    def _wait_while_pending(self, job_id: str, timeout: float) -> Submission:
        return self.wait(job_id, timeout, until=lambda s: s.status not in ("pending", "unknown"))

    def _stop(self, job_id: str) -> bool:
        try:
            return bool(self.client.stop_job(job_id))
        except Exception:
            return False
