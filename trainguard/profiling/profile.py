"""A whole profile: measure every world size, derive scaling, fit, size, compare, write.

``run_profile`` is the library entry point (the CLI's ``trainguard profile``, the ``profile``
check and pytest items all call it). See docs/profiling.md.
"""

from __future__ import annotations

import contextlib
import datetime
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypedDict

import psutil

from trainguard._internal.atomic import fallback_dir, os_error_text, warn
from trainguard._internal.machine import MachineInfo
from trainguard._version import __version__
from trainguard.config import ProfileCheck, Target
from trainguard.launch.rundir import new_run_dir
from trainguard.profiling.compare import (
    Regression,
    RegressionCheck,
    compare_profiles,
    latest_profile_baseline,
    profile_baselines_dir,
    save_profile_baseline,
)
from trainguard.profiling.headroom import Headroom, run_headroom
from trainguard.profiling.measure import (
    SizeProfile,
    measure_size,
    samples_per_step_for,
    step_metric_of,
    throughput_unit,
)
from trainguard.profiling.sizing import BatchHeadroom, SizeInputs, Sizing, size_run
from trainguard.profiling.stats import ScalingFit, fit_scaling, phrase_scaling, scaling_table
from trainguard.run.runner import JobRunner

__all__ = ["Profile", "run_profile"]

PROFILE_SCHEMA_VERSION = 1


class ProfileMachine(MachineInfo):
    """The report's ``machine``: :func:`~trainguard._internal.machine.machine_info` and the GPUs'
    names."""

    gpus: list[str]


class ProfileCommit(TypedDict):
    """The report's ``commit``: the job's git commit (None outside git), and whether its tree
    had changes (None: unknown)."""

    id: str | None
    dirty: bool | None


class Prediction(TypedDict):
    """The report's ``scaling.predictions`` of one world size: measured, or from the fit."""

    throughput_sps: float | None
    #: "measured" or "<model> fit"
    source: str
    extrapolated: bool
    #: the fit's throughput there (None: no fit)
    fit_sps: float | None


