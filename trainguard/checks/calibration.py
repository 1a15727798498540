"""Tolerances measured, not guessed: ``trainguard calibrate`` runs a job's reference several times
with one seed and across seeds, and stores per-step statistics as this machine's calibration.

A job that is correct but not bitwise deterministic (GPU atomics, a reduction whose order varies)
cannot pass an exact resume or N-vs-1 comparison, and loosening ``rtol`` by guesswork hides real
bugs. Megatron-LM derives its golden bands from repeated runs instead; so does this:

* **same seed**, ``runs`` times: per step, the mean and the spread (largest minus smallest value)
  of every metric -- the run-to-run noise of this job on this machine;
* **across seeds** (the seed, then ``runs - 1`` more): per step, the mean and standard deviation.

Files are versioned JSON beside the canary baselines, one per job and request (the job file and
its command and metrics: :class:`~trainguard.checks.statefiles.JobKey`; steps, seed, world size,
args)::

    .trainguard/calibration/<machine-id>/<NNNN>_<commit>[_dirty].json

Every value is checked when the file is read (finite, at most 1e300, the steps of its run): a
file that fails is skipped with the reason, never used. When a check's run has a calibration of
the same job and request, :func:`tolerance_for` lets each step
differ by up to :data:`BAND_FACTOR` x the same-seed *envelope* (the largest spread measured at
that step or any before it), or by the check's own ``rtol``/``atol`` when larger; the report says
which tolerance was used and where it came from. The determinism check is never loosened: a job
whose same-seed runs differ still fails it, with the measured spread in its summary.
"""

from __future__ import annotations

import datetime
import math
import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict

from trainguard._internal.gitstate import git_state
from trainguard._internal.machine import machine_id, machine_info
from trainguard._internal.readers import OverLimit, Unreadable, active_limits, read_json
from trainguard._version import __version__
from trainguard.checks.baseline import (
    BaselineEvidence,
    BaselineOutcome,
    baseline_files,
    steps_differ,
    write_numbered,
)
from trainguard.checks.calibration_steps import StepSpreads, measure_step_spreads
from trainguard.checks.statefiles import (
    JobKey,
    StoredRequest,
    checked_count,
    checked_numbers,
    checked_steps,
    mapping_or_empty,
)
from trainguard.checks.step_compare import SsTolerance
from trainguard.errors import TrainguardError
from trainguard.evidence import UNSET, Evidence, Unset
from trainguard.launch import RunResult
from trainguard.launch.metrics import trajectory
from trainguard.run.request import RunRequest
from trainguard.run.runner import JobRunner

if TYPE_CHECKING:  # pragma: no cover
    from trainguard.config import JobFile

__all__ = [
    "ACROSS_FACTOR",
    "BAND_FACTOR",
    "Calibration",
    "CalibrationError",
    "CalibrationRuns",
    "CalibrationSummary",
    "MetricStats",
    "MetricSummary",
    "ToleranceEvidence",
    "ToleranceUsed",
    "calibrate_request",
    "calibration_requests",
    "canary_calibrated",
    "find_calibration",
    "load_calibration",
    "metric_stats",
    "save_calibration",
    "spread_note",
    "tolerance_for",
]

#: 2: keyed to the job (``job_key``); version 1 files are refused (calibrate again)
FORMAT_VERSION = 2
_KIND = "trainguard-calibration"
#: a step may differ by this many times the same-seed envelope measured up to it
BAND_FACTOR = 3.0
#: the fewest same-seed runs a calibration is made of
MIN_RUNS = 3


class CalibrationError(TrainguardError):
    """A calibration file that cannot be read, or a calibration that could not be made."""


