"""DDP gradient equivalence: do the ranks compute the gradient one process would?

``ddp_gradient_diff`` / ``assert_ddp_gradients_match`` run inside a process group
(``@pytest.mark.ddp(world_size=2)``) and compare, parameter by parameter, the gradients after the
cross-rank sync (torch DDP, or the user's own all-reduce code) with the gradients of the same
model on the whole global batch in a single process. A sync that sums instead of averaging gives
``world_size`` times the gradient; Adam normalizes that away, so the loss curve looks fine while
SGD, gradient clipping and weight decay silently change.

Example::

    @pytest.mark.ddp(world_size=2)
    def test_my_allreduce_averages():
        assert_ddp_gradients_match(make_model, F.mse_loss, (x, y), grad_sync=my_allreduce)
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from trainguard._internal.tensors import leaves, map_tensors, render_path
from trainguard.errors import TrainguardAssertionError, UsageError
from trainguard.unit.seeding import seed_everything
from trainguard.unit.support import call_model, check_loss, check_tolerance

__all__ = ["assert_ddp_gradients_match", "ddp_gradient_diff"]


@dataclass(frozen=True)
class _GradientDiff:
    """One parameter's synced gradient against the single-process reference, over all ranks."""

    name: str
    max_abs_diff: float  # max over ranks and elements of |synced - reference|
    excess: float  # max over ranks and elements of |synced - reference| - rtol * |reference|
    synced_norm_min: float  # the synced gradient's norm, smallest over ranks
    synced_norm_max: float
    reference_norm: float
    rank_spread: float  # max over elements of (max over ranks - min over ranks) of the synced grad
    no_grad: str | None  # which side had no .grad ("synced", "reference") or None

    def ratio(self) -> float:
        """Norm of the synced gradient over the norm of the reference (largest over ranks)."""
        if self.reference_norm == 0.0:
            return math.inf if self.synced_norm_max > 0.0 else 1.0
        return self.synced_norm_max / self.reference_norm


def _require_process_group(caller: str) -> tuple[int, int]:
    if not (dist.is_available() and dist.is_initialized()):
        raise UsageError(
            f"{caller} must run inside an initialized torch.distributed process group, and this "
            "process has none. Mark the test @pytest.mark.ddp(world_size=2) (trainguard starts "
            "the ranks and initializes the group), or call torch.distributed.init_process_group() "
            "first (e.g. in a script started by torchrun)"
        )
    return dist.get_rank(), dist.get_world_size()


def _device_for_backend() -> torch.device:
    # nccl needs the tensors on this rank's GPU; every other backend here runs on CPU tensors.
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _unpack_batch(global_batch: Any) -> tuple[Any, Any, bool]:
    """(inputs, targets, has_targets) from ``(inputs, targets)`` or a bare inputs tensor."""
    if isinstance(global_batch, torch.Tensor):
        return global_batch, None, False
    if (
        isinstance(global_batch, (tuple, list))
        and not hasattr(global_batch, "_fields")
        and len(global_batch) == 2
    ):
        return global_batch[0], global_batch[1], True
    raise UsageError(
        "Expected a tensor or a 2-tuple (inputs, targets) for global_batch, got "
        f"{type(global_batch).__name__}"
        + (f" of length {len(global_batch)}" if isinstance(global_batch, (tuple, list)) else "")
        + "; pass the batch the ranks split between them, e.g. global_batch=(x, y)"
    )


def _batch_size(batch: Any) -> int:
    sizes = {
        render_path("global_batch", path): leaf.shape[0]
        for path, leaf in leaves(batch)
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0
    }
    if not sizes:
        raise UsageError(
            "global_batch holds no tensor with a batch dimension; pass tensors whose dim 0 is "
            "the sample dimension"
        )
    if len(set(sizes.values())) > 1:
        listed = ", ".join(f"{key}: {size}" for key, size in sizes.items())
        raise UsageError(
            f"the tensors of global_batch disagree on the batch size (dim 0): {listed}; every "
            "tensor must hold one row per sample"
        )
    return next(iter(sizes.values()))


def _shard(batch: Any, rank: int, world_size: int, size: int) -> Any:
    per_rank = size // world_size
    start = rank * per_rank

    def cut(t: torch.Tensor) -> torch.Tensor:
        return t[start : start + per_rank] if t.dim() > 0 else t

    return map_tensors(batch, cut)