@dataclass
class Profile:
    """Everything one profile measured and derived; ``to_dict`` is the JSON report."""

    job: str
    job_file: str
    spec: ProfileCheck
    sizes: list[SizeProfile]
    run_dir: Path
    device: str
    machine: ProfileMachine
    commit: ProfileCommit
    table: dict[int, dict[str, float]] = field(default_factory=dict)
    phrase: str = ""
    fit: ScalingFit | None = None
    sizing: Sizing | None = None
    notes: list[str] = field(default_factory=list)
    regressions: list[Regression] = field(default_factory=list)
    baseline_path: str | None = None
    saved_path: str | None = None
    unit: str = "samples/s"
    #: the batch-size / memory headroom search (checks.profile.headroom); None when not run
    headroom: Headroom | None = None
    created_at: str = field(
        default_factory=lambda: datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    )

    @property
    def ok_sizes(self) -> list[SizeProfile]:
        return [s for s in self.sizes if s.ok]

    @property
    def failed_sizes(self) -> list[SizeProfile]:
        return [s for s in self.sizes if not s.ok]

    @property
    def regressed(self) -> list[Regression]:
        return [r for r in self.regressions if r.regressed]

    def predictions(self, upto: int) -> dict[int, Prediction]:
        """Throughput per world size 1..upto: measured where measured, else from the fit."""
        out: dict[int, Prediction] = {}
        measured = {s.world_size: s.throughput_sps for s in self.ok_sizes}
        fitted = self.fit is not None and self.fit.model is not None
        for n in range(1, upto + 1):
            fit_sps = self.fit.throughput(n) if fitted and self.fit is not None else None
            if n in measured:
                out[n] = {"throughput_sps": measured[n], "source": "measured", "extrapolated": False,
                          "fit_sps": fit_sps}
            elif fit_sps is not None and self.fit is not None:
                out[n] = {
                    "throughput_sps": fit_sps,
                    "source": f"{self.fit.chosen} fit",
                    "extrapolated": self.fit.extrapolated(n),
                    "fit_sps": fit_sps,
                }
        return out

    def to_dict(self) -> dict[str, Any]:
        upto = max([2 * s.world_size for s in self.sizes] + [self.spec_target_gpus()])
        return {
            "schema_version": PROFILE_SCHEMA_VERSION,
            "kind": "trainguard-profile-report",
            "trainguard_version": __version__,
            "created_at": self.created_at,
            "job": self.job,
            "job_file": self.job_file,
            "run_dir": str(self.run_dir),
            "device": self.device,
            "throughput_unit": self.unit,
            "measured_on": self.measured_on(),
            "machine": self.machine,
            "commit": self.commit,
            "settings": {
                "steps": self.spec.steps,
                "warmup_steps": self.spec.warmup_steps,
                "world_sizes": self.spec.world_sizes,
                "scaling": self.spec.scaling,
                "args": list(self.spec.args),
            },
            "sizes": [s.to_dict() for s in self.sizes],
            "scaling": {
                "kind": self.spec.scaling,
                "table": {str(k): v for k, v in self.table.items()},
                "phrase": self.phrase,
                "fit": self.fit.to_dict() if self.fit is not None else None,
                "predictions": {str(k): v for k, v in self.predictions(upto).items()},
            },
            "sizing": self.sizing.to_dict() if self.sizing is not None else None,
            "headroom": self.headroom.to_dict() if self.headroom is not None else None,
            "compare": {
                "baseline": self.baseline_path,
                "results": [
                    {
                        "expression": r.check.expression, "world_size": r.world_size,
                        "baseline": r.baseline, "current": r.current, "change": r.change,
                        "regressed": r.regressed, "text": r.describe(),
                    }
                    for r in self.regressions
                ],
            },
            "saved_baseline": self.saved_path,
            "notes": self.notes,
        }

    def spec_target_gpus(self) -> int:
        if self.sizing is not None:
            return int(self.sizing.target.get("max_gpus") or 0)
        return 0

    def measured_on(self) -> str:
        cores = psutil.cpu_count(logical=True) or 1
        if self.device == "gpu":
            gpus = self.machine.get("gpus") or []
            return f"GPU ({', '.join(sorted(set(gpus))) or 'unknown model'}; {len(gpus)} device(s))"
        return (
            f"CPU ({cores} core(s), {self.machine.get('cpu') or 'unknown model'}): figures "
            "measured on CPU do not carry over to GPUs"
        )


def _gpus() -> list[str]:
    names: list[str] = []
    try:
        import pynvml  # type: ignore[import-not-found]

        pynvml.nvmlInit()
        try:
            for i in range(pynvml.nvmlDeviceGetCount()):
                names.append(str(pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(i))))
        finally:
            with contextlib.suppress(Exception):
                pynvml.nvmlShutdown()
    except Exception:
        return names
    return names


def _gpu_memory_mb() -> float | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            return float(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).total) / 2**20
        finally:
            with contextlib.suppress(Exception):
                pynvml.nvmlShutdown()
    except Exception:
        return None


