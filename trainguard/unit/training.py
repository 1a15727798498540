"""Assertions about training: the model can memorize one batch, a step moves the right weights.

Both really train: ``assert_can_overfit`` a deep copy of the model (by default),
``assert_step_updates`` the model and optimizer it is given, for one step.

Example::

    losses = assert_can_overfit(model, (x, y), F.cross_entropy, steps=200)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    assert_step_updates(model, lambda: F.mse_loss(model(x), y), opt,
                        expect_frozen=["embedding.*"])
"""

from __future__ import annotations

import copy as copy_module
import inspect
import math
from collections.abc import Callable, Iterable
from typing import Any

import torch

from trainguard.errors import UsageError
from trainguard.unit.support import (
    call_model,
    check_loss,
    check_model,
    check_tolerance,
    fail,
    fmt_number,
    matching_names,
    name_patterns,
    type_name,
)

__all__ = ["assert_can_overfit", "assert_step_updates"]


_OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "adam": torch.optim.Adam,
    "adamw": torch.optim.AdamW,
    "sgd": torch.optim.SGD,
}


def _make_optimizer(
    optimizer: str | Callable[..., torch.optim.Optimizer],
    params: list[torch.nn.Parameter],
    lr: float,
) -> torch.optim.Optimizer:
    if isinstance(optimizer, str):
        factory = _OPTIMIZERS.get(optimizer.lower())
        if factory is None:
            raise UsageError(
                f"Expected one of {sorted(_OPTIMIZERS)} or a callable params -> Optimizer for "
                f"optimizer, got optimizer={optimizer!r}"
            )
        return factory(params, lr=lr)
    if callable(optimizer):
        built = optimizer(params)
        if not isinstance(built, torch.optim.Optimizer):
            raise UsageError(
                f"the optimizer factory returned {type_name(built)}, expected a "
                "torch.optim.Optimizer"
            )
        return built
    raise UsageError(
        f"Expected a name like 'adam' or a callable for optimizer, got optimizer={optimizer!r} "
        f"(type={type_name(optimizer)})"
    )


