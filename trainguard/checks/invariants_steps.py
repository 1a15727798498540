"""The invariants read from the agent's ``params``, ``model`` and ``eval`` lines and the step
lines' ``carried``, ``eval_in_step`` and ``clip`` (docs/invariants.md, issue 45):

* **every trainable parameter trains** (:func:`group_findings`): a parameter that requires a
  gradient and got one from the forward is in some optimizer's param group (a group left out of
  the optimizer's list, a head added after the optimizer was built), and in only one;
* **every update changes its fp32 parameter** (:func:`unchanged_findings`): a float32 parameter
  with a non-zero gradient, an lr above 0 and a step not skipped changes at the step (a bf16 one
  may not: an update below half its ulp rounds away);
* **gradients start from zero** (:func:`zero_grad_findings`): an optimizer's parameters hold no
  gradient left from its previous step at every backward before the next (a missing
  ``zero_grad``), unless the job accumulates across steps on purpose (``allow.accumulates``);
* **train and eval modes** (:func:`mode_findings`): no dropout or norm module with running
  statistics runs in eval mode in a forward with gradients (a ``model.eval()`` left on after
  validation), nor in training mode in one without (validation in train mode);
* **clipping after unscaling** (:func:`clip_findings`): gradients a GradScaler scaled are not
  clipped before ``scaler.unscale_``.

Each applies only to ranks whose agent wrote these records (a ``params`` line): an older agent's
records say nothing of them, and the coverage says so.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from trainguard.checks.invariants_records import (
    NOTHING_ALLOWED,
    Allowed,
    Coverage,
    Finding,
    Invariant,
    matches,
)
from trainguard.launch.steps import RankSteps, StepRecord, StepRecords

__all__ = ["MIN_RELATIVE_UPDATE", "clip_findings", "group_findings", "growth_findings", "mode_findings",
           "step_field_findings",
           "unchanged_findings", "zero_grad_findings"]

_NO_RECORDS = "no rank's agent wrote the param groups (an agent before this version, or no optimizer step)"
_NO_MODEL = ("no module holds the optimizer's parameters themselves, so no trainable parameter was checked against "
             "the param groups (a module that puts other tensors in their place at each forward, as torch's TP + "
             "DDP recipe does)")


@dataclass
class _Seen:
    """What one finding gathers over the ranks: the first step and the ranks seen there."""

    step: int
    names: tuple[str, ...]
    opt: int = 0
    ranks: list[int] = field(default_factory=list)

    def add(self, step: int, names: tuple[str, ...], rank: int) -> None:
        if step < self.step:
            self.step, self.names, self.ranks = step, names, [rank]
        elif step == self.step:
            if rank not in self.ranks:
                self.ranks.append(rank)
            self.names += tuple(n for n in names if n not in self.names)


def _gather(seen: dict[object, _Seen], key: object, step: int, names: tuple[str, ...], rank: int, opt: int) -> None:
    if key in seen:
        seen[key].add(step, names, rank)
    else:
        seen[key] = _Seen(step, names, opt, [rank])


def _some(names: Iterable[str], limit: int = 3) -> str:
    listed = list(names)
    more = f" and {len(listed) - limit} more" if len(listed) > limit else ""
    return ", ".join(listed[:limit]) + more


def _recorded(steps: StepRecords) -> dict[int, RankSteps]:
    return {r: rank for r, rank in steps.ranks.items() if rank.params}


def step_field_findings(steps: StepRecords, *, allowed: Allowed = NOTHING_ALLOWED) -> list[tuple[list[Finding], Coverage]]:
    """Each invariant of this module: its findings and coverage."""
    return [group_findings(steps, allowed=allowed), unchanged_findings(steps, allowed=allowed),
            zero_grad_findings(steps, allowed=allowed),
            mode_findings(steps, allowed=allowed), clip_findings(steps), growth_findings(steps)]


# -- every trainable parameter trains --------------------------------------------------------------


def group_findings(steps: StepRecords, *, allowed: Allowed = NOTHING_ALLOWED) -> tuple[list[Finding], Coverage]:
    """Trainable parameters that had a gradient and that no optimizer holds (the agent's ``model``
    lines, matched by the parameters themselves, not by their names: two models of a job may name
    theirs alike), and parameters two live optimizers hold (``params``' ``shared``)."""
    ranks = _recorded(steps)
    outside: dict[object, _Seen] = {}
    twice: dict[object, _Seen] = {}
    compared = 0
    for r, rank in ranks.items():
        for model in rank.models:
            compared += len(model.trainable)
            for name in model.grad:
                if not matches(name, allowed.frozen):
                    _gather(outside, (model.opt, name), model.n, (name,), r, model.opt)
        for p in rank.params:
            for name in p.shared:
                _gather(twice, (p.opt, name), p.n, (name,), r, p.opt)
    findings = [_outside_finding(seen) for _, seen in sorted(outside.items(), key=lambda kv: str(kv[0]))]
    findings += [Finding(
        Invariant.TRAINS, seen.step, tuple(sorted(seen.ranks)), seen.names[0],
        f"optimizer {seen.opt} holds it and so does another optimizer of the process: each applies its update to "
        "it at every step", "put each parameter in the param groups of one optimizer (a list built twice, "
        "model.parameters() given to two optimizers)", None, seen.opt)
        for _, seen in sorted(twice.items(), key=lambda kv: str(kv[0]))]
    what = f"{compared} trainable parameter(s) of the model checked against the optimizers' param groups"
    reason = ("" if compared else _NO_RECORDS if not ranks else _NO_MODEL if any(r.models for r in ranks.values())
              else "no optimizer stepped twice (its model line is written at its second step)")
    return findings, Coverage(Invariant.TRAINS, compared, what if compared else "", reason)


def unchanged_findings(steps: StepRecords, *, allowed: Allowed = NOTHING_ALLOWED) -> tuple[list[Finding], Coverage]:
    """fp32 parameters an optimizer held with a gradient, a learning rate and a step not skipped,
    whose bits its update left as they were, at two steps running (the first of them named)."""
    seen: dict[object, _Seen] = {}
    compared = 0
    for r, rank in _recorded(steps).items():
        for opt in rank.optimizers:
            groups = next((p for p in reversed(rank.params) if p.opt == opt), None)
            if groups is None:
                continue
            group_of = {name: (g, kinds[i] if i < len(kinds) else None)
                        for g, (names, kinds) in enumerate(zip(groups.groups, groups.dtypes, strict=False))
                        for i, name in enumerate(names)}
            fp32 = {name: g for name, (g, kind) in group_of.items()
                    if kind == "float32" and not matches(name, allowed.frozen)}
            by_n = rank.of(opt)
            for n in sorted(by_n):
                after, later = by_n.get(n + 1), by_n.get(n + 2)
                if after is None or later is None:
                    continue
                for name, g in fp32.items():
                    kept = [_kept(step, nxt, name, g) for step, nxt in ((by_n[n], after), (after, later))]
                    compared += kept[0] is not None
                    if kept[0] and kept[1]:
                        _gather(seen, (opt, name), n, (name,), r, opt)
    findings = [Finding(
        Invariant.TRAINS, s.step, tuple(sorted(s.ranks)), s.names[0],
        f"a float32 parameter optimizer {s.opt} holds: at steps {s.step} and {s.step + 1} it had a non-zero gradient, a "
        "learning rate above 0 and a step not skipped, and each left every bit of it as it was",
        "find what undoes the update (a copy of the old weights put back after optimizer.step(), an optimizer "
        "stepping a copy, a gradient hook or mask that zeroes the update); if it is frozen on purpose, add "
        f"{s.names[0]!r} to checks.invariants.allow.frozen", None, s.opt)
        for _, s in sorted(seen.items(), key=lambda kv: str(kv[0]))]
    what = f"{compared} float32 parameter-step(s) checked to change at their update" if compared else ""
    return findings, Coverage(Invariant.TRAINS, compared, what,
                              "" if compared else "no float32 parameter with a gradient at 3 steps running")


#: the least update (learning rate x the gradient's norm) relative to the parameter's norm a step
#: must have for an unchanged parameter to be a finding: a smaller one may round to nothing
MIN_RELATIVE_UPDATE = 2.0**-10


def _kept(step: StepRecord, after: StepRecord, name: str, g: int) -> bool | None:
    """Whether ``step``'s update left ``name`` (of param group ``g``) as it was; None when it need not
    have changed it (no gradient, a zero or non-finite one, an lr of 0, a skipped step, an update
    too small to show)."""
    grad, before, now = step.grad.get(name), step.param.get(name), after.param.get(name)
    lr = step.groups[g].lr if g < len(step.groups) else None
    if grad is None or before is None or now is None or lr is None or lr <= 0:
        return None
    if (step.scaler is not None and step.scaler.skipped) or not 0 < grad.ss < math.inf:
        return None
    if lr * math.sqrt(grad.ss) <= MIN_RELATIVE_UPDATE * math.sqrt(before.ss):
        return None
    return now == before


def _outside_finding(seen: _Seen) -> Finding:
    name = seen.names[0]
    return Finding(
        Invariant.TRAINS, seen.step, tuple(sorted(seen.ranks)), name,
        f"it requires a gradient and the forward gave it one (at optimizer {seen.opt}'s step {seen.step}), but no "
        "optimizer's param group holds it: it is never updated",
        "give the optimizer every trainable parameter (a param group left out of its list; a module added after "
        "the optimizer was built: build it after the model is final, or add_param_group); if it is frozen on "
        f"purpose, set requires_grad to False or add {name!r} to checks.invariants.allow.frozen", None, seen.opt)


# -- gradients start from zero ---------------------------------------------------------------------


def zero_grad_findings(steps: StepRecords, *, allowed: Allowed = NOTHING_ALLOWED) -> tuple[list[Finding], Coverage]:
    """The first step of each optimizer whose gradients were carried over from its previous step."""
    ranks = _recorded(steps)
    seen: dict[object, _Seen] = {}
    compared = 0
    for r, rank in ranks.items():
        for opt in rank.optimizers:
            records = sorted(rank.of(opt).values(), key=lambda s: s.n)
            compared += max(0, len(records) - 1)
            first = next((s for s in records if s.carried), None)
            if first is not None and first.carried and not allowed.accumulates:
                _gather(seen, opt, first.n, first.carried, r, opt)
    findings = [Finding(
        Invariant.ZERO_GRADS, s.step, tuple(sorted(s.ranks)), _some(s.names),
        f"{len(s.names)} parameter(s) of optimizer {s.opt} held a non-zero gradient left from step {s.step - 1} at "
        f"every backward of step {s.step}: each step adds the previous steps' gradients to its own",
        "call optimizer.zero_grad() once per optimizer step (before the backward, or after the step); if the job "
        "accumulates gradients across optimizer steps on purpose, set checks.invariants.allow.accumulates: true",
        None, s.opt) for s in sorted(seen.values(), key=lambda s: s.opt)]
    what = f"{compared} step(s) checked for gradients carried from the step before" if compared else ""
    return findings, Coverage(Invariant.ZERO_GRADS, compared, what,
                              "" if ranks else _NO_RECORDS)


# -- train and eval modes --------------------------------------------------------------------------


def mode_findings(steps: StepRecords, *, allowed: Allowed = NOTHING_ALLOWED) -> tuple[list[Finding], Coverage]:
    """The first training step with a watched module in eval mode, and the first forward without
    gradients with one in training mode, per optimizer."""
    ranks = _recorded(steps)
    in_eval: dict[object, _Seen] = {}
    in_train: dict[object, _Seen] = {}
    compared = 0
    for r, rank in ranks.items():
        if not any(m.watched for m in rank.models):
            continue
        compared += len(rank.steps)
        for step in rank.steps:
            names = tuple(n for n in step.eval_in_step if not matches(n, allowed.eval_modules))
            if names:
                _gather(in_eval, step.opt, step.n, names, r, step.opt)
        for ev in rank.evals:
            names = tuple(n for n in ev.train_mode if not matches(n, allowed.train_modules))
            if names:
                _gather(in_train, ev.opt, ev.after, names, r, ev.opt)
    findings = [_mode_finding(
        s, f"in eval mode in training step {s.step} (a forward with gradients): dropout is off, batch norm uses its "
        "running statistics and does not update them",
        "call model.train() before training again (after a validation's model.eval()); if a module is kept in "
        "eval mode on purpose (a frozen batch norm), add {name!r} to checks.invariants.allow.eval_modules")
        for s in sorted(in_eval.values(), key=lambda s: s.opt)]
    findings += [_mode_finding(
        s, f"in training mode in a forward without gradients after step {s.step} (a validation): dropout drops, "
        "batch norm uses the batch's statistics and updates its running ones with the validation data",
        "call model.eval() before validating (and model.train() after); if it runs in training mode on purpose "
        "(Monte Carlo dropout, a teacher), add {name!r} to checks.invariants.allow.train_modules")
        for s in sorted(in_train.values(), key=lambda s: s.opt)]
    what = f"the modes of the dropout and norm modules at {compared} step(s)" if compared else ""
    reason = "" if compared else (
        "no dropout (p > 0) or norm module with running statistics in the models" if ranks else _NO_RECORDS)
    return findings, Coverage(Invariant.MODES, compared, what, reason)


def _mode_finding(seen: _Seen, observation: str, fix: str) -> Finding:
    """A modes finding naming ``seen``'s modules (``fix`` names the first: ``{name!r}``)."""
    return Finding(Invariant.MODES, seen.step, tuple(sorted(seen.ranks)), _some(seen.names), observation,
                   fix.format(name=seen.names[0]), None, seen.opt)


# -- clipping after unscaling ----------------------------------------------------------------------


def clip_findings(steps: StepRecords) -> tuple[list[Finding], Coverage]:
    """The first step of each optimizer whose gradients were clipped while still scaled."""
    seen: dict[object, _Seen] = {}
    compared = 0
    for r, rank in steps.ranks.items():
        for step in rank.steps:
            if step.clip is None or (step.scaler is None and not step.clip.scaled):
                continue
            compared += 1
            if step.clip.scaled:
                _gather(seen, step.opt, step.n, (f"optimizer {step.opt}'s gradient clipping",), r, step.opt)
    findings = [Finding(
        Invariant.SCALER, s.step, tuple(sorted(s.ranks)), s.names[0],
        f"clip_grad_norm_/clip_grad_value_ ran at step {s.step} on gradients the loss scaler had multiplied by its "
        "scale, before scaler.unscale_(optimizer): the limit applies to the scaled gradients, so every step is "
        "clipped far below it",
        "call scaler.unscale_(optimizer) before clipping (then scaler.step(optimizer), scaler.update())",
        None, s.opt) for s in sorted(seen.values(), key=lambda s: s.opt)]
    what = f"{compared} clipped step(s) under a loss scaler checked for unscale_ first" if compared else ""
    return findings, Coverage(Invariant.SCALER, compared, what,
                              "" if compared else "no gradient clipping under a loss scaler recorded")


def growth_findings(steps: StepRecords) -> tuple[list[Finding], Coverage]:
    """The first run of more than ``growth_interval`` steps in a row that a GradScaler did not skip
    and whose scale stayed the same, per optimizer: its ``update()`` multiplies the scale by
    ``growth_factor`` after that many clean steps (the ``scaler`` line gives both)."""
    seen: dict[object, _Seen] = {}
    compared = 0
    for r, rank in steps.ranks.items():
        for settings in rank.scalers:
            interval, factor = settings.growth_interval, settings.growth_factor
            if not interval or factor is None or factor <= 1:
                continue
            clean = 0  # steps in a row not skipped, at the scale of the first of them
            scale = 0.0
            for step in sorted(rank.of(settings.opt).values(), key=lambda s: s.n):
                if step.scaler is None or step.scaler.skipped:
                    clean = 0
                elif clean and step.scaler.scale != scale:
                    compared += step.scaler.scale > scale and clean >= interval  # grew as it should
                    clean, scale = 1, step.scaler.scale
                elif clean == interval:  # one more clean step at the same scale
                    compared += 1
                    _gather(seen, settings.opt, step.n, (f"optimizer {settings.opt}'s loss scaler",), r, settings.opt)
                    break
                else:
                    clean, scale = clean + 1, step.scaler.scale
    findings = [Finding(
        Invariant.SCALER, s.step, tuple(sorted(s.ranks)), s.names[0],
        f"its scale stayed the same for more than growth_interval clean steps up to step {s.step}: update() did "
        "not grow it by growth_factor (a fixed scale passed to update(), or update() not called)",
        "call scaler.update() with no argument once per optimizer step, after scaler.step(optimizer)", None, s.opt)
        for s in sorted(seen.values(), key=lambda s: s.opt)]
    what = f"{compared} loss scaler(s) checked to grow after growth_interval clean steps" if compared else ""
    return findings, Coverage(Invariant.SCALER, compared, what, "" if compared else
                              "no loss scaler ran growth_interval clean steps in a row (2000 by default)")
