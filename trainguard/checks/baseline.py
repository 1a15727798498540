"""Canary baselines: a saved trajectory per machine, and the band later canaries must stay in.

``trainguard check --only canary --save-baseline`` stores the canary's trajectories (``loss``,
and ``val_metric`` when configured) as versioned JSON, the way pytest-benchmark stores its runs::

    .trainguard/baselines/<machine-id>/<NNNN>_<commit>[_dirty].json

``<machine-id>`` is ``<system>-<python implementation>-<python major.minor>-<cpu arch>``
(``Linux-CPython-3.11-x86_64``), ``NNNN`` counts up per machine, ``<commit>`` is the job
repository's commit (``nogit`` outside a repository) and ``_dirty`` marks uncommitted changes.
A file is written to a temp file, fsynced and linked into place under a name no other file has,
so two savers never overwrite each other and a reader never sees half a file.

Later canaries compare their run with the **latest** baseline of this machine saved for the same
request (steps, seed, world size, args), or with the file ``checks.canary.baseline`` names:

* both trajectories are smoothed with a centred rolling median (:func:`smoothing_window` points);
* the band is the baseline's smoothed value ``± baseline_tolerance`` x its magnitude;
* the run fails when its smoothed trajectory stays outside the band for at least half the
  window (rounded up) consecutive points (:func:`compare_to_band`). A median of ``w`` points
  ignores up to ``(w-1)/2`` consecutive outliers, so this takes about ``w`` consecutive bad
  steps: an unlucky batch or two fail nothing, a job that learns worse for a stretch does.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import io
import json
import math
import os
import platform
import re
import statistics
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainguard._internal.atomic import atomic_write_bytes, current_umask, fsync_dir
from trainguard._internal.gitstate import git_state
from trainguard._version import __version__
from trainguard.errors import TrainguardError

if TYPE_CHECKING:  # pragma: no cover
    from trainguard.config import CanaryCheck, JobFile
    from trainguard.launch import RunResult
    from trainguard.run.runner import JobRunner, RunRequest

__all__ = [
    "FORMAT_VERSION",
    "REQUEST_KEYS",
    "Band",
    "BandVerdict",
    "Baseline",
    "BaselineError",
    "BaselineOutcome",
    "Excursion",
    "build_band",
    "canary_baseline",
    "compare_to_band",
    "find_baseline",
    "load_baseline",
    "machine_id",
    "machine_info",
    "plot_bands",
    "read_versioned_json",
    "rolling_median",
    "save_baseline",
    "smoothing_window",
    "write_numbered",
]

#: Version of the baseline file format; files of another version are refused, not guessed at.
FORMAT_VERSION = 1

#: The request fields a baseline must share with the run it is compared with.
REQUEST_KEYS = ("steps", "seed", "world_size", "args")

_KIND = "trainguard-canary-baseline"
_NAME = re.compile(r"^(\d{4,})_.*\.json$")
PLOT_NAME = "baseline_band.png"


class BaselineError(TrainguardError):
    """A baseline file cannot be read or does not fit the run it would be compared with."""


# --------------------------------------------------------------------------------------------
# Where baselines live
# --------------------------------------------------------------------------------------------


def machine_id() -> str:
    """``<system>-<python implementation>-<major.minor>-<cpu arch>``, e.g.
    ``Linux-CPython-3.11-x86_64``: the directory of this machine's baselines (pytest-benchmark's
    scheme, with the CPU architecture for the bitness)."""
    major, minor, _ = platform.python_version_tuple()
    parts = (platform.system() or "unknown", platform.python_implementation(), f"{major}.{minor}",
             platform.machine() or "unknown")
    return "-".join(re.sub(r"[^A-Za-z0-9_.]+", "_", p) for p in parts)


def _cpu_model() -> str | None:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or None


def machine_info() -> dict[str, Any]:
    """What is known about this machine, stored in each baseline (informational)."""
    import importlib.metadata as md

    info: dict[str, Any] = {
        "id": machine_id(),
        "node": platform.node(),
        "system": platform.system(),
        "release": platform.release(),
        "machine": platform.machine(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "python_implementation": platform.python_implementation(),
        "torch": None,
    }
    with contextlib.suppress(md.PackageNotFoundError):
        info["torch"] = md.version("torch")
    return info


def baselines_dir(state_dir: Path, machine: str | None = None) -> Path:
    """``<state_dir>/baselines/<machine-id>``."""
    return state_dir / "baselines" / (machine or machine_id())


def baseline_files(directory: Path) -> list[Path]:
    """The baseline files in ``directory``, oldest first (by their ``NNNN`` number)."""
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := _NAME.match(p.name))]
    return [p for _, p in sorted(found)]


def request_fields(request: RunRequest) -> dict[str, Any]:
    """The request as stored in a baseline (``env`` for information, not compared)."""
    return {
        "steps": request.steps,
        "seed": request.seed,
        "world_size": request.world_size,
        "args": list(request.args),
        "env": dict(request.env),
    }


# --------------------------------------------------------------------------------------------
# Saving and loading
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Baseline:
    """A loaded baseline file."""

    path: Path
    data: Mapping[str, Any]

    @property
    def request(self) -> dict[str, Any]:
        return dict(self.data.get("request", {}))

    @property
    def trajectories(self) -> dict[str, dict[int, float]]:
        """Metric name -> {step: value}."""
        return {
            name: {int(step): float(value) for step, value in points}
            for name, points in self.data.get("trajectories", {}).items()
        }

    @property
    def commit(self) -> str | None:
        return self.data.get("commit_info", {}).get("id")

    @property
    def dirty(self) -> bool | None:
        return self.data.get("commit_info", {}).get("dirty")

    def mismatch(self, request: Mapping[str, Any]) -> list[str]:
        """How this baseline's request differs from ``request`` (``steps 60, this run 30``)."""
        mine = self.request
        out = []
        for key in REQUEST_KEYS:
            if mine.get(key) != request.get(key):
                out.append(f"{key} {_show(mine.get(key))} (this run: {_show(request.get(key))})")
        return out


