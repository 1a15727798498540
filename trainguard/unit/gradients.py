"""Assertions about gradients: every trainable parameter gets one, the loss reaches every output.

Example::

    loss = F.cross_entropy(out["logits"], y) + 0.1 * out["aux"].mean()
    assert_loss_connected(loss, out)
    assert_grads_flow(model, loss, allow_unused=["aux_head.*"])
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from trainguard._internal.tensors import leaves, render_path
from trainguard.errors import UsageError
from trainguard.unit.support import (
    check_loss,
    check_model,
    check_tolerance,
    fail,
    fmt_number,
    matching_names,
    name_patterns,
    type_name,
)

__all__ = ["assert_grads_flow", "assert_loss_connected"]


def assert_grads_flow(
    model: torch.nn.Module,
    loss: torch.Tensor | None = None,
    *,
    allow_unused: str | Iterable[str] = (),
    atol: float = 0.0,
) -> dict[str, float]:
    """Assert every trainable parameter gets a usable gradient.

    With ``loss``, first zeroes the model's grads (``set_to_none``) and backpropagates it;
    without, checks the grads already there. Every parameter with ``requires_grad`` must have a
    grad that is not None (None: the loss never reached it), not all zero (max ``|grad| <= atol``)
    and finite. ``allow_unused`` exempts parameters by name or fnmatch pattern (``"head2.*"``).
    The message lists every dead parameter, grouped by reason.

    Returns ``{name: max |grad|}`` for the parameters that have a grad.

    Example::

        loss = F.mse_loss(model(x), y)
        assert_grads_flow(model, loss, allow_unused=["aux_head.*"])
    """
    check_model(model)
    tolerance = check_tolerance(atol, "atol", "assert_grads_flow")
    named = dict(model.named_parameters())
    exempt = matching_names(named, name_patterns(allow_unused, "allow_unused"), "allow_unused")
    trainable = {name: p for name, p in named.items() if p.requires_grad}
    if not trainable:
        fail(
            f"assert_grads_flow: {type_name(model)} has no parameter with requires_grad=True "
            f"({len(named)} parameters, all frozen); nothing can learn"
        )
    if loss is not None:
        check_loss(loss, "assert_grads_flow")
        model.zero_grad(set_to_none=True)
        loss.backward()

    missing: list[str] = []
    zero: list[str] = []
    nonfinite: list[str] = []
    magnitudes: dict[str, float] = {}
    for name, param in trainable.items():
        grad = param.grad
        if grad is None:
            if name not in exempt:
                missing.append(name)
            continue
        grad = grad.detach()
        if grad.is_sparse:
            grad = grad.to_dense()
        finite = bool(torch.isfinite(grad).all())
        magnitude = float(grad.abs().max()) if grad.numel() else 0.0
        magnitudes[name] = magnitude
        if name in exempt:
            continue
        if not finite:
            nonfinite.append(name)
        elif magnitude <= tolerance:
            zero.append(name)
    dead = len(missing) + len(zero) + len(nonfinite)
    if not dead:
        return magnitudes
    lines = [
        f"assert_grads_flow: {dead} of {len(trainable)} trainable parameters of "
        f"{type_name(model)} get no usable gradient"
    ]
    if missing:
        lines.append(
            "grad is None (the loss never reached it: a detach(), torch.no_grad(), a "
            ".item()/.numpy() round trip, or a layer the forward pass does not use):"
        )
        lines += [f"  - {name}" for name in missing]
    if zero:
        lines.append(
            f"grad is all zero (max |grad| <= atol={tolerance}: dead ReLUs or saturated "
            "activations, a branch multiplied by zero, outputs masked out of the loss):"
        )
        lines += [f"  - {name} (max |grad| {fmt_number(magnitudes[name])})" for name in zero]
    if nonfinite:
        lines.append(
            "grad is not finite (nan/inf: check the loss and activations with assert_finite):"
        )
        lines += [f"  - {name}" for name in nonfinite]
    lines.append(
        "If a parameter is unused on purpose, exempt it: allow_unused=['<name or pattern>']."
    )
    fail("\n".join(lines))


def assert_loss_connected(loss: torch.Tensor, outputs: Any) -> None:
    """Assert the loss depends (differentiably) on every output tensor.

    ``loss`` must be a scalar tensor requiring grad; ``outputs`` a tensor or a nested
    dict/list/tuple of tensors (the model outputs the loss should use). For each output, the
    gradient of the loss with respect to it must exist and not be all zero. The graph is kept
    (``retain_graph=True``), so ``loss.backward()`` still works afterwards.

    Example::

        out = model(x)
        loss = F.cross_entropy(out["logits"], y) + 0.1 * out["aux"].mean()
        assert_loss_connected(loss, out)
    """
    loss = check_loss(loss, "assert_loss_connected")
    entries = [(path, leaf) for path, leaf in leaves(outputs) if isinstance(leaf, torch.Tensor)]
    if not entries:
        raise UsageError(
            f"assert_loss_connected found no tensor in outputs (type={type_name(outputs)}); "
            "pass the model outputs the loss is computed from"
        )
    problems: list[str] = []
    differentiable = []
    for path, tensor in entries:
        where = render_path("outputs", path)
        if not (tensor.is_floating_point() or tensor.is_complex()):
            problems.append(
                f"{where} is a {tensor.dtype} tensor: no gradient flows through integer outputs "
                "(argmax/round/cast); compute the loss from the floating-point logits"
            )
        elif not tensor.requires_grad:
            problems.append(
                f"{where} does not require grad: it was computed under torch.no_grad() or "
                "inference_mode, or detach()ed"
            )
        else:
            differentiable.append((where, tensor))
    if differentiable:
        grads = torch.autograd.grad(
            loss, [t for _, t in differentiable], allow_unused=True, retain_graph=True
        )
        for (where, _), grad in zip(differentiable, grads):
            if grad is None:
                problems.append(
                    f"{where} is not used by the loss (gradient None): the loss is computed from "
                    "other tensors, a detach()ed copy, or a value rebuilt from .item()"
                )
            elif not bool((grad != 0).any()):
                problems.append(
                    f"{where} gets an all-zero gradient from the loss: it is used but multiplied "
                    "by zero, fully masked, or passed through a non-differentiable step"
                )
    if problems:
        fail(
            f"assert_loss_connected: the loss is disconnected from {len(problems)} of "
            f"{len(entries)} outputs:\n" + "\n".join(f"  - {p}" for p in problems)
        )