@dataclass(frozen=True)
class MetricStats:
    """One metric's statistics per step (the steps every same-seed run printed)."""

    steps: list[int]
    same_mean: list[float]
    #: largest minus smallest value of the same-seed runs at each step
    same_spread: list[float]
    across_mean: list[float]
    #: sample standard deviation across seeds (0 with one seed)
    across_std: list[float]

    def envelope(self) -> dict[int, float]:
        """Step -> the largest same-seed spread at that step or any before it (noise that showed
        once can show at any later step), and never less than the smallest spread seen at all:
        a loss printed rounded (``{loss:.6f}``) shows noise only where it crosses a rounding
        boundary, so a noisy job may differ by one printed unit at any step."""
        seen = [v for v in self.same_spread if math.isfinite(v) and v > 0]
        out, worst = {}, min(seen, default=0.0)
        for step, spread in zip(self.steps, self.same_spread, strict=True):
            worst = max(worst, spread) if math.isfinite(spread) else worst
            out[step] = worst
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "same_seed": {"mean": self.same_mean, "spread": self.same_spread},
                "across_seeds": {"mean": self.across_mean, "std": self.across_std}}


def metric_stats(same: Sequence[Mapping[int, float]], across: Sequence[Mapping[int, float]]) -> MetricStats | None:
    """The statistics of one metric's trajectories: ``same`` (same seed) and ``across`` (one per
    seed); None when the same-seed runs share no step."""
    steps = sorted(set.intersection(*(set(t) for t in same))) if same else []
    if not steps:
        return None
    stats = MetricStats(steps, [], [], [], [])
    for step in steps:
        values = [t[step] for t in same]
        finite = [v for v in values if math.isfinite(v)]
        stats.same_mean.append(statistics.fmean(finite) if finite else math.nan)
        stats.same_spread.append(max(finite) - min(finite) if len(finite) == len(values) else math.inf)
        seeded = [t[step] for t in across if step in t and math.isfinite(t[step])]
        stats.across_mean.append(statistics.fmean(seeded) if seeded else math.nan)
        stats.across_std.append(statistics.stdev(seeded) if len(seeded) > 1 else 0.0)
    return stats


@dataclass(frozen=True)
class Calibration:
    """A loaded calibration file."""

    path: Path
    request: StoredRequest
    runs: int
    metrics: dict[str, MetricStats]
    created_at: str = ""
    #: the job it was made for (None only for a calibration built in memory)
    job: JobKey | None = None
    #: the same-seed spread of each tensor's sum of squares per optimizer step (None: not recorded)
    step_spreads: StepSpreads | None = None

    def mismatch(self, request: StoredRequest) -> list[str]:
        """The compared request fields (steps, seed, world_size, args) that differ from ``request``'s."""
        return [key for key, _, _ in self.request.differences(request)]


def _metric_stats(name: str, entry: Any, last: int) -> MetricStats:
    """One metric's stored statistics, every value checked (ValueError naming the key)."""
    where = f"metrics.{name}"
    entry = mapping_or_empty(entry, where)
    steps = checked_steps(entry.get("steps"), f"{where}.steps", last)
    same = mapping_or_empty(entry.get("same_seed"), f"{where}.same_seed")
    across = mapping_or_empty(entry.get("across_seeds"), f"{where}.across_seeds")
    n = len(steps)
    return MetricStats(steps, checked_numbers(same.get("mean"), f"{where}.same_seed.mean", n),
                       checked_numbers(same.get("spread"), f"{where}.same_seed.spread", n, non_negative=True),
                       checked_numbers(across.get("mean"), f"{where}.across_seeds.mean", n),
                       checked_numbers(across.get("std"), f"{where}.across_seeds.std", n, non_negative=True))


