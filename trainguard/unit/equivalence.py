"""Equivalence: two nested structures of tensors are close, two implementations agree.

Every differing entry is named by its dotted path (``optimizer.state.3.exp_avg``) with how many
elements differ and where the largest absolute and relative differences are. Tolerances are
always explicit: no default is safe across dtypes and kernels.

Example::

    assert_close_tree(resumed.state_dict(), reference.state_dict(), rtol=0, atol=0, name="model")
    assert_equivalent(fused_layernorm, reference_layernorm, x, w, b, rtol=1e-5, atol=1e-6)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch

from trainguard._internal.tensors import TreePath, children, render_path, unravel_index
from trainguard.errors import UsageError
from trainguard.unit.seeding import rng_state, set_rng_state
from trainguard.unit.support import check_tolerance, fail, fmt_number, type_name

__all__ = ["assert_close_tree", "assert_equivalent", "tree_differences"]


def _tensor_difference(
    actual: torch.Tensor, expected: torch.Tensor, rtol: float, atol: float, labels: tuple[str, str]
) -> str | None:
    try:
        torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol)
        return None
    except AssertionError as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else "differ"
    a_name, b_name = labels
    if actual.shape != expected.shape:
        return f"shape {tuple(actual.shape)} ({a_name}) != {tuple(expected.shape)} ({b_name})"
    if actual.dtype != expected.dtype:
        return f"dtype {actual.dtype} ({a_name}) != {expected.dtype} ({b_name})"
    if actual.device != expected.device:
        return f"device {actual.device} ({a_name}) != {expected.device} ({b_name})"
    if actual.is_sparse or expected.is_sparse or actual.device.type == "meta":
        return reason
    wide = torch.complex128 if actual.is_complex() or expected.is_complex() else torch.float64
    a = actual.detach().to("cpu", wide).flatten()
    e = expected.detach().to("cpu", wide).flatten()
    diff = (a - e).abs()
    both_nan = torch.isnan(a) & torch.isnan(e)
    bad = ~(diff <= atol + rtol * e.abs())
    if not bool(bad.any()):
        return reason  # a mismatch assert_close sees beyond values (layout, ...)
    diff = torch.nan_to_num(torch.where(both_nan, 0.0, diff), nan=math.inf)
    rel = torch.where(e != 0, diff / e.abs(), torch.where(diff > 0, math.inf, 0.0))
    i_abs = int(diff.argmax())
    i_rel = int(rel.argmax())
    shape = tuple(actual.shape)

    def at(i: int) -> str:
        return (
            f"index {unravel_index(i, shape)} ({a_name} {fmt_number(a[i].item().real)}, "
            f"{b_name} {fmt_number(e[i].item().real)})"
        )

    return (
        f"{int(bad.sum())} of {a.numel()} elements differ; "
        f"max abs diff {fmt_number(float(diff[i_abs]))} "
        f"at {at(i_abs)}; max rel diff {fmt_number(float(rel[i_rel]))} at {at(i_rel)}"
    )


def _tree_differences(
    actual: Any,
    expected: Any,
    path: TreePath,
    rtol: float,
    atol: float,
    labels: tuple[str, str],
    out: list[tuple[TreePath, str]],
) -> int:
    """Append (path, description) for every differing entry; return how many leaves compared."""
    a_name, b_name = labels
    if isinstance(actual, torch.Tensor) or isinstance(expected, torch.Tensor):
        if not (isinstance(actual, torch.Tensor) and isinstance(expected, torch.Tensor)):
            out.append(
                (path, f"{type_name(actual)} ({a_name}) vs {type_name(expected)} ({b_name})")
            )
            return 1
        problem = _tensor_difference(actual, expected, rtol, atol, labels)
        if problem is not None:
            out.append((path, problem))
        return 1
    a_children, e_children = children(actual), children(expected)
    if a_children is not None and e_children is not None:
        if isinstance(actual, Mapping) != isinstance(expected, Mapping):
            out.append(
                (path, f"{type_name(actual)} ({a_name}) vs {type_name(expected)} ({b_name})")
            )
            return 1
        a_map, e_map = dict(a_children), dict(e_children)
        missing = [elem[1] for elem in e_map if elem not in a_map]
        extra = [elem[1] for elem in a_map if elem not in e_map]
        if missing:
            out.append((path, f"keys {missing} missing in {a_name}"))
        if extra:
            out.append((path, f"keys {extra} only in {a_name}, not in {b_name}"))
        compared = 0
        for elem, e_child in e_children:
            if elem in a_map:
                compared += _tree_differences(
                    a_map[elem], e_child, (*path, elem), rtol, atol, labels, out
                )
        return compared
    if a_children is not None or e_children is not None:
        out.append((path, f"{type_name(actual)} ({a_name}) vs {type_name(expected)} ({b_name})"))
        return 1
    numbers = (int, float)
    if (
        isinstance(actual, numbers)
        and isinstance(expected, numbers)
        and not isinstance(actual, bool)
        and not isinstance(expected, bool)
    ):
        diff = abs(actual - expected)
        if not diff <= atol + rtol * abs(expected):
            out.append(
                (
                    path,
                    f"{actual!r} ({a_name}) != {expected!r} ({b_name}), "
                    f"abs diff {fmt_number(diff)}",
                )
            )
        return 1
    try:
        equal = bool(actual == expected)
    except Exception:
        equal = repr(actual) == repr(expected)
    if not equal:
        out.append((path, f"{actual!r:.80} ({a_name}) != {expected!r:.80} ({b_name})"))
    return 1


def _close_tree_message(
    actual: Any, expected: Any, rtol: float, atol: float, name: str, labels: tuple[str, str]
) -> str | None:
    differences: list[tuple[TreePath, str]] = []
    compared = _tree_differences(actual, expected, (), rtol, atol, labels, differences)
    if not differences:
        return None
    lines = [
        f"{len(differences)} of {compared} entries differ (rtol={rtol}, atol={atol}):",
        *(f"  {render_path(name, path, dotted=True)}: {what}" for path, what in differences),
    ]
    return "\n".join(lines)


def assert_close_tree(
    actual: Any,
    expected: Any,
    *,
    rtol: float | None = None,
    atol: float | None = None,
    name: str = "value",
) -> None:
    """Assert two tensors or nested structures (state dicts, checkpoints, outputs) are close.

    Tensors are compared with ``torch.testing.assert_close(rtol=, atol=)`` (shape, dtype and
    device must match too); numbers by ``|a - e| <= atol + rtol * |e|``; anything else by ``==``.
    Dicts must have the same keys, sequences the same length. Tolerances are required. Every
    differing entry is reported, by its dotted path (``optimizer.state.3.exp_avg``), with the
    number of differing elements, the max absolute and relative differences and where they are.

    Example::

        assert_close_tree(resumed.state_dict(), reference.state_dict(), rtol=0, atol=0,
                          name="model")
    """
    rtol_ = check_tolerance(rtol, "rtol", "assert_close_tree")
    atol_ = check_tolerance(atol, "atol", "assert_close_tree")
    message = _close_tree_message(actual, expected, rtol_, atol_, name, ("actual", "expected"))
    if message is not None:
        fail(f"assert_close_tree: {name} differs from the expected value; {message}")


def assert_equivalent(
    fn_a: Callable[..., Any],
    fn_b: Callable[..., Any],
    /,
    *args: Any,
    rtol: float | None = None,
    atol: float | None = None,
    names: tuple[str, str] = ("a", "b"),
    **kwargs: Any,
) -> None:
    """Assert two implementations give the same outputs on the same inputs.

    Calls ``fn_a(*args, **kwargs)`` and ``fn_b(*args, **kwargs)``, both from the same global RNG
    state (so dropout or sampling draw the same numbers; the RNG ends where ``fn_b`` left it),
    and compares the outputs (tensors or nested structures) with ``assert_close_tree``.
    ``rtol`` and ``atol`` are required; ``names`` label the two sides in the message. The
    functions must not modify the arguments in place.

    Example::

        assert_equivalent(fused_layernorm, reference_layernorm, x, weight, bias,
                          rtol=1e-5, atol=1e-6, names=("fused", "reference"))
    """
    rtol_ = check_tolerance(rtol, "rtol", "assert_equivalent")
    atol_ = check_tolerance(atol, "atol", "assert_equivalent")
    if not (
        isinstance(names, (tuple, list))
        and len(names) == 2
        and all(isinstance(n, str) for n in names)
    ):
        raise UsageError(f"Expected two strings for names, got names={names!r}")
    if not (callable(fn_a) and callable(fn_b)):
        raise UsageError(
            f"Expected two callables for fn_a and fn_b, got {type_name(fn_a)} and "
            f"{type_name(fn_b)}"
        )
    saved = rng_state()
    out_a = fn_a(*args, **kwargs)
    set_rng_state(saved)
    out_b = fn_b(*args, **kwargs)
    labels = (str(names[0]), str(names[1]))
    message = _close_tree_message(out_a, out_b, rtol_, atol_, "output", labels)
    if message is not None:
        fail(f"assert_equivalent: {labels[0]} and {labels[1]} disagree; {message}")


def tree_differences(
    actual: Any,
    expected: Any,
    *,
    rtol: float,
    atol: float,
    labels: tuple[str, str] = ("actual", "expected"),
) -> list[tuple[str, str]]:
    """Every differing entry of two nested structures as ``(dotted key, what differs)``.

    The non-raising core of :func:`assert_close_tree`, for reports that list differences
    rather than fail (e.g. the resume check comparing final checkpoints:
    ``optimizer.state.3.exp_avg``).
    """
    rtol_ = check_tolerance(rtol, "rtol", "tree_differences")
    atol_ = check_tolerance(atol, "atol", "tree_differences")
    differences: list[tuple[TreePath, str]] = []
    _tree_differences(actual, expected, (), rtol_, atol_, labels, differences)
    return [(render_path("", path, dotted=True).lstrip("."), what) for path, what in differences]