def assert_can_overfit(
    model: torch.nn.Module,
    batch: tuple[Any, Any],
    loss_fn: Callable[[Any, Any], torch.Tensor],
    *,
    steps: int = 100,
    lr: float = 1e-2,
    optimizer: str | Callable[..., torch.optim.Optimizer] = "adam",
    max_final_loss: float | None = None,
    min_relative_drop: float = 0.9,
    copy: bool = True,
) -> list[float]:
    """Assert the model can drive the loss on one fixed batch down (memorize it).

    ``batch`` is ``(inputs, targets)``; each step computes ``loss_fn(model(inputs), targets)``
    (``model(*inputs)`` / ``model(**inputs)`` for a tuple / dict of inputs). ``optimizer`` is
    ``"adam"``, ``"adamw"``, ``"sgd"`` (with ``lr``) or a factory ``params -> Optimizer`` (then
    ``lr`` is unused). The check passes when the final loss is at most
    ``(1 - min_relative_drop) * initial``; when ``max_final_loss`` is given, it replaces that
    criterion (final loss ``<= max_final_loss``).

    This trains the model: with ``copy=True`` (default) a deep copy is trained and ``model`` is
    untouched; with ``copy=False`` the model itself is trained. Dropout stays as the model's
    mode has it.

    Returns the losses: one per step (before its update), plus the final loss.

    Example::

        losses = assert_can_overfit(model, (x, y), F.cross_entropy, steps=200)
    """
    check_model(model)
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise UsageError(f"Expected a positive int for steps, got steps={steps!r}")
    lr = check_tolerance(lr, "lr", "assert_can_overfit")
    if not 0 < min_relative_drop <= 1:
        raise UsageError(
            f"Expected a float in (0, 1] for min_relative_drop, got "
            f"min_relative_drop={min_relative_drop!r}"
        )
    if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
        raise UsageError(
            f"Expected (inputs, targets) for batch, got batch of type {type_name(batch)}"
            + (f" with {len(batch)} items" if isinstance(batch, (tuple, list)) else "")
        )
    inputs, targets = batch
    trained = copy_module.deepcopy(model) if copy else model
    params = [p for p in trained.parameters() if p.requires_grad]
    if not params:
        fail(
            f"assert_can_overfit: {type_name(model)} has no parameter with requires_grad=True; "
            "every parameter is frozen, so the loss cannot fall"
        )
    opt = _make_optimizer(optimizer, params, lr)
    opt_label = (
        f"optimizer {optimizer!r}, lr={lr}"
        if isinstance(optimizer, str)
        else f"optimizer {type_name(opt)} from the factory"
    )
    total = sum(1 for _ in trained.parameters())
    opt_label += f", {len(params)} of {total} parameter tensors trainable"

    def compute_loss() -> torch.Tensor:
        loss = loss_fn(call_model(trained, inputs), targets)
        return check_loss(loss, "assert_can_overfit")

    losses: list[float] = []
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = compute_loss()
        value = float(loss.detach())
        losses.append(value)
        if not math.isfinite(value):
            fail(
                f"assert_can_overfit: the loss became {value} at step {step} of {steps} "
                f"({opt_label}); losses so far: {[fmt_number(v) for v in losses[-5:]]}. Lower the "
                "learning rate, or look for log(0)/division by zero with assert_finite"
            )
        loss.backward()
        opt.step()
    with torch.no_grad():
        losses.append(float(loss_fn(call_model(trained, inputs), targets).detach()))

    initial, final = losses[0], losses[-1]
    if max_final_loss is not None:
        passed = final <= max_final_loss
        criterion = f"required: final loss <= {max_final_loss}"
    else:
        if initial <= 0:
            raise UsageError(
                f"assert_can_overfit: the initial loss is {fmt_number(initial)} <= 0, "
                "so a relative "
                "drop is meaningless; pass max_final_loss= instead"
            )
        passed = math.isfinite(final) and final <= (1 - min_relative_drop) * initial
        criterion = f"required: a drop of {min_relative_drop:.0%}"
    if passed:
        return losses
    drop = (initial - final) / initial if initial else 0.0
    every = max(1, steps // 10)
    trace = ", ".join(f"{i}: {fmt_number(losses[i])}" for i in [*range(0, steps, every), steps])
    if final == initial:
        cause = (
            "The loss did not move at all: the parameters are not updated (lr=0, parameters "
            "frozen or missing from the optimizer, gradients not reaching them; see "
            "assert_step_updates and assert_grads_flow)."
        )
    else:
        cause = (
            "Likely causes: learning rate too low or too high, too few steps, parameters "
            "frozen or missing from the optimizer, a loss/target mismatch (softmax applied "
            "before cross_entropy, wrong target dtype or shape), too little capacity."
        )
    fail(
        f"assert_can_overfit: {type_name(model)} did not overfit one batch in {steps} steps "
        f"({opt_label}): loss {fmt_number(initial)} -> {fmt_number(final)}, a drop of {drop:.1%} "
        f"({criterion}).\nloss by step: {trace}\n{cause}"
    )


def _call_loss_fn(fn: Callable[..., Any], model: torch.nn.Module) -> Any:
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return fn()
    required = [
        p
        for p in signature.parameters.values()
        if p.default is inspect.Parameter.empty
        and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    if len(required) == 0:
        return fn()
    if len(required) == 1:
        return fn(model)
    raise UsageError(
        "Expected a closure () -> loss or a function (model) -> loss for loss_fn_or_closure, "
        f"got a callable with {len(required)} required arguments {[p.name for p in required]}"
    )


def _why_not_updated(
    param: torch.nn.Parameter, optimizer: torch.optim.Optimizer, tolerance: float
) -> str:
    group = next((g for g in optimizer.param_groups if any(q is param for q in g["params"])), None)
    if group is None:
        return (
            "not in any optimizer param group (the optimizer was built from a subset of the "
            "parameters, or before the layer was added or replaced)"
        )
    if group.get("lr", None) == 0:
        return "its optimizer param group has lr=0"
    if param.grad is None:
        return "grad is None: the loss does not reach it (see assert_grads_flow)"
    if not bool((param.grad.abs() > 0).any()):
        return "grad is all zero"
    return f"the optimizer step changed it by at most atol={tolerance}"


def assert_step_updates(
    model: torch.nn.Module,
    loss_fn_or_closure: Callable[..., torch.Tensor],
    optimizer: torch.optim.Optimizer,
    *,
    expect_frozen: str | Iterable[str] = (),
    atol: float = 0.0,
) -> dict[str, float]:
    """Assert one optimizer step changes exactly the parameters that should train.

    Snapshots the parameters, zeroes the optimizer's grads, calls ``loss_fn_or_closure()`` (or
    ``loss_fn_or_closure(model)`` when it takes one argument), backpropagates the loss and calls
    ``optimizer.step()`` once: the model and optimizer really take that step. Then every
    parameter with ``requires_grad`` not matched by ``expect_frozen`` (names or fnmatch patterns)
    must have changed by more than ``atol``, and every parameter with ``requires_grad=False`` or
    matched by ``expect_frozen`` must not have. Offenders in both directions are named, with the
    reason when it can be found (not in the optimizer, lr=0, no grad).

    Returns ``{name: max |change|}`` for every parameter.

    Example::

        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        assert_step_updates(model, lambda: F.mse_loss(model(x), y), opt,
                            expect_frozen=["embedding.*"])
    """
    check_model(model)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise UsageError(
            f"Expected a torch.optim.Optimizer for optimizer, got {type_name(optimizer)}"
        )
    if not callable(loss_fn_or_closure):
        raise UsageError(
            "Expected a closure () -> loss or a function (model) -> loss for "
            f"loss_fn_or_closure, got {type_name(loss_fn_or_closure)}"
        )
    tolerance = check_tolerance(atol, "atol", "assert_step_updates")
    named = dict(model.named_parameters())
    frozen_by_pattern = matching_names(
        named, name_patterns(expect_frozen, "expect_frozen"), "expect_frozen"
    )
    before = {name: p.detach().clone() for name, p in named.items()}

    optimizer.zero_grad(set_to_none=True)
    loss = check_loss(_call_loss_fn(loss_fn_or_closure, model), "assert_step_updates")
    loss.backward()
    optimizer.step()

    changes: dict[str, float] = {}
    with torch.no_grad():
        for name, param in named.items():
            delta = (param.detach() - before[name]).abs()
            changes[name] = float(delta.max()) if delta.numel() else 0.0
    stuck = []
    moved = []
    for name, param in named.items():
        change = changes[name]
        if not param.requires_grad:
            if change > tolerance:
                moved.append(
                    f"  - {name}: changed by {fmt_number(change)} though requires_grad=False "
                    "(something "
                    "updates it outside autograd: an in-place write, or an optimizer that "
                    "applies weight decay or momentum to it regardless)"
                )
        elif name in frozen_by_pattern:
            if change > tolerance:
                moved.append(
                    f"  - {name}: changed by {fmt_number(change)} though listed in "
                    "expect_frozen; it "
                    "still has requires_grad=True and is in the optimizer (call "
                    "requires_grad_(False) or leave it out of the optimizer)"
                )
        elif not change > tolerance:
            stuck.append(f"  - {name}: {_why_not_updated(param, optimizer, tolerance)}")
    if stuck or moved:
        lines = [
            f"assert_step_updates: one optimizer step of {type_name(optimizer)} "
            f"on {type_name(model)}"
        ]
        if stuck:
            lines.append(f"left {len(stuck)} trainable parameters unchanged:")
            lines += stuck
        if moved:
            lines.append(f"changed {len(moved)} parameters that should stay frozen:")
            lines += moved
        fail("\n".join(lines))
    return changes
