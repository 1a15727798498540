"""The ``ray_train`` backend: one launched driver process whose ranks are Ray Train workers.

trainguard launches :mod:`trainguard.raytrain.driver` as the job's command, once per run; the
driver runs the user's function with ``TorchTrainer`` on ``world_size`` workers, which are
processes of a raylet, not children of the driver. So the ranks are found from the
``trainguard-worker`` lines the driver's stderr carries (:class:`~trainguard.raytrain.workers.
RayWorkerTracker`), Ray Train restarts a failed worker group itself (``FailureConfig``), runs of
one job queue for the same Ray CPUs (no background runs), and world rank 0 logs the metrics into
the launch's MLflow run (:mod:`trainguard.raytrain.tracking`). docs/ray-train.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainguard.raytrain.job import RAY_KEYS, expand_ray_job

if TYPE_CHECKING:  # pragma: no cover
    from trainguard.launch import Launcher, LaunchSpec, RunResult
    from trainguard.launch.backend import MetricRow, Reconciled
    from trainguard.launch.reach import RankReach, Restarts
    from trainguard.raytrain.local_ray import LocalRay

__all__ = ["RayTrainBackend", "checkpoint_writes"]


class RayTrainBackend:
    """``kind: ray_train`` (a :class:`~trainguard.launch.backend.JobBackend`): the driver is the
    one launched process; its runs share one embedded Ray head (``RAY_ADDRESS`` when set: a
    real cluster), started on the first launch and stopped by :meth:`close`."""

    title = "Ray Train"
    job_keys: tuple[str, ...] = RAY_KEYS

    def __init__(self) -> None:
        #: the embedded head the runs share (None until the first launch, and after close)
        self.head: LocalRay | None = None

    def ranks_are_children(self) -> bool:
        return False  # the workers are a raylet's processes

    def rank_at_start(self) -> bool:
        return False  # Ray Train sets a worker's rank after its process started

    def concurrent_runs(self) -> bool:
        return False  # runs of one job queue for the same Ray CPUs

    def ranks_log_metrics(self) -> bool:
        return True  # world rank 0 logs into the launch's MLflow run (raytrain.tracking)

    def stoppable_nodes(self) -> bool:
        return True

    def fault_reach(self, fault_kind: str, *, job_name: str, world_size: int) -> RankReach:
        from trainguard.raytrain.reach import RayReach

        return RayReach(fault_kind, self.launch_env, job_name=job_name, world_size=world_size)

    def drill_restarts(self, fault_kind: str, expectation: str, limit: int) -> Restarts:
        from trainguard.raytrain.reach import ray_restarts

        return ray_restarts(fault_kind, expectation, limit)

    def restart_note(self, max_restarts: int) -> str:
        if not max_restarts:
            return ""
        return (f" (Ray Train's FailureConfig(max_failures={max_restarts}) restarted the worker group: "
                "for this job use `expect: recover`, or job.max_restarts 0)")

    def writer_record(self, result: RunResult) -> tuple[Any, str]:
        from trainguard.raytrain.tracking import SUMMARY_FILE, read_summary

        return (read_summary(result.run_dir, result.log_path(0, "stderr")),
                f"no {SUMMARY_FILE} in {result.run_dir} and no `trainguard-tracking` line on the driver's stderr")

    def expand_job(self, data: Mapping[str, Any], placeholders: tuple[str, ...]) -> Mapping[str, Any]:
        return expand_ray_job(data, placeholders)

    def launch_spec(self, spec: LaunchSpec) -> LaunchSpec:
        # one driver process; its workers (spec.world_size) are Ray's, set by --num-workers, and
        # Ray's pooled workers carry the run's environment: Ray ends them, not the teardown
        return dataclasses.replace(spec, world_size=1, end_by_environment=False)

    def launch_env(self) -> dict[str, str]:
        """``RAY_ADDRESS`` when set (a real cluster), else the client environment of one
        embedded local head shared by every run (Ray starts once instead of per run)."""
        if self.head is None:
            from trainguard.raytrain.local_ray import LocalRay

            self.head = LocalRay(dashboard=False)
        return self.head.start().client_env()

    def close(self) -> None:
        if self.head is not None:
            self.head.stop()
            self.head = None

    def reproduce_argv(self, argv: Sequence[str], world_size: int) -> list[str]:
        return list(argv)  # the driver asks Ray for the workers itself

    def rank_pids(self, launcher: Launcher) -> Callable[[], dict[int, int]]:
        if not launcher.ranks:
            return dict
        from trainguard.raytrain.workers import RayWorkerTracker

        return RayWorkerTracker(launcher.ranks[0].stderr_log).pids

    def checkpoint_writes(self, checkpoint_dir: Path) -> dict[int, int] | None:
        return checkpoint_writes(checkpoint_dir)

    def reconcile_metrics(
        self, result: RunResult, rows: Sequence[MetricRow], run_id: str | None
    ) -> Reconciled | None:
        from trainguard.raytrain.tracking import reconcile

        return reconcile(result, rows, run_id)

    def production_spec(self, spec: Any, command: Sequence[str], cwd: Path) -> Any:
        """One Ray Job whose entrypoint is the driver (``--num-workers`` = the recommended world
        size, already in its command), launched as is (``direct``: the driver asks Ray for its
        workers), each worker's resources from ``job.scaling`` (``use_gpu`` -> 1 GPU unless
        ``resources_per_worker`` says otherwise). Relative ``PYTHONPATH`` entries of the job's
        env are made absolute against ``cwd`` (the entrypoint runs in Ray's copy of the working
        dir, where ``../x`` would not resolve)."""
        command = list(command)
        per_worker: dict[str, float] = {}
        if "--resources-per-worker" in command:
            with contextlib.suppress(IndexError, ValueError):
                text = command[command.index("--resources-per-worker") + 1].replace("{{", "{").replace("}}", "}")
                per_worker = {k: float(v) for k, v in json.loads(text).items()}
        use_gpu = "--use-gpu" in command
        # the driver's ray.init(runtime_env=...) repeats some of the job's env_vars (PYTHONPATH,
        # the tracking ids): Ray refuses overlapping keys unless told that the driver's win
        env = {**spec.env, "RAY_OVERRIDE_JOB_RUNTIME_ENV": "1"}
        if env.get("PYTHONPATH"):
            env["PYTHONPATH"] = os.pathsep.join(
                str((cwd / entry).resolve()) if entry and not os.path.isabs(entry) else entry
                for entry in env["PYTHONPATH"].split(os.pathsep)
            )
        return dataclasses.replace(
            spec, launcher="direct", env=env,
            num_gpus=per_worker.get("GPU", 1.0) if use_gpu else 0.0,
            num_cpus=per_worker.get("CPU", 1.0),
            metadata={**spec.metadata, "trainguard.kind": "ray_train",
                      "trainguard.num_workers": str(spec.world_size)},
        )

    def __repr__(self) -> str:
        return f"{type(self).__name__}(head={self.head!r})"


def checkpoint_writes(storage: Path) -> dict[int, int] | None:
    """step -> bytes of each checkpoint a Ray Train fit wrote, from Ray's own record in the
    storage path (``<name>/checkpoint_manager_snapshot.json``: each checkpoint's directory and
    the metrics reported with it). Listing the directory at each report line would misplace
    them: the lines reach the driver late, and Ray rewrites its snapshot after every checkpoint.
    None when there is no such record."""
    writes: dict[int, int] = {}
    found = False
    for snapshot in storage.glob("*/checkpoint_manager_snapshot.json"):
        with contextlib.suppress(OSError, ValueError, TypeError, AttributeError):
            data = json.loads(snapshot.read_text())
            indices = data.get("checkpoint_report_indices") or []
            for i, entry in enumerate(data.get("checkpoint_results") or []):
                step = (entry.get("metrics") or {}).get("step")
                if not isinstance(step, (int, float)):
                    step = indices[i] + 1 if i < len(indices) else None  # the n-th report
                if step is None:
                    continue
                directory = snapshot.parent / str(entry.get("checkpoint_dir_name", ""))
                size = sum(f.stat().st_size for f in directory.rglob("*") if f.is_file()) if directory.is_dir() else 0
                writes[int(step)] = size
                found = True
    return writes if found else None