def _show(value: Any) -> str:
    if isinstance(value, list):
        return repr(" ".join(map(str, value)))
    return str(value)


def _file_sha256(path: Path) -> str | None:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None


def save_baseline(
    job_file: JobFile,
    request: RunRequest,
    trajectories: Mapping[str, Mapping[int, float]],
    *,
    directory: Path | None = None,
    extra: Mapping[str, Any] | None = None,
) -> Path:
    """Store ``trajectories`` (metric -> {step: value}) as the next baseline of this machine and
    return its path. ``directory`` defaults to :func:`baselines_dir` of the job's state dir."""
    target_dir = directory or baselines_dir(job_file.state_dir)
    target_dir.mkdir(parents=True, exist_ok=True)
    git = git_state(job_file.cwd)
    commit, dirty = git.commit, git.dirty
    data: dict[str, Any] = {
        "format_version": FORMAT_VERSION,
        "kind": _KIND,
        "trainguard_version": __version__,
        "created_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine_info": machine_info(),
        "job": {
            "name": job_file.job.name,
            "file": str(job_file.path),
            "file_sha256": _file_sha256(job_file.path),
        },
        "commit_info": {"id": commit, "dirty": dirty, "directory": str(job_file.cwd)},
        "request": request_fields(request),
        "trajectories": {
            name: [[step, float(values[step])] for step in sorted(values)]
            for name, values in trajectories.items()
        },
        **(extra or {}),
    }
    payload = (json.dumps(data, indent=2, allow_nan=True) + "\n").encode()
    suffix = (commit[:12] if commit else "nogit") + ("_dirty" if dirty else "")
    return write_numbered(target_dir, suffix, payload)