def run_profile(
    runner: JobRunner,
    spec: ProfileCheck,
    *,
    target: Target | None = None,
    compare: list[RegressionCheck] | None = None,
    save: bool = False,
    world_sizes: list[int] | None = None,
    headroom: bool | None = None,
) -> Profile:
    """Profile the runner's job at each world size, search the memory headroom
    (``spec.headroom``; ``headroom=False`` skips it, True needs it configured), fit, size against
    ``target``, compare with this machine's latest profile baseline (``compare``), optionally
    save it as the new one."""
    from trainguard._internal.gitstate import git_state
    from trainguard._internal.machine import machine_info

    job_file = runner.job_file
    seed = spec.seed if spec.seed is not None else runner.settings.seed
    gpu_names = _gpus()
    machine: ProfileMachine = {**machine_info(), "gpus": gpu_names}
    git = git_state(job_file.cwd)
    commit, dirty = git.commit, git.dirty
    run_dir = new_run_dir(job_file.state_dir, job_file.job.name, "profile", keep=runner.settings.keep_runs)
    sizes: list[SizeProfile] = []
    for n in sorted(world_sizes or spec.world_sizes):
        size, _ = measure_size(runner, spec, n, seed=seed, gpus=len(gpu_names))
        sizes.append(size)
    device = "gpu" if any(s.device == "gpu" for s in sizes) else "cpu"
    profile = Profile(
        job=job_file.job.name, job_file=str(job_file.path), spec=spec, sizes=sizes,
        run_dir=run_dir, device=device, machine=machine,
        commit={"id": commit, "dirty": dirty}, unit=throughput_unit(job_file, spec),
    )
    if profile.unit == "steps/s":
        profile.notes.append(
            "neither checks.profile.samples_per_step nor a batch size is set: throughput is in "
            "steps per second (set samples_per_step for samples per second)"
        )
    profile.notes.append(
        f"step times exclude the first {spec.warmup_steps} step(s) of each run (warm-up) and "
        f"come from the arrival times of the slowest rank's {step_metric_of(job_file, spec)!r} lines: "
        "rank 0's unless a straggler is named that prints them (a synchronous job runs at its "
        "slowest rank's pace; sizes[].timed_rank)"
    )
    if device == "cpu":
        profile.notes.append("measured on CPU: GPU step times, memory and scaling will differ")
    profile.notes += [note for s in sizes for note in _size_notes(s)]
    if headroom and spec.headroom is None:
        raise ValueError("headroom=True needs checks.profile.headroom configured")
    if spec.headroom is not None and headroom is not False:
        gpu_total = _gpu_memory_mb() if device == "gpu" else None
        profile.headroom = run_headroom(runner, spec, device=device, gpu_total_mb=gpu_total)
        profile.notes += [f"headroom: {n}" for n in profile.headroom.notes]
    ok = profile.ok_sizes
    throughput = {s.world_size: s.throughput_sps for s in ok if s.throughput_sps}
    if throughput:
        profile.table = scaling_table(throughput, spec.scaling)
        profile.phrase = phrase_scaling(profile.table, spec.scaling, "GPUs" if device == "gpu" else "ranks")
        profile.fit = fit_scaling(throughput)
    if target is not None and throughput:
        profile.sizing = _size(profile, target, runner, spec)
    if compare:
        baseline = latest_profile_baseline(job_file.state_dir)
        if baseline is None:
            profile.notes.append(
                "no profile baseline saved for this machine: nothing to compare with "
                "(save one: trainguard profile CONFIG --save)"
            )
        else:
            profile.baseline_path = baseline["path"]
            profile.regressions = compare_profiles(baseline["profile"], profile.to_dict(), compare)
    if save:
        if profile.failed_sizes:
            profile.notes.append("baseline not saved: a world size failed to profile")
        else:
            profile.saved_path = _save_baseline(profile, job_file.state_dir, job_file.cwd)
    return profile


def _size_notes(s: SizeProfile) -> list[str]:
    """What the report says of one world size's run: oversubscribed, failed, a straggler named or
    single-rank work found."""
    notes = []
    if s.oversubscribed:
        notes.append(f"world size {s.world_size} was oversubscribed: {s.oversubscribed}")
    if not s.ok:
        notes.append(f"world size {s.world_size} did not profile: {s.outcome}: {s.reason}")
    if s.pace is not None and s.pace.notable:
        notes.append(f"world size {s.world_size}: {s.pace.summary()}")
    return notes


