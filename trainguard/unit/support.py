"""What the unit assertions share: argument checks, calling a model on a batch, failure messages.

Argument checks (``check_tolerance``, ``check_model``, name patterns) raise ``UsageError``: the
call can never succeed. ``check_loss`` and ``fail`` raise ``TrainguardAssertionError`` (an
``AssertionError``), whose message ends with how to reproduce: the seed of the last
``seed_everything`` call.

Example::

    rtol = check_tolerance(rtol, "rtol", "assert_my_property")
    outputs = call_model(model, batch)
    loss = check_loss(loss_fn(outputs), "assert_my_property")
    if bad:
        fail("assert_my_property: ...")
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterable, Mapping
from typing import Any, NoReturn

import torch

from trainguard._internal.tensors import is_namedtuple
from trainguard.errors import TrainguardAssertionError, UsageError
from trainguard.unit.seeding import current_seed

__all__ = [
    "call_model",
    "check_loss",
    "check_model",
    "check_tolerance",
    "fail",
    "fmt_number",
    "matching_names",
    "name_patterns",
    "reproduce_hint",
    "type_name",
]


def reproduce_hint() -> str:
    """The last line of a failure message: how to replay it (the seed, or how to set one)."""
    seed = current_seed()
    if seed is None:
        return (
            "reproduce: no seed was set in this process; call seed_everything(<seed>) (or mark "
            "the test @pytest.mark.seeded(seed=N)) before building the model and inputs so the "
            "failure replays exactly"
        )
    return f"reproduce: seed_everything({seed}) before building the model and inputs, then rerun"


def fail(message: str) -> NoReturn:
    """Raise ``TrainguardAssertionError(message)`` with the reproduce hint appended."""
    raise TrainguardAssertionError(f"{message}\n{reproduce_hint()}")


def type_name(value: object) -> str:
    """The name of ``value``'s type, for messages."""
    return type(value).__name__


def fmt_number(x: float) -> str:
    """A float with 6 significant digits, for messages."""
    return f"{x:.6g}"


def name_patterns(value: str | Iterable[str], argname: str) -> tuple[str, ...]:
    """``value`` (one name/fnmatch pattern or several) as a tuple of patterns."""
    # A bare string would otherwise be iterated character by character.
    if isinstance(value, str):
        return (value,)
    patterns = tuple(value)
    for pattern in patterns:
        if not isinstance(pattern, str):
            raise UsageError(
                f"Expected names or fnmatch patterns (str) for {argname}, "
                f"got {pattern!r} (type={type_name(pattern)})"
            )
    return patterns


def matching_names(names: Iterable[str], patterns: tuple[str, ...], argname: str) -> set[str]:
    """Names matched by any pattern; a pattern matching nothing is a typo, so it raises."""
    names = list(names)
    matched: set[str] = set()
    for pattern in patterns:
        hits = {name for name in names if fnmatch.fnmatchcase(name, pattern)}
        if not hits:
            raise UsageError(
                f"{argname} pattern {pattern!r} matches no parameter of the model; parameter "
                f"names look like {names[:3]} (see model.named_parameters())"
            )
        matched |= hits
    return matched


def check_tolerance(value: object, argname: str, caller: str) -> float:
    """``value`` as a non-negative float; ``None`` (no tolerance given) is refused for
    ``caller``."""
    if value is None:
        raise UsageError(
            f"{caller} needs explicit tolerances: pass rtol= and atol= (for example rtol=1.3e-6, "
            "atol=1e-5 for float32, rtol=0, atol=0 for bitwise equality); no default is safe "
            "across dtypes and kernels"
        )
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise UsageError(
            f"Expected a non-negative float for {argname}, got {argname}={value!r} "
            f"(type={type_name(value)})"
        )
    return float(value)


def check_model(model: object, argname: str = "model") -> torch.nn.Module:
    """``model`` if it is a ``torch.nn.Module``; a ``UsageError`` otherwise."""
    if not isinstance(model, torch.nn.Module):
        raise UsageError(
            f"Expected a torch.nn.Module for {argname}, got {argname}={model!r:.60} "
            f"(type={type_name(model)})"
        )
    return model


def check_loss(loss: object, caller: str) -> torch.Tensor:
    """A loss must be a one-element tensor attached to the autograd graph."""
    if not isinstance(loss, torch.Tensor):
        how = (
            " (a Python number: the tensor went through .item()/.tolist()/float(), which leaves "
            "autograd)"
            if isinstance(loss, (int, float))
            else ""
        )
        fail(f"{caller}: the loss is a {type_name(loss)}, not a torch.Tensor{how}")
    if loss.numel() != 1:
        fail(
            f"{caller}: the loss has shape {tuple(loss.shape)}, expected a scalar: reduce it "
            "(loss.mean() or loss.sum(), or reduction='mean' in the loss function) before "
            "backward"
        )
    if not loss.requires_grad:
        fail(
            f"{caller}: the loss does not require grad (requires_grad=False, grad_fn=None), so "
            "backward cannot reach any parameter: it was computed under torch.no_grad() or "
            "torch.inference_mode(), from detach()ed outputs, or rebuilt from a Python number "
            "(torch.tensor(loss.item())); compute it from the model outputs inside autograd"
        )
    return loss


def call_model(model: Callable[..., Any], inputs: Any) -> Any:
    """``model(**inputs)`` for a mapping, ``model(*inputs)`` for a list/tuple, else
    ``model(inputs)``."""
    if isinstance(inputs, Mapping):
        return model(**inputs)
    if isinstance(inputs, (list, tuple)) and not is_namedtuple(inputs):
        return model(*inputs)
    return model(inputs)
