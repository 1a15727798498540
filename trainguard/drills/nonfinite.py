"""The ``handle_nonfinite`` expectation of a numerics drill (``fault: nan``).

A NaN (or Inf) went into one rank's loss or gradients (:mod:`trainguard.faults.nan`); the
drill's ``params.policy`` says what the job is meant to do about it:

* ``stop``: a rank exits non-zero by itself within ``deadline`` seconds of the fault, with an
  error on its stderr (the rules of ``fail_clean``, without the resume);
* ``skip``: the job goes on, completes, and every metric it prints after the step that took the
  value is finite, on every rank.

With either policy the report names the step and the rank the value was put into, the first
non-finite metric each rank printed, and whether the value reached every rank (an all-reduce
that averaged one rank's NaN into all of them); a failure ranks the likely causes with that
evidence.
"""

from __future__ import annotations

import math

from trainguard.config import DrillSpec
from trainguard.drills.evidence import (
    FirstNonfinite,
    NonfiniteEvidence,
    NonfiniteOnRank,
    NumericsEvidence,
    PutInto,
)
from trainguard.drills.expectations import JudgeEntry
from trainguard.drills.judges import DrillContext, Judgement, exit_problems, judge_injected
from trainguard.evidence import known
from trainguard.launch import MetricPoint

__all__ = ["HANDLE_NONFINITE", "NONFINITE_CAUSES", "judge_handle_nonfinite", "must_stop"]

#: what usually makes a job fail a numerics drill
NONFINITE_CAUSES = {
    "no_check": "no check for non-finite values: nothing tests the loss or the gradient norm with "
                "torch.isfinite before optimizer.step(), so the NaN goes into the weights and every "
                "later step is NaN",
    "loss_only": "the check reads only the loss (or only this rank's values) before the all-reduce: "
                 "a non-finite gradient of one rank is averaged into every rank's gradients by the "
                 "all-reduce and no rank notices; check the gradient norm after backward "
                 "(torch.nn.utils.clip_grad_norm_(..., error_if_nonfinite=True), or torch.isfinite "
                 "of the total norm) or all-reduce a non-finite flag",
    "disagree": "the ranks do not agree on skipping: a rank that skips a step while its peers step "
                "leaves them waiting in a collective (a hang) or lets the replicas drift apart; "
                "all-reduce the skip flag so every rank skips the same step",
    "skip_stops": "the job stops on a non-finite value where it should skip the step "
                  "(policy skip): zero the gradients, leave out optimizer.step() and go on",
    "swallowed": "the error is caught (or only logged) and the job goes on, or exits 0",
    "late": "the check runs too rarely (every N steps, at evaluation only) or only on some ranks: "
            "the job trains on non-finite weights until it looks; check every step",
    "silent": "the job stops without saying why: print the step, the rank and the non-finite value "
              "to stderr before exiting non-zero",
}


def must_stop(spec: DrillSpec) -> bool:
    """A numerics drill whose job must exit within ``deadline`` of the fault (policy stop)."""
    return spec.expectation == "handle_nonfinite" and spec.params.get("policy", "stop") == "stop"


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _steps(steps: list[int]) -> str:
    return f"step {steps[0]}" if len(steps) == 1 else f"steps {steps[0]}..{steps[-1]}"


def numerics_evidence(points: list[MetricPoint], put_step: int | None,
                      ranks: list[int]) -> NumericsEvidence:
    """Non-finite metric values per rank: the first, the count after ``put_step`` (the step that
    took the value), and the ranks it reached."""
    bad = sorted((p for p in points if not math.isfinite(p.value)), key=lambda p: (p.step, p.t))
    by_rank: dict[int, tuple[MetricPoint, list[int]]] = {}
    for p in bad:
        steps = by_rank.setdefault(p.rank, (p, []))[1]
        if p.step not in steps:
            steps.append(p.step)
    later = [p for p in bad if put_step is None or p.step > put_step]
    reached = sorted(by_rank)
    return NumericsEvidence(
        first_nonfinite=FirstNonfinite(bad[0].step, bad[0].rank, bad[0].name, str(bad[0].value)) if bad else None,
        nonfinite_by_rank={r: NonfiniteOnRank(first.step, first.name, steps[:50], len(steps))
                           for r, (first, steps) in sorted(by_rank.items())},
        later_nonfinite_points=len(later),
        later_nonfinite_steps=sorted({p.step for p in later})[:50],
        later_nonfinite_ranks=sorted({p.rank for p in later}),
        reached_ranks=reached,
        reached_every_rank=len(ranks) > 1 and set(ranks) <= set(reached),
    )


def _causes(policy: str, first_ok: bool, hung: bool, numerics: NumericsEvidence, put_visible: bool,
            problems: list[str]) -> list[str]:
    """The likely causes, the one the evidence shows first."""
    c = NONFINITE_CAUSES
    if numerics.later_nonfinite_points:
        # the value was seen on the rank that took it (a NaN loss) and the job went on: no check;
        # it was not (a NaN gradient, finite loss) and reached every rank: the all-reduce spread it
        if put_visible:
            return [c["no_check"], c["loss_only"], c["swallowed"], c["late"]]
        return [c["loss_only"], c["no_check"], c["late"], c["swallowed"]]
    if hung:
        return [c["disagree"], c["late"], c["no_check"]] if policy == "skip" else \
            [c["late"], c["disagree"], c["no_check"]]
    if policy == "skip" and not first_ok:
        return [c["skip_stops"], c["disagree"]]
    if any("wrote no error" in p for p in problems):
        return [c["silent"], c["swallowed"]]
    if first_ok:
        return [c["swallowed"], c["no_check"], c["late"]]
    return [c["late"], c["no_check"], c["swallowed"]]