def load_calibration(path: Path) -> Calibration:
    """A calibration file read as data (within the read limits, docs/security.md), every value
    checked (finite, at most 1e300, the steps of its run, the job it was made for);
    :class:`CalibrationError` naming the file and the key otherwise."""
    fix = "delete it and run `trainguard calibrate` again"
    try:
        data = read_json(Path(path), active_limits())
    except (Unreadable, OverLimit, OSError) as exc:
        raise CalibrationError(f"{path}: not a readable calibration ({exc}); {fix}") from None
    if not isinstance(data, dict) or data.get("kind") != _KIND:
        raise CalibrationError(f"{path}: not a trainguard calibration (no \"kind\": \"{_KIND}\"); {fix}")
    if data.get("format_version") != FORMAT_VERSION:
        older = " (made before calibrations were keyed to their job file)" if data.get("format_version") == 1 else ""
        raise CalibrationError(f"{path}: calibration format version {str(data.get('format_version'))[:40]}{older}; "
                               f"trainguard {__version__} reads version {FORMAT_VERSION}; {fix}")
    try:
        request = StoredRequest.from_dict(data.get("request"))
        runs = checked_count(data.get("runs"), "runs", MIN_RUNS, 100_000)
        job = JobKey.from_dict(data.get("job_key"))
        raw = mapping_or_empty(data.get("metrics"), "metrics")
        if not raw:
            raise ValueError("metrics holds no metric")
        metrics = {str(name): _metric_stats(str(name)[:80], entry, request.steps) for name, entry in raw.items()}
        spreads = StepSpreads.from_dict(data["step_spreads"]) if data.get("step_spreads") is not None else None
    except ValueError as exc:
        raise CalibrationError(f"{path}: malformed calibration ({exc}); {fix}") from None
    created = data.get("created_at")
    return Calibration(Path(path), request, runs, metrics, created[:40] if isinstance(created, str) else "", job,
                       spreads)


def calibrations_dir(state_dir: Path) -> Path:
    return state_dir / "calibration" / machine_id()


def find_calibration(state_dir: Path, request: RunRequest, job: JobKey) -> tuple[Calibration | None, str]:
    """The newest calibration of this machine made for ``job`` and ``request`` (steps, seed,
    world size, args), and a note naming the files skipped on the way: unreadable or refused
    ones, and when none fits, the newest of the same request made for another job ("" when
    none)."""
    wanted = StoredRequest.of(request)
    problems, other_job = [], ""
    for path in reversed(baseline_files(calibrations_dir(state_dir))):
        try:
            found = load_calibration(path)
        except CalibrationError as exc:
            problems.append(str(exc))
            continue
        if found.mismatch(wanted):
            continue
        differs = found.job.differences(job) if found.job is not None else []
        if not differs:
            return found, "; ".join(problems[:2])
        other_job = other_job or (f"{path.name} was made for another job ({'; '.join(differs)}): not used; "
                                  "run `trainguard calibrate` with this job file")
    return None, "; ".join([*problems[:2], *([other_job] if other_job else [])])


@dataclass(frozen=True)
class CalibrationRuns:
    """What a calibration ran: ``runs`` runs of each request's own seed (the first of
    ``seeds``) and one of each other seed, and where they ran (empty: not recorded)."""

    runs: int
    seeds: list[int]
    run_dirs: list[str] = field(default_factory=list)
    #: the same-seed runs' spread of each tensor's sum of squares per step (None: no step records)
    step_spreads: StepSpreads | None = None


def save_calibration(state_dir: Path, job_dir: Path, request: RunRequest, ran: CalibrationRuns,
                     metrics: Mapping[str, MetricStats], *, job: JobKey) -> Path:
    """Write the calibration of ``job``'s ``request`` as the next numbered file of this machine
    (atomically)."""
    import json

    git = git_state(job_dir)
    data = {
        "format_version": FORMAT_VERSION, "kind": _KIND, "trainguard_version": __version__,
        "created_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine_info": machine_info(), "commit_info": {"id": git.commit, "dirty": git.dirty},
        "job_key": job.to_dict(), "request": StoredRequest.of(request).to_dict(), "runs": ran.runs, "seeds": ran.seeds,
        "band_factor": BAND_FACTOR,
        "metrics": {name: stats.to_dict() for name, stats in metrics.items()},
        **({"run_dirs": ran.run_dirs} if ran.run_dirs else {}),
        **({"step_spreads": ran.step_spreads.to_dict()} if ran.step_spreads is not None else {}),
    }
    directory = calibrations_dir(state_dir)
    directory.mkdir(parents=True, exist_ok=True)
    suffix = (git.commit[:12] if git.commit else "nogit") + ("_dirty" if git.dirty else "")
    return write_numbered(directory, suffix, (json.dumps(data, indent=1, allow_nan=True) + "\n").encode())


