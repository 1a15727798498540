"""Every parameter an optimizer steps gets a gradient: the part of "every trainable parameter
trains" today's step records show (docs/invariants.md).

A step line holds each parameter of the optimizer with its gradient's fingerprint, ``null`` when
the parameter had none at the step. A parameter that has none at every step of a run is in the
optimizer and never trained: a module replaced after the optimizer was built (the optimizer holds
the old one's parameters, which no module of the model names any more: the agent names them
``group{g}.{i}``), ``requires_grad`` turned off after the optimizer was built (a layer frozen by
mistake), or a module the forward never calls. A parameter with no gradient at some steps only
(an expert a batch did not route to, a branch taken now and then) is no finding.

What these records cannot show (a parameter that requires a gradient and is in no optimizer, a
group dropped, a parameter in two groups, an update that left a parameter unchanged) needs fields
the agent does not write yet: the plan is in docs/invariants.md.
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

__all__ = ["MIN_STEPS", "gradient_findings"]

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