def _fingerprint(t: torch.Tensor) -> torch.Tensor:
    """Four float64 numbers that change when any element or the shape changes."""
    flat = t.detach().reshape(-1).to(torch.float64)
    weights = torch.arange(1, flat.numel() + 1, dtype=torch.float64, device=flat.device)
    return torch.stack(
        [
            torch.tensor(float(flat.numel()), dtype=torch.float64, device=flat.device),
            flat.sum(),
            (flat * weights).sum(),
            flat.abs().sum(),
        ]
    )


def _check_same_on_every_rank(
    entries: list[tuple[str, torch.Tensor]], device: torch.device, caller: str, seed: int
) -> None:
    """Raise (on every rank alike) when the ranks hold different weights or batches."""
    count = torch.tensor([len(entries), -len(entries)], dtype=torch.int64, device=device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    if int(count[0]) != -int(count[1]):
        raise TrainguardAssertionError(
            f"{caller}: the ranks built models with different numbers of parameters and "
            f"buffers (between {-int(count[1])} and {int(count[0])}); model_factory must build "
            "the same model on every rank"
        )
    prints = torch.stack([_fingerprint(t.to(device)) for _, t in entries])
    highest, lowest = prints.clone(), prints.clone()
    dist.all_reduce(highest, op=dist.ReduceOp.MAX)
    dist.all_reduce(lowest, op=dist.ReduceOp.MIN)
    differs = ~(torch.eq(highest, lowest) | (torch.isnan(highest) & torch.isnan(lowest)))
    rows = differs.any(dim=1).nonzero().flatten().tolist()
    if not rows:
        return
    names = [entries[i][0] for i in rows]
    first = names[0]
    if first.startswith("global_batch"):
        raise TrainguardAssertionError(
            f"{caller}: the ranks were given different global batches ({first} differs "
            "first); every rank must pass the same global_batch (build it from a fixed seed, not "
            "from this rank's data loader): each rank takes its own shard of it\n"
            + _reproduce_ddp(seed, dist.get_world_size())
        )
    raise TrainguardAssertionError(
        f"{caller}: the ranks built different initial weights; first differing: {first}"
        + (
            f" (also {', '.join(names[1:6])}{', ...' if len(names) > 6 else ''})"
            if names[1:]
            else ""
        )
        + ". model_factory must build identical replicas on every rank after the same seed: do "
        "not seed with the rank, or broadcast rank 0's weights before training (DDP does that "
        "when it wraps the model; a hand-written sync does not, so the replicas would drift "
        "apart)\n"
        + _reproduce_ddp(seed, dist.get_world_size())
    )


def _first_difference(a: torch.nn.Module, b: torch.nn.Module) -> str | None:
    b_state = b.state_dict()
    for key, value in a.state_dict().items():
        other = b_state.get(key)
        if other is None or other.shape != value.shape or not torch.equal(other, value):
            return key
    return None


def _build_twice(
    model_factory: Callable[[], torch.nn.Module], seed: int
) -> tuple[torch.nn.Module, torch.nn.Module]:
    models = []
    for _ in range(2):
        seed_everything(seed)
        model = model_factory()
        if not isinstance(model, torch.nn.Module):
            raise UsageError(
                f"Expected model_factory() to return a torch.nn.Module, got {type(model).__name__}"
            )
        models.append(model)
    reference, replica = models
    if reference is replica:
        raise UsageError(
            "model_factory() returned the same module object twice; it must build a new model on "
            "every call (the reference and the distributed copy need their own gradients)"
        )
    differing = _first_difference(reference, replica)
    if differing is not None:
        raise UsageError(
            f"model_factory() built different weights on two calls after seed_everything({seed}): "
            f"first differing entry {differing!r}. Build the model from the global RNGs only "
            "(no private torch.Generator with a fresh seed, no time-based init) or load fixed "
            "weights"
        )
    return reference, replica


def _forward_backward(
    model: Callable[..., Any],
    loss_fn: Callable[..., Any],
    inputs: Any,
    targets: Any,
    has_targets: bool,
    caller: str,
) -> None:
    outputs = call_model(model, inputs)
    loss = loss_fn(outputs, targets) if has_targets else loss_fn(outputs)
    check_loss(loss, caller).backward()


def _max_or_zero(t: torch.Tensor) -> float:
    return float(t.max()) if t.numel() else 0.0


def _grad_or_zeros(p: torch.nn.Parameter) -> torch.Tensor:
    return (p.grad if p.grad is not None else torch.zeros_like(p)).detach().to(torch.float64)


def _compare_gradients(
    model_factory: Callable[[], torch.nn.Module],
    loss_fn: Callable[..., Any],
    global_batch: Any,
    *,
    grad_sync: Callable[[torch.nn.Module], Any] | None,
    seed: int,
    rtol: float,
    caller: str,
) -> list[_GradientDiff]:
    rank, world_size = _require_process_group(caller)
    if not callable(model_factory):
        raise UsageError(
            f"Expected a callable returning a fresh torch.nn.Module for model_factory, got "
            f"{type(model_factory).__name__}"
        )
    if grad_sync is not None and not callable(grad_sync):
        raise UsageError(
            f"Expected None (torch DDP) or a callable grad_sync(model) for grad_sync, got "
            f"{type(grad_sync).__name__}"
        )
    device = _device_for_backend()
    inputs, targets, has_targets = _unpack_batch(global_batch)
    reference, replica = _build_twice(model_factory, seed)
    reference.to(device)
    replica.to(device)
    full = map_tensors((inputs, targets), lambda t: t.to(device))

    entries: list[tuple[str, torch.Tensor]] = [
        (f"parameter {name}", p) for name, p in reference.named_parameters()
    ]
    entries += [(f"buffer {name}", b) for name, b in reference.named_buffers()]
    entries += [
        (render_path("global_batch", path), leaf)
        for path, leaf in leaves(full)
        if isinstance(leaf, torch.Tensor)
    ]
    _check_same_on_every_rank(entries, device, caller, seed)

    size = _batch_size(full)
    if size % world_size:
        lower, upper = size - size % world_size, size + world_size - size % world_size
        raise UsageError(
            f"global_batch has {size} samples along dim 0, which do not split into {world_size} "
            f"equal shards (world_size={world_size}); use a multiple of {world_size}, e.g. "
            f"{lower or upper} or {upper}"
        )
    shard_inputs, shard_targets = _shard(full, rank, world_size, size)

    # (a) the truth: one process, the whole batch
    _forward_backward(reference, loss_fn, full[0], full[1], has_targets, caller)
    # (b) this rank's shard, then the sync under test
    if grad_sync is None:
        wrapped = DistributedDataParallel(
            replica, device_ids=[device.index] if device.type == "cuda" else None
        )
        _forward_backward(wrapped, loss_fn, shard_inputs, shard_targets, has_targets, caller)
    else:
        _forward_backward(replica, loss_fn, shard_inputs, shard_targets, has_targets, caller)
        grad_sync(replica)

    names, rows, synced_grads, no_grad = [], [], [], []
    for (name, p_ref), (_, p_syn) in zip(reference.named_parameters(), replica.named_parameters()):
        g_ref, g_syn = _grad_or_zeros(p_ref), _grad_or_zeros(p_syn)
        diff = (g_syn - g_ref).abs()
        names.append(name)
        rows.append(
            [
                _max_or_zero(diff),
                _max_or_zero(diff - rtol * g_ref.abs()),
                float(g_syn.norm()),
                -float(g_syn.norm()),
                float(g_ref.norm()),
            ]
        )
        synced_grads.append(g_syn.reshape(-1))
        missing = None
        if p_syn.grad is None and p_ref.grad is not None:
            missing = "synced"
        elif p_ref.grad is None and p_syn.grad is not None:
            missing = "reference"
        no_grad.append(missing)
    if not names:
        raise UsageError("model_factory() built a model without parameters; nothing to compare")
    stats = torch.tensor(rows, dtype=torch.float64, device=device)
    dist.all_reduce(stats, op=dist.ReduceOp.MAX)
    # how far the ranks' synced gradients still are apart: zero after any correct sync
    flat = torch.cat(synced_grads)
    highest, lowest = flat.clone(), flat.clone()
    dist.all_reduce(highest, op=dist.ReduceOp.MAX)
    dist.all_reduce(lowest, op=dist.ReduceOp.MIN)
    spread = (highest - lowest).split([g.numel() for g in synced_grads])
    return [
        _GradientDiff(
            name=name,
            max_abs_diff=float(row[0]),
            excess=float(row[1]),
            synced_norm_min=-float(row[3]),
            synced_norm_max=float(row[2]),
            reference_norm=float(row[4]),
            rank_spread=float(s.max()) if s.numel() else 0.0,
            no_grad=missing,
        )
        for name, row, s, missing in zip(names, stats.cpu(), spread, no_grad)
    ]


def ddp_gradient_diff(
    model_factory: Callable[[], torch.nn.Module],
    loss_fn: Callable[..., Any],
    global_batch: torch.Tensor | tuple[Any, Any],
    *,
    grad_sync: Callable[[torch.nn.Module], Any] | None = None,
    seed: int = 0,
) -> dict[str, float]:
    """Per-parameter max abs difference between synced gradients and single-process gradients.

    Call it on every rank of an initialized process group (a ``@pytest.mark.ddp`` test). Every
    rank seeds the global RNGs with ``seed`` and builds the model twice with ``model_factory()``;
    the ranks' initial weights and global batches are compared by checksum (a difference raises
    ``TrainguardAssertionError`` naming the first differing parameter). Then:

    * reference: ``loss_fn(model(inputs), targets).backward()`` on the whole ``global_batch``
      in this process alone;
    * distributed: the same on this rank's shard (``global_batch`` split along dim 0 into
      ``world_size`` equal contiguous shards, rank ``r`` taking shard ``r``), through
      ``DistributedDataParallel`` (``grad_sync=None``) or a plain forward/backward followed by
      ``grad_sync(model)``, your own gradient all-reduce.

    ``global_batch`` is ``(inputs, targets)`` or a tensor of inputs (then ``loss_fn(outputs)``);
    inputs that are tuples or dicts are unpacked into the model call, and every tensor in them
    is split. The loss must be a mean over samples (what DDP's averaging assumes), and the
    forward pass must not depend on the batch as a whole or on the RNG: disable dropout, and use
    SyncBatchNorm instead of BatchNorm, or the comparison reports those differences too.

    Returns ``{parameter name: max abs diff}``, the maximum over all ranks, so the same dict on
    every rank. Uses the backend's device (this rank's GPU under nccl, CPU otherwise).

    Example::

        @pytest.mark.ddp(world_size=2)
        def test_sync():
            g = torch.Generator().manual_seed(0)  # the same global batch on every rank
            x, y = torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)
            diffs = ddp_gradient_diff(lambda: nn.Linear(4, 1), F.mse_loss, (x, y),
                                      grad_sync=allreduce_mean)
            assert max(diffs.values()) < 1e-6
    """
    diffs = _compare_gradients(
        model_factory,
        loss_fn,
        global_batch,
        grad_sync=grad_sync,
        seed=seed,
        rtol=0.0,
        caller="ddp_gradient_diff",
    )
    return {d.name: d.max_abs_diff for d in diffs}


def _sync_name(grad_sync: Callable[..., Any] | None) -> str:
    if grad_sync is None:
        return "DistributedDataParallel"
    return getattr(grad_sync, "__qualname__", None) or repr(grad_sync)


def _near(value: float, target: float, rel: float = 0.02) -> bool:
    return math.isfinite(value) and abs(value - target) <= rel * target


def _likely_cause(bad: list[_GradientDiff], world_size: int, atol: float) -> str:
    unsynced = [d.name for d in bad if d.rank_spread > atol]
    if unsynced:
        return (
            f"the ranks still hold different gradients for {', '.join(unsynced[:6])}"
            f"{', ...' if len(unsynced) > 6 else ''} after the sync: those parameters were not "
            "all-reduced (missing from the sync's parameter list or bucket, or their .grad was "
            "replaced after the sync)"
        )
    missing = [d.name for d in bad if d.no_grad == "synced"]
    if missing:
        return (
            f"{', '.join(missing[:6])} have no .grad on the distributed copy but do in the "
            "single process: the sync dropped them (set p.grad = None?) or the shard's forward "
            "skips them"
        )
    ratios = [d.ratio() for d in bad if d.reference_norm > 0.0]
    if world_size > 1 and ratios and all(_near(r, float(world_size)) for r in ratios):
        return (
            f"the norm ratio is ~{world_size} = world_size for every mismatching parameter: "
            "gradients summed instead of averaged across ranks (all_reduce with ReduceOp.SUM and "
            "no division by world_size). Divide each gradient by dist.get_world_size() after the "
            "all_reduce, or use ReduceOp.AVG. Adam hides this in the loss curve; SGD, gradient "
            "clipping and weight decay do not"
        )
    if world_size > 1 and ratios and all(_near(r, 1.0 / world_size) for r in ratios):
        return (
            f"the norm ratio is ~1/{world_size} = 1/world_size for every mismatching parameter: "
            "gradients divided by world_size once too often (an average of an average: "
            "ReduceOp.AVG or DDP followed by a division), or a loss with reduction='sum' "
            "(averaging per-rank sums gives 1/world_size of the full-batch sum)"
        )
    return (
        "the synced gradient is not the full-batch gradient: look for batch-dependent layers "
        "(BatchNorm computes statistics per shard; use SyncBatchNorm), dropout or other RNG use "
        "in forward, a loss normalized by a per-rank count (tokens, valid samples), or a sync "
        "that reduces only some ranks"
    )


def _reproduce_ddp(seed: int, world_size: int) -> str:
    current = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0]
    where = f"pytest '{current}'" if current else "rerun the test"
    return (
        f"reproduce: {where} (on {world_size} ranks, backend {dist.get_backend()}; the model and "
        f"batch come from seed={seed})"
    )