class MetricSummary(TypedDict):
    """One metric of :class:`CalibrationSummary` (``trainguard calibrate``'s output)."""

    max_same_seed_spread: float
    steps: int
    max_across_seed_std: float


class CalibrationSummary(TypedDict):
    """What :func:`calibrate_request` says of a calibration it stored: a JSON wire shape,
    ``trainguard calibrate``'s output (docs/cli.md)."""

    path: str
    runs: int
    launches: int
    seconds: float
    metrics: dict[str, MetricSummary]


def calibrate_request(runner: JobRunner, request: RunRequest, runs: int) -> tuple[Path, CalibrationSummary]:
    """Run ``request`` ``runs`` times with its seed and once with each of ``runs - 1`` more seeds,
    store the statistics, return the file and a summary. :class:`CalibrationError` when a run
    does not complete (a calibration of runs that failed measures nothing)."""
    import dataclasses

    started = time.monotonic()
    same = [runner.scheduling.reference(request)]
    same += [runner.run(request, label=f"calibrate-same-{i}") for i in range(2, runs + 1)]
    seeds = [request.seed + i for i in range(1, runs)]
    across = [same[0]] + [runner.run(dataclasses.replace(request, seed=s), label=f"calibrate-seed-{s}") for s in seeds]
    failed = [r for r in [*same, *across] if not r.ok]
    if failed:
        raise CalibrationError(f"a calibration run did not complete ({failed[0].reason}; run dir "
                               f"{failed[0].run_dir}): fix the job, then calibrate again")
    metrics = {}
    for name in runner.job_file.job.metrics:
        stats = metric_stats([_curve(r, name) for r in same], [_curve(r, name) for r in across])
        if stats is not None:
            metrics[name] = stats
    if not metrics:
        raise CalibrationError("the calibration runs printed no metric of job.metrics on a common step")
    _refuse_non_finite(metrics, [*same, *across[1:]])
    ran = CalibrationRuns(runs, [request.seed, *seeds], [str(r.run_dir) for r in [*same, *across[1:]]],
                          measure_step_spreads([r.run_dir for r in same]))
    path = save_calibration(runner.job_file.state_dir, runner.job_file.cwd, request, ran, metrics,
                            job=JobKey.of(runner.job_file))
    summary = {name: MetricSummary(max_same_seed_spread=max(s.same_spread), steps=len(s.steps),
                                   max_across_seed_std=max(s.across_std)) for name, s in metrics.items()}
    return path, CalibrationSummary(path=str(path), runs=runs, launches=len(same) + len(across) - 1,
                                    seconds=round(time.monotonic() - started, 1), metrics=summary)


def _curve(result: RunResult, name: str) -> dict[int, float]:
    return trajectory(result.points, name)


def _refuse_non_finite(metrics: Mapping[str, MetricStats], results: Sequence[RunResult]) -> None:
    """:class:`CalibrationError` when a run printed a NaN or infinite value on a calibrated step:
    its spread is infinite, and a band of it compares nothing."""
    for name, stats in metrics.items():
        for result in results:
            curve = _curve(result, name)
            bad = next((s for s in stats.steps if not math.isfinite(curve[s])), None)
            if bad is not None:
                raise CalibrationError(f"run {result.run_dir} printed {name} {curve[bad]} at step {bad}: a "
                                       "calibration measures the noise of finite values; fix the job, then "
                                       "calibrate again")


