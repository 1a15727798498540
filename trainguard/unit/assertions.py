"""Unit-test assertions for training code: finiteness, gradient flow, batch independence, ...

Each assertion raises ``TrainguardAssertionError`` (an ``AssertionError``, so pytest reports a test
failure) whose message names the offending parameter, tensor or output, says what the usual causes
are, and ends with how to reproduce (the seed of the last ``seed_everything`` call). Calls that can
never succeed (bad arguments) raise ``UsageError`` instead.

Example::

    seed_everything(0)
    model = Net()
    loss = F.cross_entropy(model(x), y)
    assert_finite(loss, name="loss")
    assert_grads_flow(model, loss)
"""

from __future__ import annotations

import copy as copy_module
import dataclasses
import fnmatch
import inspect
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, NoReturn

import torch

from trainguard.errors import TrainguardAssertionError, UsageError
from trainguard.unit.seeding import current_seed, rng_state, set_rng_state

__all__ = [
    "assert_batch_independent",
    "assert_can_overfit",
    "assert_close_tree",
    "assert_equivalent",
    "assert_finite",
    "assert_grads_flow",
    "assert_loss_connected",
    "assert_step_updates",
    "assert_tensor_meta",
]

# A path element into a nested structure: ("item", key) for mappings, ("index", i) for lists and
# tuples, ("attr", name) for namedtuple and dataclass fields.
_PathElem = tuple[str, Any]
_Path = tuple[_PathElem, ...]

_OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "adam": torch.optim.Adam,
    "adamw": torch.optim.AdamW,
    "sgd": torch.optim.SGD,
}

_BATCHNORM_TYPES: tuple[type[torch.nn.Module], ...] = (
    getattr(torch.nn.modules.batchnorm, "_BatchNorm", torch.nn.BatchNorm1d),
    torch.nn.BatchNorm1d,
    torch.nn.BatchNorm2d,
    torch.nn.BatchNorm3d,
    torch.nn.SyncBatchNorm,
)


# --------------------------------------------------------------------------------------------
# shared helpers


def _reproduce_hint() -> str:
    seed = current_seed()
    if seed is None:
        return (
            "reproduce: no seed was set in this process; call seed_everything(<seed>) (or mark "
            "the test @pytest.mark.seeded(seed=N)) before building the model and inputs so the "
            "failure replays exactly"
        )
    return f"reproduce: seed_everything({seed}) before building the model and inputs, then rerun"


def _fail(message: str) -> NoReturn:
    raise TrainguardAssertionError(f"{message}\n{_reproduce_hint()}")


def _type_name(value: object) -> str:
    return type(value).__name__


def _fmt(x: float) -> str:
    return f"{x:.6g}"


def _is_namedtuple(value: object) -> bool:
    return isinstance(value, tuple) and hasattr(value, "_fields")


def _is_dataclass_instance(value: object) -> bool:
    return dataclasses.is_dataclass(value) and not isinstance(value, type)


def _children(value: Any) -> list[tuple[_PathElem, Any]] | None:
    """The children of a container (with their path elements), or None for a leaf."""
    if isinstance(value, torch.Tensor):
        return None
    if isinstance(value, Mapping):
        return [(("item", key), child) for key, child in value.items()]
    if _is_namedtuple(value):
        return [(("attr", key), getattr(value, key)) for key in value._fields]
    if _is_dataclass_instance(value):
        return [(("attr", f.name), getattr(value, f.name)) for f in dataclasses.fields(value)]
    if isinstance(value, (list, tuple)):
        return [(("index", i), child) for i, child in enumerate(value)]
    return None


def _leaves(value: Any, path: _Path = ()) -> Iterator[tuple[_Path, Any]]:
    children = _children(value)
    if children is None:
        yield path, value
        return
    for elem, child in children:
        yield from _leaves(child, (*path, elem))