def assert_ddp_gradients_match(
    model_factory: Callable[[], torch.nn.Module],
    loss_fn: Callable[..., Any],
    global_batch: torch.Tensor | tuple[Any, Any],
    *,
    grad_sync: Callable[[torch.nn.Module], Any] | None = None,
    seed: int = 0,
    rtol: float = 1e-5,
    atol: float = 1e-6,
) -> None:
    """Assert the synced gradients on every rank equal the single-process full-batch gradients.

    Runs ``ddp_gradient_diff`` (same arguments; see there) and checks every parameter's gradient
    elementwise with ``|synced - reference| <= atol + rtol * |reference|`` on every rank. The
    ``TrainguardAssertionError`` names every mismatching parameter with its max abs diff and
    the ratio of the gradient norms (synced / reference), and names the likely cause: a ratio of
    ``world_size`` means gradients summed instead of averaged across ranks, ``1/world_size``
    averaged twice, and gradients still differing between ranks mean a parameter the sync
    missed. Every rank raises the same message.

    Example::

        def allreduce_mean(model):
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= dist.get_world_size()

        @pytest.mark.ddp(world_size=2)
        def test_allreduce_mean_matches_single_process():
            g = torch.Generator().manual_seed(0)
            x, y = torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)
            assert_ddp_gradients_match(make_model, F.mse_loss, (x, y), grad_sync=allreduce_mean)
    """
    caller = "assert_ddp_gradients_match"
    rtol_ = check_tolerance(rtol, "rtol", caller)
    atol_ = check_tolerance(atol, "atol", caller)
    diffs = _compare_gradients(
        model_factory,
        loss_fn,
        global_batch,
        grad_sync=grad_sync,
        seed=seed,
        rtol=rtol_,
        caller=caller,
    )
    bad = [d for d in diffs if not d.excess <= atol_]
    if not bad:
        return
    world_size = dist.get_world_size()
    lines = [
        f"{caller}: {len(bad)} of {len(diffs)} parameters get a different gradient after the "
        f"cross-rank sync ({_sync_name(grad_sync)}, world_size={world_size}) than from the whole "
        f"global batch in one process (rtol={rtol_:g}, atol={atol_:g}):"
    ]
    for d in bad:
        ratio = d.ratio()
        if d.synced_norm_max - d.synced_norm_min > atol_ + rtol_ * d.synced_norm_max:
            ratio_text = (
                f"{d.synced_norm_min / d.reference_norm:.4g}..{ratio:.4g} across ranks"
                if d.reference_norm > 0.0
                else "n/a (the reference gradient is zero)"
            )
        else:
            ratio_text = (
                f"{ratio:.4g}" if d.reference_norm > 0.0 else "n/a (reference gradient is zero)"
            )
        extra = f"; no .grad on the {d.no_grad} side" if d.no_grad else ""
        lines.append(
            f"  {d.name}: max abs diff {d.max_abs_diff:.6g}, norm ratio synced/reference "
            f"{ratio_text} (reference norm {d.reference_norm:.6g}){extra}"
        )
    lines.append(f"likely cause: {_likely_cause(bad, world_size, atol_)}")
    lines.append(_reproduce_ddp(seed, world_size))
    raise TrainguardAssertionError("\n".join(lines))
