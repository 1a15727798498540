"""Assertions about values: every tensor finite, a tensor's shape, dtype and device.

Example::

    out = model(x)
    assert_finite({"logits": out, "loss": loss}, name="step")
    assert_tensor_meta(out, shape=(None, 10), dtype=torch.float32, name="logits")
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from trainguard._internal.tensors import leaves, render_path, unravel_index
from trainguard.errors import UsageError
from trainguard.unit.support import fail, type_name

__all__ = ["assert_finite", "assert_tensor_meta"]


def _as_tensor(leaf: Any) -> torch.Tensor | None:
    if isinstance(leaf, torch.Tensor):
        return leaf
    if isinstance(leaf, (int, float)) and not isinstance(leaf, bool):
        return torch.tensor(leaf)
    if type(leaf).__module__ == "numpy" and hasattr(leaf, "dtype"):
        try:
            return torch.as_tensor(leaf)
        except (TypeError, RuntimeError):
            return None
    return None


def _nonfinite_summary(t: torch.Tensor) -> str | None:
    if not (t.is_floating_point() or t.is_complex()) or t.device.type == "meta":
        return None
    t = t.detach()
    finite = torch.isfinite(t)
    if bool(finite.all()):
        return None
    bad = ~finite
    first = int(bad.flatten().nonzero()[0].item())
    index = unravel_index(first, t.shape)
    if t.is_complex():
        counts = f"{int(bad.sum())} non-finite"
    else:
        counts = (
            f"{int(torch.isnan(t).sum())} nan, {int(torch.isposinf(t).sum())} +inf, "
            f"{int(torch.isneginf(t).sum())} -inf"
        )
    value = t.flatten()[first].item()
    return (
        f"{counts} of {t.numel()} elements (shape {tuple(t.shape)}, dtype {t.dtype}); first "
        f"non-finite element at index {index} = {value}"
    )


def assert_finite(value: Any, name: str = "output") -> None:
    """Assert every tensor in ``value`` is free of nan and inf.

    ``value`` may be a tensor, a Python or NumPy number, or a (nested) dict/list/tuple,
    namedtuple or dataclass of them. The message names the first offending entry by its path
    (``output['logits'][1]``), counts its nan/+inf/-inf and gives the index of the first bad
    element; other offending entries are listed after it.

    Example::

        out = model(x)
        assert_finite({"logits": out, "loss": loss}, name="step")
    """
    found = 0
    offenders: list[tuple[str, str]] = []
    for path, leaf in leaves(value):
        tensor = _as_tensor(leaf)
        if tensor is None:
            continue
        found += 1
        summary = _nonfinite_summary(tensor)
        if summary is not None:
            offenders.append((render_path(name, path), summary))
    if not found:
        raise UsageError(
            f"assert_finite found no tensor or number in {name} "
            f"(type={type_name(value)}); pass a tensor or a nested dict/list/tuple of tensors"
        )
    if offenders:
        (first_path, first_summary), rest = offenders[0], offenders[1:]
        lines = [f"assert_finite: {first_path} is not finite: {first_summary}"]
        if rest:
            lines.append("also not finite: " + "; ".join(f"{p} ({s})" for p, s in rest))
        lines.append(
            "Usual causes: log/sqrt of values <= 0, division by ~0, exp/softmax overflow "
            "(compute in float32 or subtract the max), a too-high learning rate; "
            "torch.autograd.set_detect_anomaly(True) names the op that made the first nan in "
            "backward"
        )
        fail("\n".join(lines))


def _check_shape_spec(shape: object) -> tuple[int | None, ...]:
    ok = isinstance(shape, (tuple, list, torch.Size)) and all(
        dim is None or (isinstance(dim, int) and not isinstance(dim, bool) and dim >= -1)
        for dim in shape
    )
    if not ok:
        raise UsageError(
            "Expected a tuple of ints (None or -1 for any size) for shape, "
            f"got shape={shape!r} (type={type_name(shape)})"
        )
    return tuple(shape)  # type: ignore[arg-type]


def assert_tensor_meta(
    t: Any,
    *,
    shape: Sequence[int | None] | None = None,
    dtype: torch.dtype | None = None,
    device: str | torch.device | None = None,
    name: str = "tensor",
) -> None:
    """Assert a tensor's shape, dtype and device.

    In ``shape``, ``None`` or ``-1`` matches any size. ``device`` matches by type (``"cuda"``
    matches every GPU); give an index (``"cuda:1"``) to require that one. All mismatches are
    reported together.

    Example::

        assert_tensor_meta(logits, shape=(None, 10), dtype=torch.float32, device="cpu",
                           name="logits")
    """
    expected_shape = None if shape is None else _check_shape_spec(shape)
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise UsageError(
            f"Expected a torch.dtype for dtype, got dtype={dtype!r} (type={type_name(dtype)})"
        )
    expected_device = None
    if device is not None:
        try:
            expected_device = torch.device(device)
        except (RuntimeError, TypeError) as exc:
            raise UsageError(
                f"Expected a torch.device or a device string like 'cuda:0' for device, "
                f"got device={device!r} (type={type_name(device)})"
            ) from exc
    if not isinstance(t, torch.Tensor):
        fail(f"assert_tensor_meta: {name} is a {type_name(t)}, not a torch.Tensor")
    problems = []
    if expected_shape is not None:
        actual = tuple(t.shape)
        matches = len(actual) == len(expected_shape) and all(
            want in (None, -1) or want == got for want, got in zip(expected_shape, actual)
        )
        if not matches:
            spec = ", ".join("*" if d in (None, -1) else str(d) for d in expected_shape)
            spec = f"({spec},)" if len(expected_shape) == 1 else f"({spec})"
            problems.append(f"shape {actual}, expected {spec} (* = any size)")
    if dtype is not None and t.dtype != dtype:
        problems.append(f"dtype {t.dtype}, expected {dtype}")
    if expected_device is not None and (
        t.device.type != expected_device.type
        or (expected_device.index is not None and t.device.index != expected_device.index)
    ):
        problems.append(f"device {t.device}, expected {expected_device}")
    if problems:
        fail(f"assert_tensor_meta: {name} has " + "; ".join(problems))