def write_numbered(directory: Path, suffix: str, payload: bytes) -> Path:
    """Write ``payload`` as ``<NNNN>_<suffix>.json`` with the next free number, atomically.

    The content goes to a temp file (fsynced) that is then hard-linked to the final name: a link
    fails when the name exists, so a concurrent saver that picked the same number retries with
    the next one instead of overwriting.
    """
    fd, tmp = tempfile.mkstemp(prefix=".baseline.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(payload)
            handle.flush()
            os.fchmod(handle.fileno(), 0o666 & ~current_umask())
            os.fsync(handle.fileno())
        existing = baseline_files(directory)
        number = int(_NAME.match(existing[-1].name).group(1)) + 1 if existing else 1  # type: ignore[union-attr]
        for _ in range(1000):
            target = directory / f"{number:04d}_{suffix}.json"
            try:
                os.link(tmp, target)
            except FileExistsError:
                number += 1
                continue
            fsync_dir(directory)
            return target
        raise BaselineError(f"{directory}: could not find a free baseline number near {number}")
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


_HOW_TO_SAVE = "trainguard check {job} --only canary --save-baseline"


def how_to_save(job_file: JobFile) -> str:
    """The command that saves a baseline for this job file."""
    return _HOW_TO_SAVE.format(job=_rel(job_file.path))


def read_versioned_json(
    path: str | os.PathLike[str],
    *,
    kind: str,
    version: int,
    error: type[TrainguardError],
    what: str,
    kind_name: str,
    version_label: str,
    fix: str,
) -> dict[str, Any]:
    """A baseline document: readable JSON with ``"kind": kind`` and ``"format_version": version``;
    otherwise ``error`` naming the file, what is wrong and ``fix``. Shared by the canary's and
    the profile's baselines."""
    target = Path(path)
    try:
        data = json.loads(target.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise error(f"{target}: no such {what}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise error(f"{target}: not a readable {what} ({exc}); delete it or {fix}") from None
    if not isinstance(data, dict) or data.get("kind") != kind:
        raise error(f"{target}: not a {kind_name} (no \"kind\": \"{kind}\")")
    if data.get("format_version") != version:
        raise error(
            f"{target} has {version_label} format version {data.get('format_version')!r}; trainguard "
            f"{__version__} reads version {version}. {fix[0].upper()}{fix[1:]}"
        )
    return data


def load_baseline(path: str | os.PathLike[str]) -> Baseline:
    """Read and validate a baseline file; :class:`BaselineError` says what is wrong with it."""
    target = Path(path)
    data = read_versioned_json(target, kind=_KIND, version=FORMAT_VERSION, error=BaselineError,
                               what="baseline file", kind_name="trainguard canary baseline",
                               version_label="baseline", fix="save a new baseline with this version")
    trajectories = data.get("trajectories")
    if not isinstance(trajectories, dict) or not isinstance(trajectories.get("loss"), list):
        raise BaselineError(f"{target}: holds no `loss` trajectory; save a new baseline")
    try:
        baseline = Baseline(target, data)
        baseline.trajectories  # noqa: B018 -- validates every point
    except (TypeError, ValueError) as exc:
        raise BaselineError(f"{target}: malformed trajectory ({exc}); save a new baseline") from None
    return baseline


def find_baseline(job_file: JobFile, setting: str, request: Mapping[str, Any]) -> Baseline | None:
    """The baseline ``checks.canary.baseline`` selects for ``request``.

    ``latest``: the newest file of this machine whose format and request match; None when the
    machine has no baseline at all; :class:`BaselineError` when it has some but none fits (the
    message names the newest one and how it differs). A path (relative to the job file): that
    file, which must exist and fit.
    """
    if setting != "latest":
        path = Path(setting).expanduser()
        baseline = load_baseline(path if path.is_absolute() else job_file.base_dir / path)
        differs = baseline.mismatch(request)
        if differs:
            raise _refused(job_file, baseline.path, differs)
        return baseline
    files = baseline_files(baselines_dir(job_file.state_dir))
    if not files:
        return None
    first_problem: BaselineError | None = None
    for path in reversed(files):
        try:
            baseline = load_baseline(path)
        except BaselineError as exc:
            first_problem = first_problem or exc
            continue
        differs = baseline.mismatch(request)
        if not differs:
            return baseline
        first_problem = first_problem or _refused(job_file, path, differs)
    assert first_problem is not None
    raise BaselineError(
        f"no baseline of this machine ({machine_id()}) fits this canary; the newest: "
        f"{first_problem}"
    )


def _refused(job_file: JobFile, path: Path, differs: list[str]) -> BaselineError:
    return BaselineError(
        f"{_rel(path)} was saved for a different run: {'; '.join(differs)}. A band only means "
        f"something for the same steps, seed, world size and args: save one for this run with "
        f"`{how_to_save(job_file)}`, or point checks.canary.baseline at a matching file"
    )


def _rel(path: Path) -> str:
    try:
        rel = os.path.relpath(path)
    except ValueError:
        return str(path)
    return rel if not rel.startswith("../../") else str(path)


# --------------------------------------------------------------------------------------------
# The band
# --------------------------------------------------------------------------------------------


def smoothing_window(points: int) -> int:
    """Points per rolling median: max(5, 10% of ``points``), odd; 1 (no smoothing) for fewer
    than 5 points (a validation metric printed a few times is not smoothed)."""
    if points < 5:
        return 1
    size = max(5, math.ceil(0.1 * points))
    return size if size % 2 else size + 1


def rolling_median(values: Mapping[int, float], window: int) -> dict[int, float]:
    """Centred rolling median over the points in step order; the window shrinks at both ends.
    Non-finite values are left out of the medians."""
    steps = sorted(values)
    half = window // 2
    out: dict[int, float] = {}
    for i, step in enumerate(steps):
        around = [values[s] for s in steps[max(0, i - half) : i + half + 1] if math.isfinite(values[s])]
        out[step] = statistics.median(around) if around else math.nan
    return out


@dataclass(frozen=True)
class Band:
    """The baseline's smoothed trajectory of one metric and the tolerance around it."""

    metric: str
    raw: dict[int, float]
    center: dict[int, float]
    tolerance: float
    window: int

    def bounds(self, step: int) -> tuple[float, float]:
        """(low, high) at ``step``."""
        center = self.center[step]
        return center - self.tolerance * abs(center), center + self.tolerance * abs(center)


def build_band(metric: str, baseline: Mapping[int, float], tolerance: float, window: int | None = None) -> Band:
    """The band of ``baseline`` (one metric's {step: value}): its rolling median (window
    :func:`smoothing_window` unless given) ± ``tolerance`` x |median|."""
    size = window if window is not None else smoothing_window(len(baseline))
    return Band(metric, dict(baseline), rolling_median(baseline, size), tolerance, size)


@dataclass(frozen=True)
class Excursion:
    """Consecutive points where the smoothed run is on one side outside the band."""

    first_step: int
    last_step: int
    points: int
    side: str  # "above" | "below"
    worst_step: int
    worst_value: float  # the smoothed run at worst_step
    worst_center: float  # the baseline's smoothed value there
    worst_deviation: float  # (value - center) / |center|

    def as_evidence(self) -> dict[str, Any]:
        return {
            "steps": [self.first_step, self.last_step], "points": self.points, "side": self.side,
            "worst_step": self.worst_step, "worst_value": round(self.worst_value, 6),
            "baseline_value": round(self.worst_center, 6),
            "worst_deviation": round(self.worst_deviation, 4),
        }


@dataclass
class BandVerdict:
    """How one metric's run compares with its band."""

    band: Band
    run: dict[int, float]
    smoothed: dict[int, float]
    min_points: int
    excursions: list[Excursion] = field(default_factory=list)
    missing_steps: list[int] = field(default_factory=list)

    @property
    def failing(self) -> list[Excursion]:
        """Excursions long enough to fail: at least ``min_points`` consecutive points."""
        return [e for e in self.excursions if e.points >= self.min_points]

    @property
    def ok(self) -> bool:
        return not self.failing

    @property
    def compared_steps(self) -> list[int]:
        return sorted(set(self.smoothed) & set(self.band.center))

    @property
    def max_deviation(self) -> float:
        """The largest |smoothed run - baseline| / |baseline| over the compared steps."""
        devs = [abs(_deviation(self.smoothed[s], self.band.center[s])) for s in self.compared_steps]
        finite = [d for d in devs if math.isfinite(d)]
        return max(finite, default=0.0)

    def problem(self) -> str | None:
        """The failure message, or None inside the band."""
        failing = self.failing
        if not failing:
            return None
        worst = max(failing, key=lambda e: abs(e.worst_deviation))
        first = failing[0]
        where = (f"steps {first.first_step}-{first.last_step}" if first.points > 1
                 else f"step {first.first_step}")
        more = f" and {len(failing) - 1} more stretch(es)" if len(failing) > 1 else ""
        return (
            f"{self.band.metric} left the baseline band at {where}{more} "
            f"({sum(e.points for e in failing)} of {len(self.compared_steps)} points outside): "
            f"up to {abs(worst.worst_deviation):.0%} {worst.side} the baseline at step "
            f"{worst.worst_step} ({worst.worst_value:.4g} vs {worst.worst_center:.4g}; band "
            f"±{self.band.tolerance:.0%}, rolling median of {self.band.window} point(s), fails "
            f"from {self.min_points} consecutive)"
        )

    def as_evidence(self) -> dict[str, Any]:
        return {
            "metric": self.band.metric,
            "tolerance": self.band.tolerance,
            "window": self.band.window,
            "min_points": self.min_points,
            "compared_points": len(self.compared_steps),
            "max_deviation": round(self.max_deviation, 4),
            "excursions": [e.as_evidence() for e in self.excursions],
            "failing": [e.as_evidence() for e in self.failing],
            "missing_steps": self.missing_steps,
        }


def _deviation(value: float, center: float) -> float:
    if center == 0:
        return 0.0 if value == 0 else math.copysign(math.inf, value)
    return (value - center) / abs(center)


def compare_to_band(run: Mapping[int, float], band: Band, min_points: int | None = None) -> BandVerdict:
    """Smooth ``run`` like the band's baseline and find where it leaves the band.

    Only steps both have are compared (``missing_steps``: baseline steps the run lacks). The
    run fails where its smoothed value is outside the band for ``min_points`` (default: half
    the band's window, rounded up) consecutive compared points.
    """
    smoothed = rolling_median(run, band.window)
    need = min_points if min_points is not None else (band.window + 1) // 2
    verdict = BandVerdict(band, dict(run), smoothed, need,
                          missing_steps=sorted(set(band.center) - set(run)))
    current: list[tuple[int, str, float]] = []

    def close() -> None:
        if not current:
            return
        worst = max(current, key=lambda item: abs(item[2]))
        verdict.excursions.append(Excursion(
            current[0][0], current[-1][0], len(current), current[0][1], worst[0],
            smoothed[worst[0]], band.center[worst[0]], worst[2],
        ))
        current.clear()

    for step in verdict.compared_steps:
        value, (low, high) = smoothed[step], band.bounds(step)
        side = "above" if value > high else "below" if value < low else None
        if side is None or (current and current[-1][1] != side):
            close()
        if side is not None:
            current.append((step, side, _deviation(value, band.center[step])))
    close()
    return verdict


# --------------------------------------------------------------------------------------------
# The plot
# --------------------------------------------------------------------------------------------


def plot_bands(path: Path, verdicts: Sequence[BandVerdict], *, title: str) -> Path:
    """Draw each metric's run (raw points and rolling median) against its band into one PNG,
    stretches that fail shaded red; written atomically. matplotlib is imported here only."""
    # the Agg canvas on a bare Figure: no pyplot, no global backend switch in the caller's process
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 3.2 * len(verdicts) + 0.6), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(verdicts), 1, squeeze=False)[:, 0]
    for ax, verdict in zip(axes, verdicts):
        band = verdict.band
        steps = sorted(band.center)
        lows, highs = zip(*(band.bounds(s) for s in steps))
        ax.fill_between(steps, lows, highs, color="tab:blue", alpha=0.18, linewidth=0,
                        label=f"band: baseline ±{band.tolerance:.0%}")
        smoothing = f"rolling median of {band.window}" if band.window > 1 else "not smoothed"
        # drawn over the run's line: a run identical to its baseline still shows both
        ax.plot(steps, [band.center[s] for s in steps], color="tab:blue", linestyle="--",
                linewidth=1.2, zorder=4, label=f"baseline ({smoothing})")
        run_steps = sorted(verdict.run)
        marker = "o" if len(run_steps) < 10 else "."
        ax.plot(run_steps, [verdict.run[s] for s in run_steps], marker, color="tab:orange",
                alpha=0.45, markersize=4, label="this run")
        smooth_steps = sorted(verdict.smoothed)
        ax.plot(smooth_steps, [verdict.smoothed[s] for s in smooth_steps], color="tab:orange",
                linewidth=2, marker=marker if len(smooth_steps) < 10 else None,
                label="this run (rolling median)" if band.window > 1 else "this run (not smoothed)")
        for i, exc in enumerate(verdict.failing):
            ax.axvspan(exc.first_step - 0.5, exc.last_step + 0.5, color="tab:red", alpha=0.12,
                       label="outside the band" if i == 0 else None)
        status = "inside the band" if verdict.ok else "LEFT THE BAND"
        ax.set_title(f"{band.metric}: {status} (max deviation {verdict.max_deviation:.0%})",
                     fontsize=10)
        ax.set_xlabel("step")
        ax.set_ylabel(band.metric)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="upper right")
    fig.suptitle(title, fontsize=10)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100)
    return atomic_write_bytes(path, buffer.getvalue())


