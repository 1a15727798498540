"""The maths of a profile: step-time statistics, scaling efficiency, Amdahl and USL fits.

Everything here is a pure function of numbers, so it is tested with known inputs
(tests/unit/test_profiling.py).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import numpy as np

__all__ = [
    "ScalingFit",
    "StepStats",
    "fit_scaling",
    "percentile",
    "phrase_scaling",
    "scaling_table",
    "step_stats",
]

Scaling = Literal["weak", "strong"]


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) with linear interpolation (numpy's default)."""
    if not values:
        raise ValueError("percentile of no values")
    return float(np.percentile(np.asarray(values, dtype=float), q))


@dataclass
class StepStats:
    """Step times of one run (seconds), warm-up steps excluded."""

    count: int
    warmup_steps: int
    mean_s: float
    p50_s: float
    p90_s: float
    p99_s: float
    min_s: float
    max_s: float
    #: step -> its duration (the time between its metric line and the previous step's)
    durations: dict[int, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["durations"] = {str(k): round(v, 6) for k, v in self.durations.items()}
        return data


def step_stats(arrivals: Mapping[int, float], warmup_steps: int) -> StepStats:
    """Step durations from arrival times ``{step: seconds since launch}`` of one rank's step
    lines. A step's duration is its arrival minus the previous step's, so the first step (which
    carries start-up) never has one; steps up to ``warmup_steps`` are left out too."""
    steps = sorted(arrivals)
    durations = {
        b: arrivals[b] - arrivals[a]
        for a, b in itertools.pairwise(steps)
        if b == a + 1 and b > warmup_steps
    }
    if len(durations) < 1:
        raise ValueError(
            f"no step durations after the {warmup_steps} warm-up step(s): the run printed "
            f"{len(steps)} step line(s); run more steps or lower warmup_steps"
        )
    values = list(durations.values())
    return StepStats(
        count=len(values),
        warmup_steps=warmup_steps,
        mean_s=float(np.mean(values)),
        p50_s=percentile(values, 50),
        p90_s=percentile(values, 90),
        p99_s=percentile(values, 99),
        min_s=min(values),
        max_s=max(values),
        durations=durations,
    )


def scaling_table(
    throughput: Mapping[int, float], scaling: Scaling
) -> dict[int, dict[str, float]]:
    """Speed-up and efficiency per world size relative to the smallest measured one.

    Weak scaling (the global batch grows with N): efficiency = thr_N / (N/N0 * thr_N0).
    Strong scaling (fixed global batch): efficiency = T_N0 / (N/N0 * T_N) with T the time per
    step; with a fixed batch T is inversely proportional to throughput, so both are the
    throughput ratio over the rank ratio. ``speedup`` is thr_N / thr_N0."""
    if not throughput:
        return {}
    base = min(throughput)
    out: dict[int, dict[str, float]] = {}
    for n in sorted(throughput):
        speedup = throughput[n] / throughput[base]
        out[n] = {"speedup": speedup, "efficiency": speedup / (n / base)}
    return out


def phrase_scaling(table: Mapping[int, Mapping[str, float]], scaling: Scaling, unit: str = "ranks") -> str:
    """The sentence a person asks for: "2 ranks give 1.80x, 4 give 2.40x (strong scaling)"."""
    parts = []
    sizes = sorted(table)
    base = sizes[0] if sizes else 1
    for i, n in enumerate(s for s in sizes if s != base):
        speedup = table[n]["speedup"]
        eff = table[n]["efficiency"]
        who = f"{n} {unit}" if i == 0 else str(n)
        parts.append(f"{who} give {speedup:.2f}x ({eff:.0%} efficient)")
    if not parts:
        return f"only world size {base} measured: no scaling figure"
    against = "" if base == 1 else f" relative to {base}"
    return ", ".join(parts) + f" ({scaling} scaling{against})"


@dataclass
class ModelFit:
    """One scaling model fitted to relative throughput C(N) = X(N)/X(1)."""

    name: Literal["amdahl", "usl"]
    sigma: float  # contention: the serial fraction
    kappa: float  # coherency: cross-talk cost growing with N^2 (0 for Amdahl)
    rms_residual: float  # of the relative throughput, over the measured sizes
    residuals: dict[int, float]  # world size -> measured minus fitted relative throughput
    params: int
    #: measured sizes beyond the base that constrain the fit
    points: int

    @property
    def unvalidated(self) -> bool:
        """No more informative points than parameters: the model can follow any such data
        (within its bounds), so how well it fits proves nothing."""
        return self.points <= self.params

    def capacity(self, n: float) -> float:
        """Predicted relative throughput at ``n`` ranks."""
        return n / (1.0 + self.sigma * (n - 1.0) + self.kappa * n * (n - 1.0))

    def peak(self) -> float | None:
        """The rank count of peak throughput (USL with kappa > 0), else None (no peak)."""
        if self.kappa <= 0:
            return None
        return math.sqrt((1.0 - self.sigma) / self.kappa)

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (the report's ``scaling.fit.amdahl`` / ``usl``)."""
        data = asdict(self)
        data["residuals"] = {str(k): v for k, v in self.residuals.items()}
        data["unvalidated"] = self.unvalidated
        data["peak_ranks"] = self.peak()
        return data


@dataclass
class ScalingFit:
    """Both fits, the chosen one and why."""

    base_size: int
    base_throughput: float
    amdahl: ModelFit | None
    usl: ModelFit | None
    chosen: Literal["amdahl", "usl"] | None
    why: str
    measured_sizes: list[int]

    @property
    def model(self) -> ModelFit | None:
        return {"amdahl": self.amdahl, "usl": self.usl}.get(self.chosen or "")

    def throughput(self, n: int) -> float | None:
        """Predicted throughput at ``n`` ranks (None without a model)."""
        model = self.model
        if model is None:
            return None
        # the fit is on N relative to the base size; see fit_scaling
        return self.base_throughput * model.capacity(n / self.base_size)

    def extrapolated(self, n: int) -> bool:
        return n > max(self.measured_sizes) or n < min(self.measured_sizes)

    def to_dict(self) -> dict[str, Any]:
        return {
            "base_size": self.base_size,
            "base_throughput": self.base_throughput,
            "amdahl": self.amdahl.to_dict() if self.amdahl is not None else None,
            "usl": self.usl.to_dict() if self.usl is not None else None,
            "chosen": self.chosen,
            "why": self.why,
            "measured_sizes": self.measured_sizes,
        }


def _bounded_lstsq(a: np.ndarray, b: np.ndarray, upper: Sequence[float]) -> np.ndarray:
    """Least squares with 0 <= x_j <= upper_j, by trying every combination of free coefficients
    and coefficients held at a bound (there are only 1-2 unknowns)."""
    k = a.shape[1]
    best: tuple[float, np.ndarray] | None = None
    for states in itertools.product(*[("free", "low", "high") for _ in range(k)]):
        if any(st == "high" and not math.isfinite(upper[j]) for j, st in enumerate(states)):
            continue
        x = np.array([upper[j] if st == "high" else 0.0 for j, st in enumerate(states)])
        free = [j for j, st in enumerate(states) if st == "free"]
        if free:
            rhs = b - a @ x
            sol, *_ = np.linalg.lstsq(a[:, free], rhs, rcond=None)
            x[free] = sol
        if np.any(x < -1e-12) or np.any(x > np.asarray(upper) + 1e-12):
            continue
        err = float(np.sum((a @ x - b) ** 2))
        if best is None or err < best[0] - 1e-15:
            best = (err, x)
    assert best is not None  # all coefficients at their lower bound is always feasible
    return best[1]


def _fit(name: Literal["amdahl", "usl"], n: np.ndarray, c: np.ndarray, sizes: list[int]) -> ModelFit:
    # Linearised USL: N/C(N) - 1 = sigma (N-1) + kappa N (N-1), solved for sigma in [0, 1] and
    # kappa >= 0; Amdahl is the same with kappa = 0. Residuals are then taken on C itself.
    y = n / c - 1.0
    cols = [n - 1.0] if name == "amdahl" else [n - 1.0, n * (n - 1.0)]
    a = np.stack(cols, axis=1)
    # sigma in [0, 1] (sigma = 1 with kappa > 0 is retrograde scaling), kappa >= 0
    coef = _bounded_lstsq(a, y, [1.0, math.inf][: len(cols)]) if len(n) else np.zeros(len(cols))
    sigma = float(coef[0])
    kappa = float(coef[1]) if name == "usl" else 0.0
    fit = ModelFit(name, sigma, kappa, 0.0, {}, params=len(cols), points=len(n))
    residuals = {size: float(ci - fit.capacity(ni)) for size, ni, ci in zip(sizes, n, c)}
    fit.residuals = residuals
    fit.rms_residual = float(np.sqrt(np.mean(np.square(list(residuals.values()))))) if residuals else 0.0
    return fit


#: Amdahl's rms residual (in relative throughput) above which it "cannot follow" the data
_POOR_FIT = 0.1


def fit_scaling(throughput: Mapping[int, float]) -> ScalingFit:
    """Fit Amdahl's law and the Universal Scalability Law to measured throughputs.

    Throughput is taken relative to the smallest measured size N0 (C = X(N)/X(N0), at N/N0
    ranks). Choosing by residual alone would always pick the USL (it has one parameter more),
    so: a model with no more informative points than parameters fits exactly and its zero
    residual is no evidence; the USL is chosen when it has spare points and its residual is
    clearly lower (below 70 % of Amdahl's), or when Amdahl cannot follow the data at all (rms
    residual above 0.1: throughput falling with more ranks, which Amdahl cannot express) -- then
    with the warning that an exact fit is unvalidated; otherwise the simpler Amdahl law is kept."""
    sizes = sorted(throughput)
    if not sizes:
        raise ValueError("no throughput measured")
    base = sizes[0]
    base_thr = throughput[base]
    others = [s for s in sizes if s != base]
    if not others or base_thr <= 0:
        return ScalingFit(
            base, base_thr, None, None, None,
            f"only {base} rank(s) measured: nothing to fit; predictions need a second world size",
            sizes,
        )
    n = np.array([s / base for s in others], dtype=float)
    c = np.array([throughput[s] / base_thr for s in others], dtype=float)
    amdahl = _fit("amdahl", n, c, others)
    usl = _fit("usl", n, c, others)
    if usl.unvalidated and not amdahl.unvalidated and amdahl.rms_residual > _POOR_FIT:
        chosen: Literal["amdahl", "usl"] = "usl"
        why = (
            f"Amdahl cannot follow the measurements (rms residual {amdahl.rms_residual:.3f}: "
            "throughput falls or stalls with more ranks), so the USL is used -- but with "
            f"{len(others)} sizes beyond the base for its 2 parameters its fit proves nothing: "
            "measure more world sizes before trusting its predictions"
        )
    elif usl.unvalidated:
        chosen = "amdahl"
        why = (
            f"{len(others)} size(s) beyond the base: the USL's 2 parameters would fit them "
            "exactly (a zero residual is no evidence), so the 1-parameter Amdahl law is used"
        )
        if amdahl.unvalidated and amdahl.rms_residual > 1e-9:
            why += (
                f"; it cannot follow a speed-up below 1x (rms residual {amdahl.rms_residual:.3f}), "
                "so its predictions stay flat -- measure a third world size to test the fit"
            )
        elif amdahl.unvalidated:
            why += "; it too fits exactly -- measure a third world size to test the fit"
    elif usl.rms_residual < 0.7 * amdahl.rms_residual:
        chosen = "usl"
        why = (
            f"USL residual {usl.rms_residual:.4f} is clearly below Amdahl's "
            f"{amdahl.rms_residual:.4f} with {len(others)} points for 2 parameters"
        )
    else:
        chosen = "amdahl"
        why = (
            f"Amdahl residual {amdahl.rms_residual:.4f} vs USL {usl.rms_residual:.4f}: the extra "
            "USL parameter does not buy a clearly better fit, so the simpler law is used"
        )
    return ScalingFit(base, base_thr, amdahl, usl, chosen, why, sizes)
