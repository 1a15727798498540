"""The band a later canary must stay in: a saved trajectory, smoothed, ± a tolerance.

* both trajectories are smoothed with a centred rolling median (:func:`smoothing_window` points);
* the band is the baseline's smoothed value ``± baseline_tolerance`` x its magnitude;
* the run fails when its smoothed trajectory stays outside the band for at least half the
  window (rounded up) consecutive points (:func:`compare_to_band`). A median of ``w`` points
  ignores up to ``(w-1)/2`` consecutive outliers, so this takes about ``w`` consecutive bad
  steps: an unlucky batch or two fail nothing, a job that learns worse for a stretch does.

:func:`plot_bands` draws runs against their bands. The baselines themselves are saved and
loaded by :mod:`trainguard.checks.baseline`.
"""

from __future__ import annotations

import io
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from trainguard._internal.atomic import atomic_write_bytes
from trainguard.evidence import Evidence

__all__ = [
    "Band",
    "BandEvidence",
    "BandVerdict",
    "Excursion",
    "ExcursionEvidence",
    "build_band",
    "calibrated_band",
    "compare_to_band",
    "plot_bands",
    "rolling_median",
    "smoothing_window",
]


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
    #: step -> an absolute half-width (a calibration's across-seed spread) instead of the
    #: relative ``tolerance``; ``source`` says where the band came from
    widths: dict[int, float] | None = None
    source: str = ""

    def bounds(self, step: int) -> tuple[float, float]:
        """(low, high) at ``step``."""
        center = self.center[step]
        half = self.widths.get(step, 0.0) if self.widths is not None else self.tolerance * abs(center)
        return center - half, center + half

    def words(self) -> str:
        """The band's half-width for people: ``±20%`` or ``the calibration's ...``."""
        return self.source if self.widths is not None else f"±{self.tolerance:.0%}"


def calibrated_band(metric: str, mean: Mapping[int, float], std: Mapping[int, float], factor: float,
                    source: str) -> Band:
    """The band of a calibration: its across-seed mean, smoothed like a baseline, ± ``factor`` x
    the across-seed standard deviation (smoothed too) at each step."""
    size = smoothing_window(len(mean))
    widths = {s: factor * v for s, v in rolling_median(std, size).items()}
    return Band(metric, dict(mean), rolling_median(mean, size), 0.0, size, widths, source)


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

    def as_evidence(self) -> ExcursionEvidence:
        return ExcursionEvidence([self.first_step, self.last_step], self.points, self.side, self.worst_step,
                                 round(self.worst_value, 6), round(self.worst_center, 6),
                                 round(self.worst_deviation, 4))


@dataclass
class ExcursionEvidence(Evidence):
    """An excursion in the report (:meth:`Excursion.as_evidence`)."""

    #: [first, last] step
    steps: list[int]
    points: int
    side: str
    worst_step: int
    worst_value: float
    baseline_value: float
    worst_deviation: float


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
        band, center = ("calibrated band", "calibration's mean") if self.band.widths is not None else ("baseline band", "baseline")
        return (
            f"{self.band.metric} left the {band} at {where}{more} "
            f"({sum(e.points for e in failing)} of {len(self.compared_steps)} points outside): "
            f"up to {abs(worst.worst_deviation):.0%} {worst.side} the {center} at step "
            f"{worst.worst_step} ({worst.worst_value:.4g} vs {worst.worst_center:.4g}; band "
            f"{self.band.words()}, rolling median of {self.band.window} point(s), fails "
            f"from {self.min_points} consecutive)"
        )

    def as_evidence(self) -> BandEvidence:
        return BandEvidence(
            self.band.metric, self.band.tolerance if self.band.widths is None else self.band.source,
            self.band.window, self.min_points, len(self.compared_steps), round(self.max_deviation, 4),
            [e.as_evidence() for e in self.excursions], [e.as_evidence() for e in self.failing],
            self.missing_steps)


@dataclass
class BandEvidence(Evidence):
    """One metric's run against its band, in the report (:meth:`BandVerdict.as_evidence`)."""

    metric: str
    #: the band's half-width as a fraction of the baseline, or where a measured band came from
    tolerance: float | str
    window: int
    min_points: int
    compared_points: int
    max_deviation: float
    excursions: list[ExcursionEvidence]
    failing: list[ExcursionEvidence]
    missing_steps: list[int]


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
                        label=f"band: {band.words() if band.widths is not None else f'baseline ±{band.tolerance:.0%}'}")
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
