"""The timeouts a job should use at its target size, each with its reason (docs/profiling.md,
"Recommended timeouts"), and the restart policy's waits and stop (``job.restart``,
:func:`recommend_restart_policy`).

They come from what the profile measured at the nearest world size: the step-time tail (p99
and the slowest step), the checkpoint save (and load) time and the start-up, and from the
goodput forecast's expected failures. Every value is a bound a healthy run stays under with a
margin, so a timeout that fires means a fault, not a slow step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from trainguard.evidence import Evidence

__all__ = ["MARGIN", "RecommendedTimeout", "poisson_quantile", "recommend_restart_policy", "recommend_timeouts"]

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


#: the chance, over the whole run, that the stop without progress gives up on a healthy job
GIVE_UP_RISK = 0.001
#: the jitter recommended, in percent of each wait
JITTER_PERCENT = 20


# the forecast's figures, keyword-only: each is one number the reasons quote (PLR0913)
def recommend_restart_policy(  # noqa: PLR0913
    *,
    fixed_s: float,
    restart_source: str,
    checkpoint_every_s: float,
    job_mtbf_s: float,
    expected_failures: float,
    wall_s: float,
    goodput: float | None,
    gpus: int,
) -> list[RecommendedTimeout]:
    """``job.restart``'s settings at ``gpus`` from what one failure costs (``fixed_s``: the
    measured restart and load), the checkpoint interval, the job's MTBF and the goodput forecast
    (``expected_failures`` over ``wall_s``). docs/launcher.md, "Restart policy"."""
    failures = max(expected_failures, 1.0)
    backoff = max(1, math.ceil(0.1 * fixed_s))
    waited = expected_failures * backoff / wall_s if wall_s > 0 and math.isfinite(wall_s) else 0.0
    top = max(backoff, _seconds(4 * fixed_s))
    # a healthy attempt fails again before it gets past its checkpoint with chance p; k such
    # attempts in a row, over the run's failures, stay under GIVE_UP_RISK
    p = 1 - math.exp(-(fixed_s + checkpoint_every_s) / job_mtbf_s) if job_mtbf_s > 0 else 1.0
    k = 2 if p <= 0 else (
        max(2, math.ceil(math.log(GIVE_UP_RISK / failures) / math.log(p))) if p < 1 else 10)
    kept = f"goodput {goodput:.2%}" if goodput is not None else "goodput not forecast"
    items: list[tuple[str, int, str]] = [
        ("job.restart.backoff_s", backoff,
         f"a tenth of what a restart costs ({fixed_s:.3g} s: {restart_source}, with the load), at least 1 s: "
         f"a fault that clears by itself gets that long, and the {expected_failures:.3g} expected failures "
         f"wait {expected_failures * backoff:.3g} s in all, {waited:.2%} of the run ({kept})"),
        ("job.restart.max_backoff_s", top,
         f"four restarts' cost ({fixed_s:.3g} s each): a loop without progress doubles its wait up to that, "
         "riding out an outage of a few restarts' length without idling longer than the restarts would"),
        ("job.restart.max_attempts_without_progress", k,
         f"a healthy attempt fails again before passing its checkpoint ({checkpoint_every_s:.3g} s apart) "
         f"with chance {p:.2g} (a restart of {fixed_s:.3g} s, job MTBF {job_mtbf_s / 3600:.3g} h); {k} in a row "
         f"over {failures:.3g} failure(s) happen with chance < {GIVE_UP_RISK:g}, so more is a crash loop"),
        (f"job.restart.jitter (percent: {JITTER_PERCENT} means jitter {JITTER_PERCENT / 100:g})", JITTER_PERCENT,
         f"the ranks of {gpus} GPU(s) -- and every job of a failed node -- restart together; {JITTER_PERCENT} % "
         "spreads their returns over a fifth of the wait (storage, the rendezvous, the scheduler)"),
    ]
    return [RecommendedTimeout(setting, value, reason, gpus) for setting, value, reason in items]