@dataclass
class ToleranceUsed:
    """The tolerance a comparison used and where it came from (the report's ``tolerance``)."""

    rtol: float
    atol: float
    source: str
    calibration: Calibration | None = None
    #: metric -> step -> the largest absolute difference the calibration allows there
    bands: dict[str, dict[int, float]] = field(default_factory=dict)

    def band(self, metric: str) -> dict[int, float] | None:
        return self.bands.get(metric)

    @property
    def exact_state(self) -> bool:
        """Whether final checkpoints can be asked to match exactly (rtol/atol): not when the
        calibration measured run-to-run noise (every tensor then differs a little)."""
        return not any(v > 0 for band in self.bands.values() for v in band.values())

    def ratio(self, metric: str, step: int, diff: float) -> float | None:
        """``diff`` as a multiple of the same-seed envelope at ``step`` (None without one)."""
        band = self.bands.get(metric, {})
        spread = band.get(step, 0.0) / BAND_FACTOR
        return diff / spread if spread > 0 else None

    def words(self, metric: str, step: int, diff: float) -> str:
        ratio = self.ratio(metric, step, diff)
        return f" ({ratio:.1f}x the same-seed spread calibrated there)" if ratio is not None else ""

    def within(self) -> str:
        """For a passing verdict: the calibrated band it passed within ("" without one)."""
        if self.calibration is None:
            return ""
        widest = max((v for band in self.bands.values() for v in band.values()), default=0.0)
        return (f"; within {BAND_FACTOR:g}x the same-seed spread of calibration {self.calibration.path.name} "
                f"(at most {widest:.3g})" if widest > 0 else
                f"; calibration {self.calibration.path.name} measured no run-to-run noise: compared exactly")

    def ss_tolerance(self) -> SsTolerance:
        """How two runs' sums of squares are compared step by step (:mod:`trainguard.checks.step_compare`):
        within the default relative tolerance, or :data:`BAND_FACTOR` x the same-seed spread per
        tensor and step where this calibration recorded it."""
        found = self.calibration
        if found is None or found.step_spreads is None:
            why = "" if found is None else f"; calibration {found.path.name} recorded no per-tensor spread"
            return SsTolerance(source=why)
        return SsTolerance(spreads=found.step_spreads.envelopes(), factor=BAND_FACTOR,
                           source=f" (calibration {found.path.name})")

    def as_evidence(self) -> ToleranceEvidence:
        out = ToleranceEvidence(self.rtol, self.atol, self.source)
        if self.calibration is not None:
            out.calibration = str(self.calibration.path)
            out.band_factor = BAND_FACTOR
            out.band_max = {m: max(b.values(), default=0.0) for m, b in self.bands.items()}
        return out


@dataclass
class ToleranceEvidence(Evidence):
    """The tolerance a comparison used (the report's ``tolerance``, :class:`ToleranceUsed`)."""

    rtol: float
    atol: float
    #: where rtol/atol came from, in words
    source: str
    #: the calibration file that widened it, the factor, and per metric the widest band
    calibration: str | Unset = UNSET
    band_factor: float | Unset = UNSET
    band_max: dict[str, float] | Unset = UNSET


def tolerance_for(job_file: JobFile, spec: Any, request: RunRequest, check: str) -> ToleranceUsed:
    """``spec``'s rtol/atol (from the job file, or the defaults), widened per step to
    :data:`BAND_FACTOR` x the same-seed envelope of this machine's calibration of ``request``."""
    explicit = {"rtol", "atol"} & set(spec.model_fields_set)
    own = f"checks.{check}.{'/'.join(sorted(explicit))} (job file)" if explicit else f"checks.{check} defaults"
    found, note = find_calibration(job_file.state_dir, request, JobKey.of(job_file))
    skipped = f"; calibration files skipped: {note}" if note else ""
    if found is None:
        return ToleranceUsed(spec.rtol, spec.atol, own + skipped)
    bands = {m: {s: BAND_FACTOR * v for s, v in stats.envelope().items()} for m, stats in found.metrics.items()}
    return ToleranceUsed(spec.rtol, spec.atol, f"the larger of {own} and {BAND_FACTOR:g} x the same-seed spread of "
                     f"calibration {found.path.name} ({found.runs} runs, {found.created_at}){skipped}", found, bands)


