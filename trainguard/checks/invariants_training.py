"""Every parameter an optimizer steps gets a gradient (the part of "every trainable parameter
trains" today's step records show), and the loss scaler backs off after a step it skipped
(docs/invariants.md).

A step line holds each parameter of the optimizer with its gradient's fingerprint, ``null`` when
the parameter had none at the step. A parameter that has none at every step of a run is in the
optimizer and never trained: a module replaced after the optimizer was built (the optimizer holds
the old one's parameters, which no module of the model names any more: the agent names them
``group{g}.{i}``), ``requires_grad`` turned off after the optimizer was built (a layer frozen by
mistake), or a module the forward never calls. A parameter with no gradient at some steps only
(an expert a batch did not route to, a branch taken now and then) is no finding.

A GradScaler skips a step whose gradients hold an inf or NaN and lowers its scale in ``update()``
(by ``backoff_factor``): the scale the next step records is lower. One that is not lower after a
skipped step was set back by the job (``scaler.update(new_scale)`` with a fixed scale, a
``backoff_factor`` of 1, a scale set by hand): the scale that overflowed stays, and the steps after
it may be skipped as well, each one not trained.

What the step lines alone cannot show (a parameter that requires a gradient and is in no
optimizer, a group dropped, a parameter in two optimizers, an update that left a parameter
unchanged) is read from the agent's ``params`` and ``model`` lines by
:mod:`trainguard.checks.invariants_steps`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from trainguard.checks.invariants_records import (
    NOTHING_ALLOWED,
    Allowed,
    Coverage,
    Finding,
    Invariant,
    matches,
)
from trainguard.launch.steps import StepRecords

__all__ = ["MIN_STEPS", "gradient_findings", "scaler_findings"]

#: the fewest steps of an optimizer a rank must record before "never a gradient" is said
MIN_STEPS = 2


@dataclass
class _Never:
    """A parameter of one optimizer with no gradient at any step of the ranks in ``ranks``."""

    name: str
    opt: int
    first: int
    steps: int
    ranks: list[int] = field(default_factory=list)


def gradient_findings(steps: StepRecords, *, allowed: Allowed = NOTHING_ALLOWED) -> tuple[list[Finding], Coverage]:
    """The parameters an optimizer steps that never got a gradient in a rank's record."""
    never: dict[tuple[int, str], _Never] = {}
    compared = 0
    short = 0
    for r, rank in steps.ranks.items():
        for opt in rank.optimizers:
            records = [s for s in rank.steps if s.opt == opt]
            if len(records) < MIN_STEPS:
                short += 1
                continue
            names = set().union(*(s.grad for s in records))
            for name in sorted(names):
                if matches(name, allowed.frozen):
                    continue
                compared += 1
                if all(s.grad.get(name) is None for s in records):
                    found = never.setdefault((opt, name), _Never(name, opt, records[0].n, len(records)))
                    found.ranks.append(r)
    findings = [_finding(n) for n in sorted(never.values(), key=lambda n: (n.opt, n.name))]
    reason = (f"{short} optimizer(s) of a rank recorded fewer than {MIN_STEPS} steps: not judged" if short else "")
    if not steps.has_steps:
        reason = "no rank recorded a step"
    what = f"{compared} parameter(s) checked for a gradient at any recorded step" if compared else ""
    return findings, Coverage(Invariant.TRAINS, compared, what, reason)


def _finding(never: _Never) -> Finding:
    unnamed = never.name.startswith("group") and "." in never.name and never.name.split(".")[-1].isdigit()
    why = (" and no module of the model holds it (named by its place in the optimizer): the module was most "
           "likely replaced after the optimizer was built" if unnamed else "")
    observation = (f"optimizer {never.opt} steps it, but it got no gradient at any of its {never.steps} recorded "
                   f"steps{why}")
    fix = ("build the optimizer after the model is final (a head added or replaced later is not in it), and "
           "check requires_grad and that the forward uses the module; if it is frozen on purpose, leave it out of "
           f"the optimizer or add {never.name!r} to checks.invariants.allow.frozen")
    return Finding(Invariant.TRAINS, never.first, tuple(sorted(never.ranks)), never.name, observation, fix, None,
                   never.opt)


def scaler_findings(steps: StepRecords) -> tuple[list[Finding], Coverage]:
    """The first step a GradScaler skipped after which its scale did not fall, per optimizer (the
    ranks where it did not, together)."""
    first: dict[int, tuple[int, float, float, list[int]]] = {}
    compared = 0
    for r, rank in steps.ranks.items():
        for opt in rank.optimizers:
            by_n = rank.of(opt)
            for n, step in sorted(by_n.items()):
                after = by_n.get(n + 1)
                if step.scaler is None or not step.scaler.skipped or after is None or after.scaler is None:
                    continue
                compared += 1
                if after.scaler.scale >= step.scaler.scale:
                    if opt not in first or n < first[opt][0]:
                        first[opt] = (n, step.scaler.scale, after.scaler.scale, [])
                    if first[opt][0] == n:
                        first[opt][3].append(r)
                    break
    findings = [Finding(
        Invariant.SCALER, n, tuple(sorted(ranks)), f"optimizer {opt}'s loss scaler",
        f"it skipped step {n} (an inf or NaN in the gradients) at scale {before:g}, and step {n + 1} runs at "
        f"{again:g}: the scale did not back off",
        "call scaler.update() with no argument once per iteration, after scaler.step(optimizer), and keep "
        "backoff_factor below 1: it lowers the scale after an overflow (and raises it again after "
        "growth_interval clean steps); a fixed scale passed to update() keeps the one that overflowed", None, opt)
        for opt, (n, before, again, ranks) in sorted(first.items())]
    what = f"{compared} skipped step(s) followed by a lower scale checked" if compared else ""
    return findings, Coverage(Invariant.SCALER, compared, what,
                              "" if compared else "no step skipped by a loss scaler (none used, or no overflow)")
