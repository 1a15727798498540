"""Batch independence: no sample's output may depend on another sample of the batch.

Checked by gradients (``method="grad"``: d output[i] / d input[j] must be zero) or by
perturbation (``method="perturb"``: changing input i must leave every other output unchanged);
batch norm in train mode, which mixes the batch by design, is named rather than reported as a
leak.

Example::

    assert_batch_independent(model, torch.randn(4, 16))
    assert_batch_independent(lm, token_ids, method="perturb", sample=2)
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch

from trainguard._internal.tensors import leaves, map_tensors, render_path
from trainguard.errors import UsageError
from trainguard.unit.seeding import rng_state, set_rng_state
from trainguard.unit.support import (
    call_model,
    check_model,
    check_tolerance,
    fail,
    fmt_number,
    type_name,
)

__all__ = ["assert_batch_independent"]


_BATCHNORM_TYPES: tuple[type[torch.nn.Module], ...] = (
    getattr(torch.nn.modules.batchnorm, "_BatchNorm", torch.nn.BatchNorm1d),
    torch.nn.BatchNorm1d,
    torch.nn.BatchNorm2d,
    torch.nn.BatchNorm3d,
    torch.nn.SyncBatchNorm,
)


def _batch_mixing_norms(model: torch.nn.Module) -> tuple[list[str], list[str]]:
    """(layers that mix the batch in train mode, layers that always do)."""
    in_train: list[str] = []
    always: list[str] = []
    for name, module in model.named_modules():
        if not isinstance(module, _BATCHNORM_TYPES):
            continue
        label = f"{name or '<model>'} ({type_name(module)})"
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
    check_model(model)
    if method not in ("grad", "perturb"):
        raise UsageError(f"Expected 'grad' or 'perturb' for method, got method={method!r}")
    tolerance = check_tolerance(atol, "atol", "assert_batch_independent")
    batch_dim, size = _batch_dim_and_size(batch, batch_dim)
    if isinstance(sample, bool) or not isinstance(sample, int) or not 0 <= sample < size:
        raise UsageError(
            f"Expected a sample index in [0, {size}) for sample, got sample={sample!r}"
        )

    def batched(t: torch.Tensor) -> bool:
        return t.dim() > batch_dim and t.shape[batch_dim] == size

    _refuse_batch_norms(model, allow_batchnorm_train)
    find_leaks = _leaks_by_grad if method == "grad" else _leaks_by_perturb
    with _modes_and_buffers_restored(model):
        if allow_batchnorm_train:
            for module in model.modules():
                if isinstance(module, _BATCHNORM_TYPES):
                    module.eval()
        leaks, leak_kind = find_leaks(model, batch, sample, batch_dim, batched, tolerance)
    if leaks:
        summary = _leak_summary(leaks, leak_kind, sample, batch_dim, tolerance)
        fail(
            f"assert_batch_independent: {summary}.\nA layer mixes the batch: a reduction over "
            "the batch dimension (x.mean(0), x.sum(0), softmax(dim=0)), a view/reshape/transpose "
            "that moves batch elements into other dimensions, or normalization with batch "
            "statistics."
        )


def _batch_dim_and_size(batch: Any, batch_dim: Any) -> tuple[int, int]:
    """``batch_dim`` made non-negative, and the batch size along it: both read from the first
    tensor of ``batch``, which must hold at least 2 samples."""
    tensors = [(p, t) for p, t in leaves(batch) if isinstance(t, torch.Tensor)]
    if not tensors:
        raise UsageError(
            f"assert_batch_independent found no tensor in batch (type={type_name(batch)})"
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
    return batch_dim, size


def _refuse_batch_norms(model: torch.nn.Module, allow_batchnorm_train: bool) -> None:
    """Fail, saying why, on batch-norm layers that mix the batch by design: those without
    running statistics always, those in train mode unless ``allow_batchnorm_train``."""
    in_train, always = _batch_mixing_norms(model)
    if always:
        fail(
            "assert_batch_independent: these batch-norm layers have track_running_stats=False, "
            "so they normalize with statistics of the whole batch even in eval mode and every "
            "output depends on every sample by design: " + ", ".join(always) + ". Use "
            "GroupNorm/LayerNorm, or track_running_stats=True and model.eval(), where samples "
            "must stay independent."
        )
    if in_train and not allow_batchnorm_train:
        fail(
            "assert_batch_independent: these layers are batch norm in train mode, which "
            "normalizes with statistics of the whole batch, so each output legitimately depends "
            "on the other samples: " + ", ".join(in_train) + ". Pass "
            "allow_batchnorm_train=True to check with them in eval mode (restored afterwards), "
            "or call model.eval() first."
        )


@contextlib.contextmanager
def _modes_and_buffers_restored(model: torch.nn.Module) -> Iterator[None]:
    """Put back each module's train/eval mode and the buffers' values (running statistics)
    as they were on entry."""
    modes = {module: module.training for module in model.modules()}
    buffers = {name: buf.detach().clone() for name, buf in model.named_buffers()}
    try:
        yield
    finally:
        for module, training in modes.items():
            module.train(training)
        with torch.no_grad():
            for name, buf in model.named_buffers():
                if name in buffers and buf.shape == buffers[name].shape:
                    buf.copy_(buffers[name])


def _leak_summary(
    leaks: list[tuple[str, int, float]], leak_kind: str, sample: int, batch_dim: int, tolerance: float
) -> str:
    """What the leaks found show, in words: the samples reached and the first 8 paths."""
    details = ", ".join(
        f"sample {j} via {where} ({fmt_number(magnitude)})" for where, j, magnitude in leaks[:8]
    )
    more = f" and {len(leaks) - 8} more" if len(leaks) > 8 else ""
    samples = sorted({j for _, j, _ in leaks})
    if leak_kind == "grad":
        return (
            f"the output of sample {sample} depends on input samples {samples} "
            f"(method='grad', batch_dim={batch_dim}): d output[{sample}].sum() / d input "
            f"is non-zero (max |grad| > atol={tolerance}) for {details}{more}"
        )
    return (
        f"changing input sample {sample} changed the outputs of samples {samples} "
        f"(method='perturb', batch_dim={batch_dim}); max |change| > atol={tolerance} for "
        f"{details}{more}"
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

    prepared = map_tensors(batch, prepare)
    inputs = [
        (render_path("input", path), t)
        for path, t in leaves(prepared)
        if isinstance(t, torch.Tensor) and t.requires_grad
    ]
    if not inputs:
        raise UsageError(
            "assert_batch_independent(method='grad') needs a floating-point batched input to "
            "differentiate; for integer inputs such as token ids use method='perturb'"
        )
    outputs = call_model(model, prepared)
    selected = [
        t.select(batch_dim, sample).sum()
        for _, t in leaves(outputs)
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

    perturbed = map_tensors(batch, perturb)
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
            reference = call_model(model, batch)
            set_rng_state(saved)
            moved = call_model(model, perturbed)
    finally:
        set_rng_state(saved)
    leaks = []
    pairs = zip(leaves(reference), leaves(moved))
    compared = 0
    for (path, ref), (_, out) in pairs:
        if not (isinstance(ref, torch.Tensor) and isinstance(out, torch.Tensor) and batched(ref)):
            continue
        compared += 1
        ref64 = ref.detach().to(torch.complex128 if ref.is_complex() else torch.float64)
        out64 = out.detach().to(ref64.dtype)
        diff = (out64 - ref64).abs()
        diff = torch.where(torch.isnan(ref64) & torch.isnan(out64), 0.0, diff)
        where = render_path("output", path)
        for j, magnitude in enumerate(_sample_magnitudes(diff, batch_dim).tolist()):
            if j != sample and not magnitude <= tolerance:
                leaks.append((where, j, magnitude))
    if not compared:
        raise UsageError(
            "assert_batch_independent(method='perturb') found no model output with the batch "
            "size along batch_dim; check batch_dim"
        )
    return leaks, "perturb"