def spread_note(job_file: JobFile, request: RunRequest) -> str:
    """For a failed determinism check: what this machine's calibration of ``job_file``'s
    ``request`` measured of the same-seed runs ("" without one)."""
    found, _ = find_calibration(job_file.state_dir, request, JobKey.of(job_file))
    if found is None:
        return ""
    worst = {m: max(s.same_spread, default=0.0) for m, s in found.metrics.items()}
    noisy = {m: v for m, v in worst.items() if v > 0}
    if not noisy:
        return (f"; calibration {found.path.name} saw {found.runs} same-seed runs agree exactly, so "
                "this is new since it was made")
    shown = ", ".join(f"{m} up to {v:.3g}" for m, v in noisy.items())
    return (f"; calibration {found.path.name} measured a same-seed spread of {shown} over {found.runs} "
            "runs: the job is not bitwise deterministic (determinism stays exact; resume, parallel, "
            "reshard and compat compare within that band)")


def calibration_requests(runner: JobRunner, only: Sequence[str] | None = None) -> list[tuple[RunRequest, list[str]]]:
    """The reference runs whose calibration the configured checks read (each check's
    descriptor says which: :attr:`trainguard.config.registry.Check.calibrates`), each once, with
    the checks that read it; ``only``: of those checks alone."""
    from trainguard.config.registry import check_for

    found: dict[RunRequest, list[str]] = {}
    for name, spec in runner.job_file.enabled_checks():
        descriptor = check_for(name)
        if descriptor is None or descriptor.calibrates is None or (only and name not in only):
            continue
        for size in descriptor.calibrates(spec):
            found.setdefault(runner.request_for(spec, world_size=size), []).append(name)
    return list(found.items())


#: a canary stays within this many across-seed standard deviations of the calibration's mean
ACROSS_FACTOR = 3.0


def canary_calibrated(job_file: JobFile, save_baseline: bool, spec: Any, request: RunRequest,
                      result: RunResult) -> BaselineOutcome | None:
    """The canary's band from this machine's calibration of its run: the across-seed mean ±
    :data:`ACROSS_FACTOR` x the across-seed standard deviation, per step (smoothed like a
    baseline band). None when there is none (or a baseline is being saved, or
    ``checks.canary.baseline`` names a file): the saved baseline decides then."""
    from trainguard.checks.band import calibrated_band, compare_to_band, plot_bands

    if save_baseline or spec.baseline != "latest":
        return None
    found, _ = find_calibration(job_file.state_dir, request, JobKey.of(job_file))
    if found is None:
        return None
    verdicts = []
    source = f"±{ACROSS_FACTOR:g} across-seed std of calibration {found.path.name}"
    for metric in ["loss", *([spec.val_metric] if spec.val_metric and spec.val_metric != "loss" else [])]:
        stats, run = found.metrics.get(metric), result.trajectory(metric)
        if stats is not None and run:
            differ = steps_differ(metric, run, dict.fromkeys(stats.steps, 0.0), f"calibration {found.path.name}")
            if differ is not None:
                return BaselineOutcome.refusal(f"{differ}; run `trainguard calibrate` again", path=str(found.path))
            band = calibrated_band(metric, dict(zip(stats.steps, stats.across_mean, strict=True)),
                                   dict(zip(stats.steps, stats.across_std, strict=True)), ACROSS_FACTOR, source)
            verdicts.append(compare_to_band(run, band))
    if not verdicts:
        return None
    outcome = BaselineOutcome(BaselineEvidence("calibrated", path=str(found.path), runs=found.runs,
                                               metrics={v.band.metric: v.as_evidence() for v in verdicts}))
    bad = [v for v in verdicts if not v.ok]
    try:
        outcome.plots.append(str(plot_bands(Path(result.run_dir) / "calibration_band.png", verdicts,
                                            title=f"{job_file.job.name} vs calibration {found.path.name}")))
    except Exception as exc:  # a plot is evidence, never the verdict
        outcome.evidence.plot_error = f"{type(exc).__name__}: {exc}"
    if bad:
        outcome.problems.append("; ".join(v.problem() or "" for v in bad) + f"; calibration {found.path}")
    else:
        outcome.note = f"inside the calibrated band ({source}, {found.runs} seeds)"
    return outcome
