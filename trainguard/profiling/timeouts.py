"""The timeouts a job should use at its target size, each with its reason (docs/profiling.md,
"Recommended timeouts").

They come from what the profile measured at the nearest world size: the step-time tail (p99
and the slowest step), the checkpoint save (and load) time and the start-up, and from the
goodput forecast's expected failures. Every value is a bound a healthy run stays under with a
margin, so a timeout that fires means a fault, not a slow step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from trainguard.evidence import Evidence

__all__ = ["MARGIN", "RecommendedTimeout", "poisson_quantile", "recommend_timeouts"]

#: how many times the slowest healthy wait a timeout allows
MARGIN = 3.0


def _seconds(value: float) -> int:
    """Whole seconds, rounded up (to 10 s from a minute on)."""
    if value >= 60:
        return int(math.ceil(value / 10) * 10)
    return max(1, math.ceil(value))


def poisson_quantile(mean: float, q: float = 0.99) -> int:
    """The smallest k with P(Poisson(mean) <= k) >= q."""
    if mean <= 0:
        return 0
    k, term = 0, math.exp(-mean)
    total = term
    while total < q and k < 100_000:
        k += 1
        term *= mean / k
        total += term
    return k


@dataclass
class RecommendedTimeout(Evidence):
    """One setting the job should use at ``gpus``: its value (seconds unless the setting says
    otherwise) and why."""

    setting: str
    value: int
    reason: str
    gpus: int


def recommend_timeouts(
    *,
    step_p99_s: float | None,
    step_max_s: float | None,
    save_s: float | None,
    load_s: float,
    startup_s: float | None,
    expected_failures: float,
    gpus: int,
) -> list[RecommendedTimeout]:
    """The recommended settings at ``gpus``, value in seconds unless the setting says
    otherwise. Empty without a measured step time."""
    if step_p99_s is None:
        return []
    slow = max(step_p99_s, step_max_s or 0.0)
    save = save_s or 0.0
    base = slow + save  # the longest a healthy rank goes without a step line
    collective = max(60, _seconds(2 * (base + load_s)))
    stall = max(_seconds(MARGIN * base), collective + 30)
    start = max(60, _seconds(MARGIN * ((startup_s or 0.0) + load_s)))
    restarts = max(1, poisson_quantile(expected_failures))
    lead = max(60, _seconds(MARGIN * base))
    save_text = f"a checkpoint save ({save:.3g} s)" if save_s is not None else "a checkpoint save (not measured)"
    items: list[tuple[str, int, str]] = [
        ("job.stall_timeout (any step watchdog)", stall,
         f"the slowest healthy step (p99 {step_p99_s:.3g} s, max {slow:.3g} s) plus {save_text} "
         f"fits {MARGIN:g} times over, and it is longer than the collective timeout so a dead "
         "peer ends the job with an error before a watchdog has to kill it"),
        ("collective timeout: init_process_group(timeout=timedelta(seconds=N)) (NCCL/gloo)",
         collective,
         f"a rank waits at the next collective while a peer finishes a slow step and {save_text} or a "
         f"load ({load_s:.3g} s): twice that, at least 60 s. PyTorch's defaults (NCCL 10 min, gloo "
         "30 min) leave a dead peer unnoticed that long; keep TORCH_NCCL_ASYNC_ERROR_HANDLING=1"),
        ("Ray Train: RAY_TRAIN_WORKER_HEALTH_CHECK_TIMEOUT_S", stall,
         "a worker busy in a slow step and a save must not be declared dead: the stall timeout "
         "(Ray's default 600 s notices a lost worker that much later)"),
        ("Ray Train: RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", start,
         f"a restarted worker group starts ({startup_s or 0:.3g} s measured) and loads the checkpoint "
         f"({load_s:.3g} s): {MARGIN:g} times that, at least 60 s (Ray's default 60 s)"),
        ("Ray Train FailureConfig(max_failures) / job.max_restarts", restarts,
         f"{expected_failures:.3g} failures expected at {gpus} GPU(s); {restarts} covers 99 % of runs "
         "(Poisson): fewer ends the run on a failure it could have survived"),
        ("Slurm: #SBATCH --signal=B:USR1@N (the queue's signal_lead_s)", lead,
         f"after USR1 the job finishes its step and writes a final checkpoint ({base:.3g} s at the "
         f"slowest) before the time limit: {MARGIN:g} times that, at least 60 s (Slurm's signal "
         "timing has a 60 s resolution); trainguard's sbatch script uses 300 s"),
    ]
    return [RecommendedTimeout(setting, value, reason, gpus) for setting, value, reason in items]