# --------------------------------------------------------------------------------------------
# The canary's use of all this
# --------------------------------------------------------------------------------------------


@dataclass
class BaselineOutcome:
    """What the baseline step adds to a canary result."""

    evidence: dict[str, Any]
    problems: list[str] = field(default_factory=list)
    note: str = ""
    plots: list[str] = field(default_factory=list)


def _plot(outcome: BaselineOutcome, path: Path, verdicts: Sequence[BandVerdict], title: str) -> None:
    # a plot is evidence, not the verdict: a plotting problem is recorded, never fatal
    try:
        outcome.plots.append(str(plot_bands(path, verdicts, title=title)))
    except Exception as exc:
        outcome.evidence["plot_error"] = f"{type(exc).__name__}: {exc}"


def _metrics(spec: CanaryCheck) -> list[str]:
    return ["loss"] + ([spec.val_metric] if spec.val_metric and spec.val_metric != "loss" else [])


def canary_baseline(
    runner: JobRunner,
    spec: CanaryCheck,
    request: RunRequest,
    result: RunResult,
    *,
    canary_ok: bool,
) -> BaselineOutcome:
    """Save the run as this machine's baseline (``settings.save_baseline``; only a run that
    passed the canary's other tests), or compare it with the baseline ``spec.baseline`` selects
    and plot it against the band. A missing baseline is not a failure; one that does not fit
    the run is (the message says why and how to save a fitting one)."""
    job_file = runner.job_file
    trajectories = {m: result.trajectory(m) for m in _metrics(spec)}
    trajectories = {m: v for m, v in trajectories.items() if v}
    plot_path = Path(result.run_dir) / PLOT_NAME
    if runner.settings.save_baseline:
        if not canary_ok:
            return BaselineOutcome(
                {"status": "not_saved", "reason": "the canary failed: a failing run is no baseline"},
                note="baseline not saved (the canary failed)",
            )
        try:
            saved = save_baseline(job_file, request, trajectories,
                                  extra={"run": {"run_dir": str(result.run_dir),
                                                 "duration_s": round(result.duration_s, 2)}})
        except (OSError, BaselineError) as exc:
            where = baselines_dir(job_file.state_dir)
            return BaselineOutcome(
                {"status": "not_saved", "reason": str(exc)},
                problems=[f"could not save the baseline in {where}: {exc}; make that directory "
                          "writable (or free space) and save again"],
            )
        outcome = BaselineOutcome(
            {"status": "saved", "path": str(saved), "machine_id": machine_id(),
             "metrics": sorted(trajectories), "tolerance": spec.baseline_tolerance},
            note=f"saved as the baseline {_rel(saved)}",
        )
        own = [compare_to_band(v, build_band(m, v, spec.baseline_tolerance))
               for m, v in trajectories.items()]
        _plot(outcome, plot_path, own, f"{job_file.job.name}: saved as the baseline {saved.name}")
        return outcome
    if spec.baseline == "off":
        return BaselineOutcome({"status": "off"})
    try:
        baseline = find_baseline(job_file, spec.baseline, request_fields(request))
    except BaselineError as exc:
        return BaselineOutcome({"status": "refused", "reason": str(exc)},
                               problems=[f"baseline refused: {exc}"])
    if baseline is None:
        hint = how_to_save(job_file)
        return BaselineOutcome(
            {"status": "none", "machine_id": machine_id(),
             "directory": str(baselines_dir(job_file.state_dir)), "how_to_save": hint},
            note=f"no baseline saved for this machine (save one: {hint})",
        )
    saved_trajectories = baseline.trajectories
    verdicts: list[BandVerdict] = []
    not_compared: dict[str, str] = {}
    for metric, values in trajectories.items():
        if metric not in saved_trajectories:
            not_compared[metric] = "the baseline has no values of it"
            continue
        band = build_band(metric, saved_trajectories[metric], spec.baseline_tolerance)
        verdicts.append(compare_to_band(values, band))
    for metric in _metrics(spec):
        if metric not in trajectories:
            not_compared.setdefault(metric, "this run printed no values of it")
    evidence: dict[str, Any] = {
        "status": "compared",
        "path": str(baseline.path),
        "commit": baseline.commit,
        "dirty": baseline.dirty,
        "created_at": baseline.data.get("created_at"),
        "job_file_changed": baseline.data.get("job", {}).get("file_sha256") != _file_sha256(job_file.path),
        "metrics": {v.band.metric: v.as_evidence() for v in verdicts},
        "not_compared": not_compared,
    }
    outcome = BaselineOutcome(evidence)
    bad = [v for v in verdicts if not v.ok]
    label = baseline.path.name
    if verdicts:
        status = "outside" if bad else "inside"
        commit = baseline.commit[:12] if baseline.commit else "no commit"
        _plot(outcome, plot_path, verdicts,
              f"{job_file.job.name} vs baseline {label} ({commit}): {status}")
    if bad:
        plot_note = f"; plot: {outcome.plots[0]}" if outcome.plots else ""
        texts = [v.problem() or "" for v in bad]
        outcome.problems.append(f"{'; '.join(texts)}; baseline {_rel(baseline.path)}{plot_note}")
    if not bad:
        devs = ", ".join(f"{v.band.metric} off by at most {v.max_deviation:.0%}" for v in verdicts)
        outcome.note = (f"inside the baseline band of {label} (±{spec.baseline_tolerance:.0%}: "
                        f"{devs})")
    return outcome