def _save_baseline(profile: Profile, state_dir: Path, job_dir: Path) -> str | None:
    """Save the profile as this machine's baseline; on a read-only or full disk, under the
    temp-directory fallback instead, said in a note (and on stderr): never lost."""
    try:
        return str(save_profile_baseline(state_dir, job_dir, profile.to_dict()))
    except OSError as exc:
        why = os_error_text(exc)
    aside = None
    base = fallback_dir()
    if base is not None:
        with contextlib.suppress(OSError):
            aside = save_profile_baseline(base, job_dir, profile.to_dict())
    where = profile_baselines_dir(state_dir)
    note = f"could not save the profile baseline in {where}: {why}; " + (
        f"it was saved to {aside} instead: copy that file into {where} to use it" if aside
        else "make that directory writable (or free space) and save again")
    warn(note)
    profile.notes.append(note)
    return None if aside is None else str(aside)


def _size(profile: Profile, target: Target, runner: JobRunner, spec: ProfileCheck) -> Sizing:
    measured: dict[int, SizeInputs] = {}
    for s in profile.ok_sizes:
        assert s.step is not None and s.throughput_sps is not None
        mem = s.peak_gpu_mb if profile.device == "gpu" and s.peak_gpu_mb else s.peak_rss_mb
        measured[s.world_size] = SizeInputs(
            world_size=s.world_size,
            throughput_sps=s.throughput_sps,
            samples_per_step=s.samples_per_step,
            startup_s=s.startup_s or 0.0,
            tail_s=s.tail_s or 0.0,
            checkpoint_cost_s=s.checkpoint.get("cost_s"),
            warmup_s=s.warmup_s or 0.0,
            warmup_steps=spec.warmup_steps,
            peak_mem_mb=max(mem.values()) if mem else None,
            step_p99_s=s.step.p99_s,
            step_max_s=s.step.max_s,
            checkpoint_every_steps=s.checkpoint.get("every_steps"),
        )
    gpu_total = _gpu_memory_mb() if profile.device == "gpu" else None
    host_total = psutil.virtual_memory().total / 2**20

    searched = profile.headroom

    def budget(n: int) -> tuple[float | None, str]:
        if target.memory_budget_mb is not None:
            return target.memory_budget_mb, "target.memory_budget_mb"
        if searched is not None and searched.budget_source.startswith("checks.profile.headroom"):
            return searched.budget_mb, searched.budget_source
        if gpu_total is not None:
            return gpu_total, "the GPU's memory"
        return host_total / n, f"host memory / {n} rank(s) (CPU run)"

    limits = []
    for s in profile.ok_sizes:
        if s.data_wait_share is not None and s.data_wait_share > 0.1:
            limits.append(
                f"input pipeline: rank 0 waits for data {s.data_wait_share:.0%} of the step time "
                f"at {s.world_size} rank(s)"
            )
        if s.oversubscribed:
            limits.append(f"this machine: {s.oversubscribed} (the measured scaling is the machine's)")
        limits += [f"a straggler: rank {r.rank} at {s.world_size} rank(s) is {r.ratio:.2f}x as busy as the busiest "
                   f"other rank; every rank waits for it, so the throughput measured there (rank {s.timed_rank}'s "
                   "step lines) and every size predicted from it is its pace"
                   for r in (s.pace.stragglers if s.pace is not None else ())]
    sizing = size_run(
        target, measured, profile.fit,
        samples_per_step=lambda n: samples_per_step_for(runner.job_file, spec, n),
        device=profile.device, memory_budget_mb=budget, extra_limits=limits,
        unit="GPU(s)" if profile.device == "gpu" else "rank(s)",
    )
    if searched is not None:
        sizing.batch_headroom = BatchHeadroom(
            summary=searched.summary(), budget_mb=searched.budget_mb,
            profile_batch=searched.profile_batch, headroom_mb=searched.headroom_mb,
            peak_mb=searched.peak_at_profile_batch_mb, peak_source=searched.peak_source,
            largest_pass=searched.largest_pass, safe_batch=searched.safe_batch,
            world_size=searched.world_size,
        )
    return sizing