def _map_tensors(value: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """Rebuild a nested structure with every tensor replaced by ``fn(tensor)``."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, Mapping):
        items = {key: _map_tensors(child, fn) for key, child in value.items()}
        try:
            return type(value)(items)  # type: ignore[call-arg]
        except TypeError:
            return items
    if _is_namedtuple(value):
        return type(value)(*(_map_tensors(child, fn) for child in value))
    if _is_dataclass_instance(value):
        changes = {
            f.name: _map_tensors(getattr(value, f.name), fn) for f in dataclasses.fields(value)
        }
        return dataclasses.replace(value, **changes)
    if isinstance(value, (list, tuple)):
        return type(value)(_map_tensors(child, fn) for child in value)
    return value


def _render_path(name: str, path: _Path, *, dotted: bool = False) -> str:
    """``name['logits'][1]`` (Python style), or ``name.logits.1`` (state_dict style)."""
    parts = [name]
    for kind, key in path:
        if kind == "attr" or dotted:
            parts.append(f".{key}")
        elif kind == "item":
            parts.append(f"[{key!r}]")
        else:
            parts.append(f"[{key}]")
    return "".join(parts)


def _unravel(flat_index: int, shape: Sequence[int]) -> tuple[int, ...]:
    index = []
    for size in reversed(shape):
        index.append(flat_index % size)
        flat_index //= size
    return tuple(reversed(index))


def _patterns(value: str | Iterable[str], argname: str) -> tuple[str, ...]:
    # A bare string would otherwise be iterated character by character.
    if isinstance(value, str):
        return (value,)
    patterns = tuple(value)
    for pattern in patterns:
        if not isinstance(pattern, str):
            raise UsageError(
                f"Expected names or fnmatch patterns (str) for {argname}, "
                f"got {pattern!r} (type={_type_name(pattern)})"
            )
    return patterns


def _matching(names: Iterable[str], patterns: tuple[str, ...], argname: str) -> set[str]:
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


def _check_tolerance(value: object, argname: str, caller: str) -> float:
    if value is None:
        raise UsageError(
            f"{caller} needs explicit tolerances: pass rtol= and atol= (for example rtol=1.3e-6, "
            "atol=1e-5 for float32, rtol=0, atol=0 for bitwise equality); no default is safe "
            "across dtypes and kernels"
        )
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise UsageError(
            f"Expected a non-negative float for {argname}, got {argname}={value!r} "
            f"(type={_type_name(value)})"
        )
    return float(value)


def _check_model(model: object, argname: str = "model") -> torch.nn.Module:
    if not isinstance(model, torch.nn.Module):
        raise UsageError(
            f"Expected a torch.nn.Module for {argname}, got {argname}={model!r:.60} "
            f"(type={_type_name(model)})"
        )
    return model


def _check_loss(loss: object, caller: str) -> torch.Tensor:
    """A loss must be a one-element tensor attached to the autograd graph."""
    if not isinstance(loss, torch.Tensor):
        how = (
            " (a Python number: the tensor went through .item()/.tolist()/float(), which leaves "
            "autograd)"
            if isinstance(loss, (int, float))
            else ""
        )
        _fail(f"{caller}: the loss is a {_type_name(loss)}, not a torch.Tensor{how}")
    if loss.numel() != 1:
        _fail(
            f"{caller}: the loss has shape {tuple(loss.shape)}, expected a scalar: reduce it "
            "(loss.mean() or loss.sum(), or reduction='mean' in the loss function) before "
            "backward"
        )
    if not loss.requires_grad:
        _fail(
            f"{caller}: the loss does not require grad (requires_grad=False, grad_fn=None), so "
            "backward cannot reach any parameter: it was computed under torch.no_grad() or "
            "torch.inference_mode(), from detach()ed outputs, or rebuilt from a Python number "
            "(torch.tensor(loss.item())); compute it from the model outputs inside autograd"
        )
    return loss


def _call_model(model: Callable[..., Any], inputs: Any) -> Any:
    if isinstance(inputs, Mapping):
        return model(**inputs)
    if isinstance(inputs, (list, tuple)) and not _is_namedtuple(inputs):
        return model(*inputs)
    return model(inputs)


# --------------------------------------------------------------------------------------------
# assert_finite, assert_tensor_meta


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
    index = _unravel(first, t.shape)
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
    for path, leaf in _leaves(value):
        tensor = _as_tensor(leaf)
        if tensor is None:
            continue
        found += 1
        summary = _nonfinite_summary(tensor)
        if summary is not None:
            offenders.append((_render_path(name, path), summary))
    if not found:
        raise UsageError(
            f"assert_finite found no tensor or number in {name} "
            f"(type={_type_name(value)}); pass a tensor or a nested dict/list/tuple of tensors"
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
        _fail("\n".join(lines))


def _check_shape_spec(shape: object) -> tuple[int | None, ...]:
    ok = isinstance(shape, (tuple, list, torch.Size)) and all(
        dim is None or (isinstance(dim, int) and not isinstance(dim, bool) and dim >= -1)
        for dim in shape
    )
    if not ok:
        raise UsageError(
            "Expected a tuple of ints (None or -1 for any size) for shape, "
            f"got shape={shape!r} (type={_type_name(shape)})"
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
            f"Expected a torch.dtype for dtype, got dtype={dtype!r} (type={_type_name(dtype)})"
        )
    expected_device = None
    if device is not None:
        try:
            expected_device = torch.device(device)
        except (RuntimeError, TypeError) as exc:
            raise UsageError(
                f"Expected a torch.device or a device string like 'cuda:0' for device, "
                f"got device={device!r} (type={_type_name(device)})"
            ) from exc
    if not isinstance(t, torch.Tensor):
        _fail(f"assert_tensor_meta: {name} is a {_type_name(t)}, not a torch.Tensor")
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
        _fail(f"assert_tensor_meta: {name} has " + "; ".join(problems))


# --------------------------------------------------------------------------------------------
# gradients


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
    _check_model(model)
    tolerance = _check_tolerance(atol, "atol", "assert_grads_flow")
    named = dict(model.named_parameters())
    exempt = _matching(named, _patterns(allow_unused, "allow_unused"), "allow_unused")
    trainable = {name: p for name, p in named.items() if p.requires_grad}
    if not trainable:
        _fail(
            f"assert_grads_flow: {_type_name(model)} has no parameter with requires_grad=True "
            f"({len(named)} parameters, all frozen); nothing can learn"
        )
    if loss is not None:
        _check_loss(loss, "assert_grads_flow")
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
        f"{_type_name(model)} get no usable gradient"
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
        lines += [f"  - {name} (max |grad| {_fmt(magnitudes[name])})" for name in zero]
    if nonfinite:
        lines.append(
            "grad is not finite (nan/inf: check the loss and activations with assert_finite):"
        )
        lines += [f"  - {name}" for name in nonfinite]
    lines.append(
        "If a parameter is unused on purpose, exempt it: allow_unused=['<name or pattern>']."
    )
    _fail("\n".join(lines))


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
    loss = _check_loss(loss, "assert_loss_connected")
    entries = [(path, leaf) for path, leaf in _leaves(outputs) if isinstance(leaf, torch.Tensor)]
    if not entries:
        raise UsageError(
            f"assert_loss_connected found no tensor in outputs (type={_type_name(outputs)}); "
            "pass the model outputs the loss is computed from"
        )
    problems: list[str] = []
    differentiable = []
    for path, tensor in entries:
        where = _render_path("outputs", path)
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
        _fail(
            f"assert_loss_connected: the loss is disconnected from {len(problems)} of "
            f"{len(entries)} outputs:\n" + "\n".join(f"  - {p}" for p in problems)
        )


# --------------------------------------------------------------------------------------------
# batch independence


def _batch_mixing_norms(model: torch.nn.Module) -> tuple[list[str], list[str]]:
    """(layers that mix the batch in train mode, layers that always do)."""
    in_train: list[str] = []
    always: list[str] = []
    for name, module in model.named_modules():
        if not isinstance(module, _BATCHNORM_TYPES):
            continue
        label = f"{name or '<model>'} ({_type_name(module)})"
        # Without running stats, batch norm normalizes with batch statistics even in eval mode.
        if getattr(module, "running_mean", None) is None:
            always.append(label)
        elif module.training:
            in_train.append(label)
    return in_train, always


def _sample_magnitudes(t: torch.Tensor, batch_dim: int) -> torch.Tensor:
    """max |t| per sample along ``batch_dim`` (nan counts as +inf)."""
    per_sample = t.detach().abs().movedim(batch_dim, 0)
    per_sample = per_sample.reshape(per_sample.shape[0], -1).to(torch.float64)
    per_sample = torch.nan_to_num(per_sample, nan=math.inf)
    if per_sample.shape[1] == 0:
        return torch.zeros(per_sample.shape[0], dtype=torch.float64)
    return per_sample.amax(dim=1).cpu()


def _perturbed(t: torch.Tensor, sample: int, batch_dim: int, generator: torch.Generator) -> Any:
    """A copy of ``t`` whose sample ``sample`` differs everywhere, within ``t``'s value range."""
    new = t.detach().clone()
    target = new.select(batch_dim, sample)
    if t.dtype == torch.bool:
        target.copy_(~target)
        return new
    if t.is_complex():
        return None
    lo, hi = t.min(), t.max()
    if not t.is_floating_point():
        span = int(hi) - int(lo) + 1
        if span < 2:
            return None
        # A non-zero shift modulo the observed range: every element changes, all stay valid ids.
        shift = torch.randint(1, span, target.shape, generator=generator).to(t.device)
        # in int64: the shifted values may not fit the input dtype (uint8, int8) before the modulo
        target.copy_(((target.long() - int(lo) + shift) % span + int(lo)).to(t.dtype))
        return new
    noise = torch.rand(target.shape, generator=generator, dtype=torch.float64).to(t.device)
    if float(hi) > float(lo):
        target.copy_((lo + noise * (hi - lo)).to(t.dtype))
    else:
        target.add_(1.0)
    return new


def assert_batch_independent(
    model: torch.nn.Module,
    batch: Any,
    *,
    sample: int = 0,
    method: str = "grad",
    batch_dim: int = 0,
    allow_batchnorm_train: bool = False,
    atol: float = 1e-6,
) -> None:
    """Assert no sample's output depends on another sample of the batch.

    ``batch`` is passed as ``model(batch)`` for a tensor, ``model(*batch)`` for a tuple/list and
    ``model(**batch)`` for a dict. Tensors whose size along ``batch_dim`` equals the batch size
    (taken from the first tensor) are treated as batched; others (shared masks, ...) are left
    alone. Output tensors are checked the same way.

    - ``method="grad"``: with the floating-point inputs requiring grad, backpropagates
      ``output[sample].sum()``; the gradient on every other sample must be zero (``<= atol``).
    - ``method="perturb"`` (integer inputs such as token ids, or mixing through
      non-differentiable ops): replaces input ``sample`` with other values from the batch's value
      range and asserts every other sample's output is unchanged (``<= atol``). Both forward
      passes run from the same RNG state, so dropout does not count as a change.

    Batch norm in train mode legitimately mixes the batch: by default such layers fail the check
    with an explanation; ``allow_batchnorm_train=True`` puts them in eval mode for the check. The
    model's train/eval modes and buffers (running statistics) are restored afterwards, the
    caller's tensors are not modified, and no ``.grad`` is left on parameters or inputs.

    Example::

        assert_batch_independent(model, torch.randn(4, 16))
        assert_batch_independent(lm, token_ids, method="perturb", sample=2)
    """
    _check_model(model)
    if method not in ("grad", "perturb"):
        raise UsageError(f"Expected 'grad' or 'perturb' for method, got method={method!r}")
    tolerance = _check_tolerance(atol, "atol", "assert_batch_independent")
    tensors = [(p, t) for p, t in _leaves(batch) if isinstance(t, torch.Tensor)]
    if not tensors:
        raise UsageError(
            f"assert_batch_independent found no tensor in batch (type={_type_name(batch)})"
        )
    first = tensors[0][1]
    if (
        isinstance(batch_dim, bool)
        or not isinstance(batch_dim, int)
        or not (-first.dim() <= batch_dim < first.dim())
    ):
        raise UsageError(
            f"Expected a dimension of the first batch tensor (shape {tuple(first.shape)}) for "
            f"batch_dim, got batch_dim={batch_dim!r}"
        )
    batch_dim %= first.dim()
    size = first.shape[batch_dim]
    if size < 2:
        raise UsageError(
            f"assert_batch_independent needs a batch of at least 2 samples along dim "
            f"{batch_dim}, got shape {tuple(first.shape)}"
        )
    if isinstance(sample, bool) or not isinstance(sample, int) or not 0 <= sample < size:
        raise UsageError(
            f"Expected a sample index in [0, {size}) for sample, got sample={sample!r}"
        )

    def batched(t: torch.Tensor) -> bool:
        return t.dim() > batch_dim and t.shape[batch_dim] == size

    in_train, always = _batch_mixing_norms(model)
    if always:
        _fail(
            "assert_batch_independent: these batch-norm layers have track_running_stats=False, "
            "so they normalize with statistics of the whole batch even in eval mode and every "
            "output depends on every sample by design: " + ", ".join(always) + ". Use "
            "GroupNorm/LayerNorm, or track_running_stats=True and model.eval(), where samples "
            "must stay independent."
        )
    if in_train and not allow_batchnorm_train:
        _fail(
            "assert_batch_independent: these layers are batch norm in train mode, which "
            "normalizes with statistics of the whole batch, so each output legitimately depends "
            "on the other samples: " + ", ".join(in_train) + ". Pass "
            "allow_batchnorm_train=True to check with them in eval mode (restored afterwards), "
            "or call model.eval() first."
        )

    modes = {module: module.training for module in model.modules()}
    buffers = {name: buf.detach().clone() for name, buf in model.named_buffers()}
    try:
        if allow_batchnorm_train:
            for module in model.modules():
                if isinstance(module, _BATCHNORM_TYPES):
                    module.eval()
        if method == "grad":
            leaks, leak_kind = _leaks_by_grad(model, batch, sample, batch_dim, batched, tolerance)
        else:
            leaks, leak_kind = _leaks_by_perturb(
                model, batch, sample, batch_dim, batched, tolerance
            )
    finally:
        for module, training in modes.items():
            module.train(training)
        with torch.no_grad():
            for name, buf in model.named_buffers():
                if name in buffers and buf.shape == buffers[name].shape:
                    buf.copy_(buffers[name])

    if leaks:
        details = ", ".join(
            f"sample {j} via {where} ({_fmt(magnitude)})" for where, j, magnitude in leaks[:8]
        )
        more = f" and {len(leaks) - 8} more" if len(leaks) > 8 else ""
        samples = sorted({j for _, j, _ in leaks})
        if leak_kind == "grad":
            summary = (
                f"the output of sample {sample} depends on input samples {samples} "
                f"(method='grad', batch_dim={batch_dim}): d output[{sample}].sum() / d input "
                f"is non-zero (max |grad| > atol={tolerance}) for {details}{more}"
            )
        else:
            summary = (
                f"changing input sample {sample} changed the outputs of samples {samples} "
                f"(method='perturb', batch_dim={batch_dim}); max |change| > atol={tolerance} for "
                f"{details}{more}"
            )
        _fail(
            f"assert_batch_independent: {summary}.\nA layer mixes the batch: a reduction over "
            "the batch dimension (x.mean(0), x.sum(0), softmax(dim=0)), a view/reshape/transpose "
            "that moves batch elements into other dimensions, or normalization with batch "
            "statistics."
        )


def _leaks_by_grad(
    model: torch.nn.Module,
    batch: Any,
    sample: int,
    batch_dim: int,
    batched: Callable[[torch.Tensor], bool],
    tolerance: float,
) -> tuple[list[tuple[str, int, float]], str]:
    def prepare(t: torch.Tensor) -> torch.Tensor:
        if batched(t) and t.is_floating_point():
            return t.detach().clone().requires_grad_(True)
        return t

    prepared = _map_tensors(batch, prepare)
    inputs = [
        (_render_path("input", path), t)
        for path, t in _leaves(prepared)
        if isinstance(t, torch.Tensor) and t.requires_grad
    ]
    if not inputs:
        raise UsageError(
            "assert_batch_independent(method='grad') needs a floating-point batched input to "
            "differentiate; for integer inputs such as token ids use method='perturb'"
        )
    outputs = _call_model(model, prepared)
    selected = [
        t.select(batch_dim, sample).sum()
        for _, t in _leaves(outputs)
        if isinstance(t, torch.Tensor) and batched(t) and t.requires_grad
    ]
    if not selected:
        raise UsageError(
            "assert_batch_independent(method='grad') found no model output with the batch size "
            "along batch_dim that requires grad; check batch_dim, or use method='perturb'"
        )
    target = torch.stack([s.real if s.is_complex() else s for s in selected]).sum()
    # autograd.grad, not backward(): nothing is accumulated into the parameters' .grad.
    grads = torch.autograd.grad(target, [t for _, t in inputs], allow_unused=True)
    leaks = []
    for (where, _), grad in zip(inputs, grads):
        if grad is None:
            continue
        for j, magnitude in enumerate(_sample_magnitudes(grad, batch_dim).tolist()):
            if j != sample and not magnitude <= tolerance:
                leaks.append((where, j, magnitude))
    return leaks, "grad"


def _leaks_by_perturb(
    model: torch.nn.Module,
    batch: Any,
    sample: int,
    batch_dim: int,
    batched: Callable[[torch.Tensor], bool],
    tolerance: float,
) -> tuple[list[tuple[str, int, float]], str]:
    generator = torch.Generator().manual_seed(0)
    changed = []

    def perturb(t: torch.Tensor) -> torch.Tensor:
        if not batched(t):
            return t
        new = _perturbed(t, sample, batch_dim, generator)
        if new is None:
            return t
        changed.append(t)
        return new

    perturbed = _map_tensors(batch, perturb)
    if not changed:
        raise UsageError(
            "assert_batch_independent(method='perturb') could not perturb any batched input: "
            "every batched tensor holds a single value (or is complex); pass a batch with varied "
            "values"
        )
    # Both passes start from the same RNG state (dropout masks match), and the caller's RNG is
    # left as it was.
    saved = rng_state()
    try:
        with torch.no_grad():
            reference = _call_model(model, batch)
            set_rng_state(saved)
            moved = _call_model(model, perturbed)
    finally:
        set_rng_state(saved)
    leaks = []
    pairs = zip(_leaves(reference), _leaves(moved))
    compared = 0
    for (path, ref), (_, out) in pairs:
        if not (isinstance(ref, torch.Tensor) and isinstance(out, torch.Tensor) and batched(ref)):
            continue
        compared += 1
        ref64 = ref.detach().to(torch.complex128 if ref.is_complex() else torch.float64)
        out64 = out.detach().to(ref64.dtype)
        diff = (out64 - ref64).abs()
        diff = torch.where(torch.isnan(ref64) & torch.isnan(out64), 0.0, diff)
        where = _render_path("output", path)
        for j, magnitude in enumerate(_sample_magnitudes(diff, batch_dim).tolist()):
            if j != sample and not magnitude <= tolerance:
                leaks.append((where, j, magnitude))
    if not compared:
        raise UsageError(
            "assert_batch_independent(method='perturb') found no model output with the batch "
            "size along batch_dim; check batch_dim"
        )
    return leaks, "perturb"


# --------------------------------------------------------------------------------------------
# training behaviour


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
                f"the optimizer factory returned {_type_name(built)}, expected a "
                "torch.optim.Optimizer"
            )
        return built
    raise UsageError(
        f"Expected a name like 'adam' or a callable for optimizer, got optimizer={optimizer!r} "
        f"(type={_type_name(optimizer)})"
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
    _check_model(model)
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise UsageError(f"Expected a positive int for steps, got steps={steps!r}")
    lr = _check_tolerance(lr, "lr", "assert_can_overfit")
    if not 0 < min_relative_drop <= 1:
        raise UsageError(
            f"Expected a float in (0, 1] for min_relative_drop, got "
            f"min_relative_drop={min_relative_drop!r}"
        )
    if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
        raise UsageError(
            f"Expected (inputs, targets) for batch, got batch of type {_type_name(batch)}"
            + (f" with {len(batch)} items" if isinstance(batch, (tuple, list)) else "")
        )
    inputs, targets = batch
    trained = copy_module.deepcopy(model) if copy else model
    params = [p for p in trained.parameters() if p.requires_grad]
    if not params:
        _fail(
            f"assert_can_overfit: {_type_name(model)} has no parameter with requires_grad=True; "
            "every parameter is frozen, so the loss cannot fall"
        )
    opt = _make_optimizer(optimizer, params, lr)
    opt_label = (
        f"optimizer {optimizer!r}, lr={lr}"
        if isinstance(optimizer, str)
        else f"optimizer {_type_name(opt)} from the factory"
    )
    total = sum(1 for _ in trained.parameters())
    opt_label += f", {len(params)} of {total} parameter tensors trainable"

    def compute_loss() -> torch.Tensor:
        loss = loss_fn(_call_model(trained, inputs), targets)
        return _check_loss(loss, "assert_can_overfit")

    losses: list[float] = []
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = compute_loss()
        value = float(loss.detach())
        losses.append(value)
        if not math.isfinite(value):
            _fail(
                f"assert_can_overfit: the loss became {value} at step {step} of {steps} "
                f"({opt_label}); losses so far: {[_fmt(v) for v in losses[-5:]]}. Lower the "
                "learning rate, or look for log(0)/division by zero with assert_finite"
            )
        loss.backward()
        opt.step()
    with torch.no_grad():
        losses.append(float(loss_fn(_call_model(trained, inputs), targets).detach()))

    initial, final = losses[0], losses[-1]
    if max_final_loss is not None:
        passed = final <= max_final_loss
        criterion = f"required: final loss <= {max_final_loss}"
    else:
        if initial <= 0:
            raise UsageError(
                f"assert_can_overfit: the initial loss is {_fmt(initial)} <= 0, so a relative "
                "drop is meaningless; pass max_final_loss= instead"
            )
        passed = math.isfinite(final) and final <= (1 - min_relative_drop) * initial
        criterion = f"required: a drop of {min_relative_drop:.0%}"
    if passed:
        return losses
    drop = (initial - final) / initial if initial else 0.0
    every = max(1, steps // 10)
    trace = ", ".join(f"{i}: {_fmt(losses[i])}" for i in [*range(0, steps, every), steps])
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
    _fail(
        f"assert_can_overfit: {_type_name(model)} did not overfit one batch in {steps} steps "
        f"({opt_label}): loss {_fmt(initial)} -> {_fmt(final)}, a drop of {drop:.1%} "
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
    _check_model(model)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise UsageError(
            f"Expected a torch.optim.Optimizer for optimizer, got {_type_name(optimizer)}"
        )
    if not callable(loss_fn_or_closure):
        raise UsageError(
            "Expected a closure () -> loss or a function (model) -> loss for "
            f"loss_fn_or_closure, got {_type_name(loss_fn_or_closure)}"
        )
    tolerance = _check_tolerance(atol, "atol", "assert_step_updates")
    named = dict(model.named_parameters())
    frozen_by_pattern = _matching(named, _patterns(expect_frozen, "expect_frozen"), "expect_frozen")
    before = {name: p.detach().clone() for name, p in named.items()}

    optimizer.zero_grad(set_to_none=True)
    loss = _check_loss(_call_loss_fn(loss_fn_or_closure, model), "assert_step_updates")
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
                    f"  - {name}: changed by {_fmt(change)} though requires_grad=False (something "
                    "updates it outside autograd: an in-place write, or an optimizer that "
                    "applies weight decay or momentum to it regardless)"
                )
        elif name in frozen_by_pattern:
            if change > tolerance:
                moved.append(
                    f"  - {name}: changed by {_fmt(change)} though listed in expect_frozen; it "
                    "still has requires_grad=True and is in the optimizer (call "
                    "requires_grad_(False) or leave it out of the optimizer)"
                )
        elif not change > tolerance:
            stuck.append(f"  - {name}: {_why_not_updated(param, optimizer, tolerance)}")
    if stuck or moved:
        lines = [
            f"assert_step_updates: one optimizer step of {_type_name(optimizer)} on {_type_name(model)}"
        ]
        if stuck:
            lines.append(f"left {len(stuck)} trainable parameters unchanged:")
            lines += stuck
        if moved:
            lines.append(f"changed {len(moved)} parameters that should stay frozen:")
            lines += moved
        _fail("\n".join(lines))
    return changes


# --------------------------------------------------------------------------------------------
# equivalence


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
        return f"index {_unravel(i, shape)} ({a_name} {_fmt(a[i].item().real)}, {b_name} {_fmt(e[i].item().real)})"

    return (
        f"{int(bad.sum())} of {a.numel()} elements differ; max abs diff {_fmt(float(diff[i_abs]))} "
        f"at {at(i_abs)}; max rel diff {_fmt(float(rel[i_rel]))} at {at(i_rel)}"
    )


def _tree_differences(
    actual: Any,
    expected: Any,
    path: _Path,
    rtol: float,
    atol: float,
    labels: tuple[str, str],
    out: list[tuple[_Path, str]],
) -> int:
    """Append (path, description) for every differing entry; return how many leaves compared."""
    a_name, b_name = labels
    if isinstance(actual, torch.Tensor) or isinstance(expected, torch.Tensor):
        if not (isinstance(actual, torch.Tensor) and isinstance(expected, torch.Tensor)):
            out.append(
                (path, f"{_type_name(actual)} ({a_name}) vs {_type_name(expected)} ({b_name})")
            )
            return 1
        problem = _tensor_difference(actual, expected, rtol, atol, labels)
        if problem is not None:
            out.append((path, problem))
        return 1
    a_children, e_children = _children(actual), _children(expected)
    if a_children is not None and e_children is not None:
        if isinstance(actual, Mapping) != isinstance(expected, Mapping):
            out.append(
                (path, f"{_type_name(actual)} ({a_name}) vs {_type_name(expected)} ({b_name})")
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
        out.append((path, f"{_type_name(actual)} ({a_name}) vs {_type_name(expected)} ({b_name})"))
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
                (path, f"{actual!r} ({a_name}) != {expected!r} ({b_name}), abs diff {_fmt(diff)}")
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
    differences: list[tuple[_Path, str]] = []
    compared = _tree_differences(actual, expected, (), rtol, atol, labels, differences)
    if not differences:
        return None
    lines = [
        f"{len(differences)} of {compared} entries differ (rtol={rtol}, atol={atol}):",
        *(f"  {_render_path(name, path, dotted=True)}: {what}" for path, what in differences),
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
    rtol_ = _check_tolerance(rtol, "rtol", "assert_close_tree")
    atol_ = _check_tolerance(atol, "atol", "assert_close_tree")
    message = _close_tree_message(actual, expected, rtol_, atol_, name, ("actual", "expected"))
    if message is not None:
        _fail(f"assert_close_tree: {name} differs from the expected value; {message}")


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
    rtol_ = _check_tolerance(rtol, "rtol", "assert_equivalent")
    atol_ = _check_tolerance(atol, "atol", "assert_equivalent")
    if not (
        isinstance(names, (tuple, list))
        and len(names) == 2
        and all(isinstance(n, str) for n in names)
    ):
        raise UsageError(f"Expected two strings for names, got names={names!r}")
    if not (callable(fn_a) and callable(fn_b)):
        raise UsageError(
            f"Expected two callables for fn_a and fn_b, got {_type_name(fn_a)} and "
            f"{_type_name(fn_b)}"
        )
    saved = rng_state()
    out_a = fn_a(*args, **kwargs)
    set_rng_state(saved)
    out_b = fn_b(*args, **kwargs)
    labels = (str(names[0]), str(names[1]))
    message = _close_tree_message(out_a, out_b, rtol_, atol_, "output", labels)
    if message is not None:
        _fail(f"assert_equivalent: {labels[0]} and {labels[1]} disagree; {message}")


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
    rather than fail (e.g. the resume check comparing final checkpoints: ``optimizer.state.3.exp_avg``).
    """
    rtol_ = _check_tolerance(rtol, "rtol", "tree_differences")
    atol_ = _check_tolerance(atol, "atol", "tree_differences")
    differences: list[tuple[_Path, str]] = []
    _tree_differences(actual, expected, (), rtol_, atol_, labels, differences)
    return [(_render_path("", path, dotted=True).lstrip("."), what) for path, what in differences]
