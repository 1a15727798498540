"""Profiling a job: one short run per world size, measured from the outside.

Each run goes through :class:`~trainguard.run.runner.JobRunner` like every other check. While it
runs, trainguard watches it without touching the job's code:

* step times from the arrival times of the slowest rank's step lines (warm-up steps excluded):
  rank 0's, unless the run agent's step clocks name another rank a straggler and it prints them
  (a synchronous job runs at its straggler's pace; :mod:`trainguard.launch.pace`);
* each rank's pace, from those step clocks (multi-rank runs): the per-rank table, its stragglers;
* CPU utilisation of every rank's process tree (psutil) and GPU utilisation (NVML, when
  nvidia-ml-py and a GPU are present), sampled every 0.5 s;
* checkpoint writes: the checkpoint directory is listed at every step line, so a step that
  made a file appear or grow is a checkpoint step, and the checkpoint cost is how much longer
  those steps took than the others (or a job-printed metric, ``checkpoint_metric``);
* the input-pipeline stall share from a job-printed data-wait metric (``data_wait_metric``).

The job's backend (:mod:`trainguard.launch.backend`) says where the ranks' processes are. A
``ray_train`` job (``world_size`` = ``num_workers``) is one launched driver whose workers are
Ray's processes, not the driver's children: its backend finds them by the ``trainguard-worker
rank=R pid=P`` line each prints (read from the driver's stderr log while it runs), and CPU and peak RSS
are those of each worker's process tree, by world rank. Step lines are the driver's report lines
(world rank 0's ``ray.train.report``), the startup is launch -> first report (Ray start-up and
the worker group included), and the checkpoint steps are read from Ray's record in the fit's
storage path (which checkpoint came with which report), not from the directory's changes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
import re
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypedDict

import psutil

from trainguard.config import JobFile, ProfileCheck
from trainguard.launch import Launcher, MetricPoint, RunResult
from trainguard.launch.backend import JobBackend
from trainguard.launch.pace import PaceReport
from trainguard.profiling.stats import StepStats, percentile, step_stats
from trainguard.run.request import RunRequest
from trainguard.run.runner import JobRunner

__all__ = [
    "CheckpointCost",
    "SizeProfile",
    "batch_size_for",
    "measure_size",
    "samples_per_step_for",
    "step_metric_of",
    "throughput_unit",
]

_SAMPLE_S = 0.5


class CheckpointCost(TypedDict, total=False):
    """What one checkpoint write costs (the report's ``sizes[].checkpoint``): from a metric the
    job prints, or from the step times of the steps that wrote to the checkpoint directory
    (then also which steps and their bytes)."""

    detected_by: str
    writes: int
    steps: list[int]
    cost_s: float | None
    bytes_per_write: int
    every_steps: int | None


@dataclass
class SizeProfile:
    """What one run at one world size measured."""

    world_size: int
    outcome: str
    reason: str
    run_dir: str
    samples_per_step: int
    batch_size: int | None
    steps: int
    device: str  # "gpu" when a rank held GPU memory, else "cpu"
    oversubscribed: str | None  # why, when ranks outnumber cores/devices
    duration_s: float
    startup_s: float | None  # launch -> the first step line of rank 0
    tail_s: float | None  # the last step line -> every rank exited
    warmup_s: float | None  # the first step line -> the last warm-up step's line
    step: StepStats | None
    throughput_sps: float | None  # samples per second over the measured steps
    peak_rss_mb: dict[int, float] = field(default_factory=dict)
    peak_gpu_mb: dict[int, float] = field(default_factory=dict)
    cpu_util_pct: dict[int, float] = field(default_factory=dict)  # % of one core, per rank tree
    gpu_util_pct: float | None = None
    checkpoint: CheckpointCost = field(default_factory=CheckpointCost)
    data_wait_share: float | None = None
    loss: dict[int, float] = field(default_factory=dict)  # rank 0's loss curve
    #: each rank's pace from the run agent's step clocks (multi-rank runs; docs/drills.md "Stragglers")
    pace: PaceReport | None = None
    #: the rank whose step lines time the steps: the straggler named, when it prints them, else 0
    timed_rank: int = 0

    @property
    def ok(self) -> bool:
        return self.outcome == "ok" and self.step is not None

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["step"] = self.step.to_dict() if self.step is not None else None
        data["pace"] = self.pace.to_dict() if self.pace is not None else None
        for key in ("peak_rss_mb", "peak_gpu_mb", "cpu_util_pct", "loss"):
            data[key] = {str(k): v for k, v in getattr(self, key).items()}
        return data


def step_metric_of(job_file: JobFile, spec: ProfileCheck) -> str:
    """The metric whose lines end a step: ``spec.step_metric``, else ``loss``, else the first."""
    if spec.step_metric:
        return spec.step_metric
    return job_file.job.progress_metric


def batch_size_for(job_file: JobFile, spec: ProfileCheck, world_size: int) -> int | None:
    """The {batch_size} at ``world_size``: fixed (strong scaling) or times the ranks (weak)."""
    base = spec.batch_size or job_file.job.batch_size
    if base is None:
        return None
    return base * world_size if spec.scaling == "weak" else base


def samples_per_step_for(job_file: JobFile, spec: ProfileCheck, world_size: int) -> int:
    """Global samples per step at ``world_size`` (weak scaling: the base times the ranks)."""
    if spec.samples_per_step is not None:
        base = spec.samples_per_step
        return base * world_size if spec.scaling == "weak" else base
    batch = batch_size_for(job_file, spec, world_size)
    # neither known: throughput counts steps (see throughput_unit)
    return batch if batch is not None else 1


def throughput_unit(job_file: JobFile, spec: ProfileCheck) -> str:
    """``samples/s``, or ``steps/s`` when neither samples_per_step nor a batch size is known."""
    known = spec.samples_per_step is not None or batch_size_for(job_file, spec, 1) is not None
    return "samples/s" if known else "steps/s"


def oversubscription(world_size: int, device: str, gpus: int) -> str | None:
    """Why ``world_size`` ranks are more than this machine has, or None."""
    if device == "gpu":
        if world_size > gpus:
            return f"{world_size} ranks on {gpus} GPU(s): ranks share devices"
        return None
    cores = psutil.cpu_count(logical=True) or 1
    if world_size > cores:
        return f"{world_size} ranks on {cores} CPU core(s): ranks share cores"
    return None


class _ResourceSampler:
    """Samples CPU time of every rank's process tree and GPU utilisation in a thread; the ranks'
    processes are the backend's (:meth:`JobBackend.rank_pids`). When they are not the launched
    processes (a Ray Train job's workers), their trees' peak RSS too: the launcher's figure is
    the driver's alone."""

    def __init__(self, backend: JobBackend) -> None:
        self._backend = backend
        self._pids: Callable[[], dict[int, int]] | None = None
        #: the ranks' own peak RSS is sampled here, not by the launcher
        self._rss = not backend.ranks_are_children()
        self.peak_rss_mb: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # (pid, create_time) -> the latest CPU seconds seen, per rank: an exited DataLoader
        # worker keeps what it used
        self._cpu: dict[int, dict[tuple[int, float], float]] = {}
        self._first: tuple[float, dict[int, float]] | None = None
        self._last: tuple[float, dict[int, float]] | None = None
        self._gpu_samples: list[float] = []
        self._nvml: Any = None
        self._handles: list[Any] = []

    def attach(self, launcher: Launcher) -> None:
        if self._thread is not None:
            return
        self._pids = self._backend.rank_pids(launcher)
        self._open_nvml()
        self._thread = threading.Thread(target=self._loop, name="trainguard-profile-sampler", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._nvml is not None:
            with contextlib.suppress(Exception):
                self._nvml.nvmlShutdown()

    def _open_nvml(self) -> None:
        try:
            import pynvml  # type: ignore[import-not-found]

            pynvml.nvmlInit()
            self._handles = [
                pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())
            ]
            self._nvml = pynvml
        except Exception:  # no nvidia-ml-py, no driver, no GPU: CPU figures only
            self._nvml, self._handles = None, []

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._sample()
            self._stop.wait(_SAMPLE_S)

    def _sample(self) -> None:
        assert self._pids is not None
        now = time.monotonic()
        totals: dict[int, float] = {}
        for rank, pid in self._pids().items():
            seen = self._cpu.setdefault(rank, {})
            rss = 0
            with contextlib.suppress(psutil.Error):
                root = psutil.Process(pid)
                for proc in [root, *root.children(recursive=True)]:
                    with contextlib.suppress(psutil.Error):
                        times = proc.cpu_times()
                        seen[(proc.pid, proc.create_time())] = times.user + times.system
                        rss += proc.memory_info().rss if self._rss else 0
            totals[rank] = sum(seen.values())
            if rss:
                self.peak_rss_mb[rank] = round(max(self.peak_rss_mb.get(rank, 0.0), rss / 2**20), 1)
        if self._first is None:
            self._first = (now, totals)
        self._last = (now, totals)
        if self._nvml is not None and self._handles:
            with contextlib.suppress(Exception):
                rates = [self._nvml.nvmlDeviceGetUtilizationRates(h).gpu for h in self._handles]
                self._gpu_samples.append(max(float(r) for r in rates))

    def peak_rss(self, result: RunResult) -> dict[int, float]:
        """Each rank's peak RSS in MB: sampled here, or the launcher's when the ranks are its
        processes."""
        return dict(self.peak_rss_mb) if self._rss else dict(result.peak_rss_mb)

    def cpu_util_pct(self) -> dict[int, float]:
        """Mean CPU use per rank tree while sampled, in % of one core."""
        if self._first is None or self._last is None or self._last[0] <= self._first[0]:
            return {}
        (t0, first), (t1, last) = self._first, self._last
        return {
            rank: round(100.0 * (last[rank] - first.get(rank, 0.0)) / (t1 - t0), 1)
            for rank in last
        }

    def gpu_util_pct(self) -> float | None:
        return round(sum(self._gpu_samples) / len(self._gpu_samples), 1) if self._gpu_samples else None


#: a step in a checkpoint's name: after step/iter/checkpoint/ckpt (a bare number may be a rank)
_NAMED_STEP = re.compile(r"(?:step|iter|iteration|checkpoint|ckpt)[-_=]?(\d+)", re.I)


def _named_step(path: str, directory: Path | None) -> int | None:
    """The step a checkpoint file's name, or its folder's under the checkpoint directory, holds
    (``ckpt_000005.pt``, ``step_000010/__0_0.distcp``, ``checkpoint-500/``)."""
    rel = Path(path).relative_to(directory) if directory is not None else Path(path)
    for part in [*reversed(rel.parts[:-1]), rel.parts[-1]]:  # the folder first
        match = _NAMED_STEP.search(part)
        if match:
            return int(match.group(1))
    return None


class _CheckpointWatcher:
    """Lists the checkpoint directory at each step line; remembers which steps wrote files."""

    def __init__(self) -> None:
        self.directory: Path | None = None
        self._files: dict[str, tuple[int, int]] = {}
        self.writes: dict[int, int] = {}  # step -> bytes written or grown

    def _snapshot(self) -> dict[str, tuple[int, int]]:
        out: dict[str, tuple[int, int]] = {}
        if self.directory is None:
            return out
        for root, _dirs, files in os.walk(self.directory):
            for name in files:
                if name.startswith(".") or name.endswith(".tmp"):
                    continue  # temp files of an atomic write in progress
                with contextlib.suppress(OSError):
                    st = os.stat(os.path.join(root, name))
                    out[os.path.join(root, name)] = (st.st_size, st.st_mtime_ns)
        return out

    def start(self, directory: Path) -> None:
        self.directory = directory
        self._files = self._snapshot()

    def at_step(self, step: int, printed_at: float | None = None) -> None:
        """List the directory for the line of ``step``, read at wall time ``printed_at``.

        The monitor may hand lines over late (a burst after a memory scan), when the job has
        already written later checkpoints: a file modified after the line was read belongs to a
        later step, so it is left for the step line read after it."""
        files = self._snapshot()
        grown = 0
        changed = False
        for path, (size, mtime) in list(files.items()):
            old = self._files.get(path)
            if old is None or old[1] != mtime:
                named = _named_step(path, self.directory) if old is None else None
                if (named is not None and named > step) or (
                        named is None and printed_at is not None and mtime / 1e9 > printed_at):
                    if old is None:
                        del files[path]
                    else:
                        files[path] = old
                    continue
                if named is not None and named != step:
                    # a new file named by its step (ckpt_000005.pt, step_000010/) belongs to that
                    # step, however late its line was read: lines 2-5 can arrive in one burst after
                    # step 5's save
                    self.writes[named] = self.writes.get(named, 0) + size
                    continue
                changed = True
                grown += size if old is None else max(0, size - old[0])
        self._files = files
        if changed:
            self.writes[step] = self.writes.get(step, 0) + grown


def measure_size(
    runner: JobRunner,
    spec: ProfileCheck,
    world_size: int,
    *,
    seed: int,
    gpus: int = 0,
    steps: int | None = None,
    label: str | None = None,
) -> tuple[SizeProfile, RunResult]:
    """Run the job once at ``world_size`` ranks and measure it (see the module docstring)."""
    job_file = runner.job_file
    batch = batch_size_for(job_file, spec, world_size)
    sized = runner
    if batch is not None and batch != job_file.job.batch_size:
        job = job_file.job.model_copy(update={"batch_size": batch})
        sized = runner.sibling(dataclasses.replace(job_file, job=job))  # shares the Ray head
    n_steps = steps or spec.steps
    request = RunRequest.make(
        steps=n_steps, seed=seed, world_size=world_size, args=spec.args, env=spec.env,
        timeout=spec.timeout,
    )
    step_name = step_metric_of(job_file, spec)
    seen = _Observed(_ResourceSampler(sized.backend), _CheckpointWatcher())
    sampler, watcher = seen.sampler, seen.watcher

    def on_metric(point: MetricPoint, launcher: Launcher) -> None:
        sampler.attach(launcher)
        if watcher.directory is None:
            watcher.start(_checkpoint_dir(launcher, sized, request))
        if point.name == step_name:
            # the time its processes were stopped (a check keeping a checkpoint) is not a step's
            seen.by_rank.setdefault(point.rank, {}).setdefault(point.step, launcher.unpaused(point.t))
        if point.rank == 0 and point.name == step_name:
            # point.t is when the line was read (launch clock); the files carry wall times
            watcher.at_step(point.step, time.time() - (launcher.elapsed() - point.t))

    try:
        # timed: the job as it runs without the run agent's step records (docs/step-records.md)
        result = sized.run(request, label=label or f"profile-n{world_size}", on_metric=on_metric,
                           step_records=False)
    finally:
        sampler.close()
    if sized is runner and steps is None:
        # the uninterrupted run other checks of this request share, marked as run without step
        # records: a check that fails against it gets a recorded one for its diagnosis
        runner.scheduling.offer_reference(request, result, records_off=runner.job_file.job.record_steps)
    # a backend's own record of its checkpoints (Ray's) places them better than the listing
    recorded = sized.backend.checkpoint_writes(watcher.directory) if watcher.directory is not None else None
    if recorded is not None:
        watcher.writes = recorded
    return _summarise(job_file, spec, world_size, batch, gpus, result, seen), result


def _checkpoint_dir(launcher: Launcher, runner: JobRunner, request: RunRequest) -> Path:
    # the runner passes the checkpoint directory to the job through its placeholders; for
    # {run_dir}-relative ones it is under the launch's run directory
    values = runner.placeholders(request, launcher.spec.run_dir, None)
    return Path(str(values["checkpoint_dir"]))


@dataclass
class _Observed:
    """What the profile watched during its run: the resources, the checkpoint writes and the
    step lines' arrival times per rank (rank -> step -> seconds into the launch, pauses taken out)."""

    sampler: _ResourceSampler
    watcher: _CheckpointWatcher
    by_rank: dict[int, dict[int, float]] = field(default_factory=dict)

    def timed_rank(self, pace: PaceReport | None) -> int:
        """Whose step lines time the steps: the slowest rank's. Rank 0's, unless ``pace`` names
        a straggler that prints them (every rank's step ends with its; rank 0's line may come
        first)."""
        named = [r.rank for r in pace.stragglers] if pace is not None else []
        return next((r for r in named if self.by_rank.get(r)), 0)


def _summarise(
    job_file: JobFile,
    spec: ProfileCheck,
    world_size: int,
    batch: int | None,
    gpus: int,
    result: RunResult,
    seen: _Observed,
) -> SizeProfile:
    timed_rank = seen.timed_rank(result.pace)
    arrivals, watcher, sampler = seen.by_rank.get(timed_rank, {}), seen.watcher, seen.sampler
    samples = samples_per_step_for(job_file, spec, world_size)
    device = "gpu" if any(v > 0 for v in result.peak_gpu_mb.values()) else "cpu"
    stats: StepStats | None = None
    reason = result.reason
    with contextlib.suppress(ValueError):
        stats = step_stats(arrivals, spec.warmup_steps)
    if stats is None and result.ok:
        reason = (
            f"only {len(arrivals)} step line(s) of {step_metric_of(job_file, spec)!r} from rank {timed_rank}: "
            "too few to time steps after the warm-up"
        )
    throughput = samples / stats.mean_s if stats is not None and stats.mean_s > 0 else None
    last = max(arrivals.values()) if arrivals else None
    first = min(arrivals.values()) if arrivals else None
    loss_name = "loss" if "loss" in job_file.job.metrics else step_metric_of(job_file, spec)
    loss = {p.step: p.value for p in result.points if p.rank == 0 and p.name == loss_name}
    return SizeProfile(
        world_size=world_size,
        outcome=result.outcome if stats is not None or not result.ok else "failed",
        reason=reason,
        run_dir=str(result.run_dir),
        samples_per_step=samples,
        batch_size=batch,
        steps=len(arrivals),
        device=device,
        oversubscribed=oversubscription(world_size, device, gpus),
        duration_s=round(result.duration_s - sum(b - a for a, b in result.pauses), 3),
        startup_s=round(first, 3) if first is not None else None,
        tail_s=round(result.duration_s - sum(b - a for a, b in result.pauses) - last, 3) if last is not None else None,
        warmup_s=_warmup_s(arrivals, spec.warmup_steps),
        step=stats,
        throughput_sps=throughput,
        peak_rss_mb=sampler.peak_rss(result),
        peak_gpu_mb=dict(result.peak_gpu_mb),
        cpu_util_pct=sampler.cpu_util_pct(),
        gpu_util_pct=sampler.gpu_util_pct(),
        checkpoint=_checkpoint_cost(spec, result, stats, watcher),
        data_wait_share=_data_wait_share(spec, result, stats),
        loss=loss,
        pace=result.pace,
        timed_rank=timed_rank,
    )


def _warmup_s(arrivals: dict[int, float], warmup_steps: int) -> float | None:
    if not arrivals:
        return None
    first = min(arrivals)
    end = arrivals.get(max(warmup_steps, first))
    return round(end - arrivals[first], 3) if end is not None else None


def _checkpoint_cost(
    spec: ProfileCheck, result: RunResult, stats: StepStats | None, watcher: _CheckpointWatcher
) -> CheckpointCost:
    """Seconds one checkpoint write costs, from a job-printed metric or from the step times."""
    if spec.checkpoint_metric:
        values = [p.value for p in result.points if p.rank == 0 and p.name == spec.checkpoint_metric]
        if values:
            return {
                "detected_by": f"metric {spec.checkpoint_metric}",
                "writes": len(values),
                "cost_s": sum(values) / len(values),
                "every_steps": None,
            }
    if stats is None or not watcher.writes:
        return {"detected_by": "checkpoint directory", "writes": 0, "cost_s": None, "every_steps": None}
    with_ckpt = [d for s, d in stats.durations.items() if s in watcher.writes]
    without = [d for s, d in stats.durations.items() if s not in watcher.writes]
    cost = None
    if with_ckpt and without:
        # medians: an epoch boundary or an eval step among either group would skew a mean
        cost = max(0.0, percentile(with_ckpt, 50) - percentile(without, 50))
    steps = sorted(watcher.writes)
    gaps = [b - a for a, b in itertools.pairwise(steps)]
    return {
        "detected_by": "checkpoint directory",
        "writes": len(steps),
        "steps": steps,
        "cost_s": cost,
        "bytes_per_write": int(sum(watcher.writes.values()) / len(steps)),
        "every_steps": int(percentile(gaps, 50)) if gaps else None,
    }


def _data_wait_share(spec: ProfileCheck, result: RunResult, stats: StepStats | None) -> float | None:
    """Share of the measured step time rank 0 spent waiting for input data."""
    if not spec.data_wait_metric or stats is None:
        return None
    waits = {
        p.step: p.value for p in result.points if p.rank == 0 and p.name == spec.data_wait_metric
    }
    measured = [s for s in stats.durations if s in waits]
    total = sum(stats.durations[s] for s in measured)
    return sum(waits[s] for s in measured) / total if total > 0 else None