@judge_injected(NonfiniteEvidence)
def judge_handle_nonfinite(c: DrillContext, evidence: NonfiniteEvidence) -> Judgement:
    spec, fault, first = c.spec, c.fault, c.run.attempts[0]
    params = fault.params
    policy, target, value = str(params.raw("policy", "stop")), str(params.raw("target", "loss")), \
        str(getattr(fault, "value", params.raw("value", "nan")))
    injection_of = getattr(fault, "injection", None)
    injection = injection_of() if callable(injection_of) else None
    ranks = sorted({p.rank for p in c.reference.points}) or list(range(c.request.world_size))
    own_nan = [p for p in c.reference.points if not math.isfinite(p.value)]
    if own_nan:
        return Judgement("error", f"the uninterrupted run printed non-finite values by itself (`{own_nan[0].name}` "
                f"{own_nan[0].value} at step {own_nan[0].step} on rank {own_nan[0].rank}), so the drill "
                "cannot tell the injected value from the job's own; fix the job (or its seed) first",
                evidence)
    if injection is None:
        armed = evidence.fault_evidence.get("hook_armed_in_ranks")
        why = ("the start-up hook did not arm in rank " f"{spec.rank} (is the job a Python process "
               "started by trainguard? see fault_evidence.hook_errors)" if armed == [] else
               f"rank {spec.rank} computed no training loss (and ran no backward) after the trigger "
               "before the attempt ended")
        return Judgement("error", f"the {value} was never put in after step {c.info.injected_step}: {why}; "
                "nothing was tested", evidence)
    metric_points = first.points
    put_step = injection.get("step")
    own = sorted((p for p in metric_points if p.rank == spec.rank and p.step >= (c.info.injected_step or 0)
                  and p.t >= (fault.injected_at or 0.0)), key=lambda p: p.t)
    if put_step is None:  # no torch.optim step counted: the first step the rank printed after it
        put_step = next((p.step for p in own if not math.isfinite(p.value)),
                        (c.info.injected_step or 0) + 1)
    numerics = numerics_evidence(metric_points, put_step, ranks)
    numerics.put_into = PutInto(rank=spec.rank, step=put_step, target=target, value=value,
                                via=injection.get("via"))
    put_visible = any(p.rank == spec.rank and p.step == put_step and not math.isfinite(p.value)
                      for p in metric_points)
    evidence.numerics = numerics
    problems: list[str] = []
    if policy == "stop":
        problems = exit_problems(c, evidence)
        if first.ok:
            problems[:1] = [f"the job did not stop: it completed (exit 0){_trained_on(c, numerics)}"]
    else:
        final = c.run.final
        if not final.ok:
            problems.append(f"the job did not go on after the {value}: {fault.classify(final)}")
        elif first.last_step is not None and first.last_step < spec.steps:
            problems.append(f"the job exited 0 after step {first.last_step} of {spec.steps}")
        if numerics.later_nonfinite_points:
            problems.append("every later metric must be finite, but " + _trained_on(c, numerics).lstrip("; "))
    spread = ""
    if numerics.reached_every_rank:
        firsts = ", ".join(f"rank {r} at step {e.first_step}" for r, e in numerics.nonfinite_by_rank.items())
        spread = (f"; the {value} put into rank {spec.rank} reached every rank (first non-finite "
                  f"metric: {firsts})")
    what = (f"{value} put into rank {spec.rank}'s {'gradients' if target == 'grads' else 'loss'} at "
            f"step {put_step} (via {injection.get('via')}; trigger after step {c.info.injected_step}), "
            f"policy {policy}")
    first_bad = numerics.first_nonfinite
    seen = (f"; first non-finite metric: `{first_bad.metric}` at step {first_bad.step} on rank "
            f"{first_bad.rank}" if first_bad else "; no metric printed was non-finite")
    if problems:
        causes = _causes(policy, first.ok, first.outcome == "hung" or c.info.stopped_at_deadline,
                         numerics, put_visible, problems)
        evidence.likely_causes = causes
        return Judgement("failed", f"{what}: " + "; ".join(problems) + seen + spread
                + f". Most likely {causes[0]}", evidence)
    if policy == "stop":
        exit_after = known(evidence.exit_after_s)
        said = known(evidence.error_line)
        how = (f"rank {first.failed_rank} exited with an error "
               + (f"{exit_after:.2f} s after the fault" if exit_after is not None else "")
               + f" (deadline {spec.deadline_s:g} s)" + (f" (\"{said[:200]}\")" if said else ""))
        return Judgement("passed", f"{what}: {how}{seen}{spread}", evidence)
    later = [p for p in metric_points if p.step > put_step]
    return Judgement("passed", f"{what}: the job went on to step {first.last_step} and all {len(later)} metric "
            f"value(s) after step {put_step} are finite{seen}{spread}", evidence)


def _trained_on(c: DrillContext, numerics: NumericsEvidence) -> str:
    steps = numerics.later_nonfinite_steps
    put = numerics.put_into
    if not steps or not isinstance(put, PutInto):
        return ""
    later = [p for p in c.run.attempts[0].points if p.step > put.step]
    return (f"; it trained on after the non-finite value: {numerics.later_nonfinite_points} of "
            f"{len(later)} later metric value(s) non-finite ({_steps(steps)} on "
            f"{_ranks(numerics.later_nonfinite_ranks)})")


HANDLE_NONFINITE = JudgeEntry("handle_nonfinite", judge_handle_nonfinite)
