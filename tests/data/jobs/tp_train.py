"""Tensor parallelism on CPU over gloo: a small MLP (a column-parallel layer, a row-parallel one,
a head whole on every rank) trained with AdamW on seeded random data. ``--tp dtensor``:
``parallelize_module`` (ColwiseParallel, then RowwiseParallel), the head distributed with
``Replicate()``; at 2 ranks a 1-D ``tp`` mesh, at 4 a 2 x 2 (``dp``, ``tp``) mesh with the
data-parallel dimension given by ``--dp``:

* ``fsdp``: ``replicate`` of ``torch.distributed._composable.replicate_with_fsdp`` on the ``dp``
  mesh: the parameters become DTensors on the 2-D mesh, ``(Replicate(), Shard(dim=0))`` and the
  like;
* ``ddp``: ``DistributedDataParallel`` on the ``dp`` mesh after
  ``torch.distributed.tensor.parallel.ddp._pre_dp_module_transform`` (torch's TP + DDP recipe):
  the parameters are the local shards as plain tensors between forwards, DDP's process group the
  ``dp`` one.

``--tp plain`` (Megatron's way): each rank holds its shards as ordinary tensors (sliced from one
seeded full model), the row-parallel output summed over the tensor-parallel group by an
all-reduce whose backward passes the gradient through; at 4 ranks the model is wrapped in
``DistributedDataParallel(process_group=...)`` of its data-parallel group (ranks 0 and 2, 1 and 3).

Each tensor-parallel group reads the same batches (seeded by its ``dp`` coordinate), each
data-parallel replica its own. The colwise layer's weight and bias are sharded over ``tp``, the
rowwise layer's weight too (its bias, like the head's parameters, is whole on every rank):
every parameter is equal on the ranks of its ``dp`` group, the whole ones on every rank.

--plant replica_drift: after step 3, the last rank alone adds 1e-3 to its copy of the rowwise
layer's bias (``Replicate()`` on the ``tp`` mesh) outside the optimizer. --plant shard_drift:
the last rank adds it to its shard of ``0.weight`` (at 4 ranks its replica is rank 1).

    torchrun --nproc_per_node 4 tp_train.py --steps 6 --tp dtensor --dp fsdp [--plant replica_drift]
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, distribute_module
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

DRIFT_AFTER = 3


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _tensor(model: torch.nn.Module, name: str) -> torch.Tensor:
    """The module's tensor ``name``: a parameter, or (under torch's TP + DDP recipe, after a
    forward) the DTensor attribute over the optimizer's parameter."""
    module, _, attr = name.rpartition(".")
    return getattr(model.get_submodule(module), attr)


def _replicated_input(_module: torch.nn.Module, inputs: tuple[torch.Tensor, ...], mesh: DeviceMesh
                      ) -> tuple[DTensor, ...]:
    return tuple(DTensor.from_local(x, mesh, [Replicate()]) for x in inputs)


class _SumOverTP(torch.autograd.Function):
    """All-reduce (sum) over the tensor-parallel group in the forward; the gradient as it is in
    the backward (every rank of the group computes the same loss from the sum)."""

    @staticmethod
    def forward(ctx: object, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class PlainTP(torch.nn.Module):
    """The MLP with its first two layers' shards as ordinary tensors: ``up`` holds this rank's
    rows of the full first layer, ``down`` its columns of the second (no bias: ``down_bias`` is
    added once, after the sum), ``head`` is whole."""

    def __init__(self, full: torch.nn.Sequential, tp: int, tp_size: int, group: dist.ProcessGroup) -> None:
        super().__init__()
        rows = slice(tp * 16 // tp_size, (tp + 1) * 16 // tp_size)
        self.group = group
        self.up = torch.nn.Linear(8, 16 // tp_size)
        self.down = torch.nn.Linear(16 // tp_size, 8, bias=False)
        self.down_bias = torch.nn.Parameter(full[2].bias.detach().clone())
        self.head = full[4]
        with torch.no_grad():
            self.up.weight.copy_(full[0].weight[rows])
            self.up.bias.copy_(full[0].bias[rows])
            self.down.weight.copy_(full[2].weight[:, rows])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = _SumOverTP.apply(self.down(torch.relu(self.up(x))), self.group)
        return self.head(torch.relu(h + self.down_bias))


def _groups(world: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup | None, int, int]:
    """(this rank's tensor-parallel group, its data-parallel group or None, its tp and dp
    coordinates): ranks 0 and 1 (2 and 3) a tensor-parallel group, 0 and 2 (1 and 3) a
    data-parallel one. Every rank makes every group, as torch requires."""
    rank = dist.get_rank()
    tp_size = min(world, 2)
    tp_groups = [dist.new_group(list(range(start, start + tp_size))) for start in range(0, world, tp_size)]
    dp_groups = [dist.new_group(list(range(tp, world, tp_size))) for tp in range(tp_size)] if world > tp_size else []
    return (tp_groups[rank // tp_size], dp_groups[rank % tp_size] if dp_groups else None, rank % tp_size,
            rank // tp_size)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tp", choices=("dtensor", "plain"), default="dtensor")
    p.add_argument("--dp", choices=("fsdp", "ddp"), default="fsdp",
                   help="the data-parallel wrapper of --tp dtensor at 4 ranks (plain: always DDP)")
    p.add_argument("--plant", choices=("none", "replica_drift", "shard_drift"), default="none")
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    if args.tp == "plain":
        tp_group, dp_group, tp, dp = _groups(world)
        model: torch.nn.Module = PlainTP(_mlp(), tp, min(world, 2), tp_group)
        body = model if dp_group is None else torch.nn.parallel.DistributedDataParallel(model, process_group=dp_group)
        shard, whole = "up.weight", "down_bias"
    else:
        model, body, dp = _dtensor(args.dp, world)
        shard, whole = "0.weight", "2.bias"
    opt = torch.optim.AdamW(body.parameters(), lr=1e-2)
    data = torch.Generator().manual_seed(args.seed * 100 + dp)
    for step in range(1, args.steps + 1):
        x = torch.randn(16, 8, generator=data)
        loss = (body(x) - x.sum(dim=1, keepdim=True)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        if args.plant != "none" and step == DRIFT_AFTER and rank == world - 1:
            with torch.no_grad():
                _local(_tensor(model, whole if args.plant == "replica_drift" else shard)).add_(1e-3)
        print(f"step {step} loss {_local(loss).item():.6f}", flush=True)
    dist.destroy_process_group()


def _mlp() -> torch.nn.Sequential:
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8), torch.nn.ReLU(),
                               torch.nn.Linear(8, 1))


def _dtensor(dp_wrapper: str, world: int) -> tuple[torch.nn.Sequential, torch.nn.Module, int]:
    """The MLP parallelized with DTensors: (the model, what the job calls, its dp coordinate)."""
    if world == 4:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        tp_mesh, dp = mesh["tp"], mesh["dp"].get_local_rank()
    else:
        tp_mesh, dp = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",)), 0
    model = _mlp()
    parallelize_module(model, tp_mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    distribute_module(model[4], tp_mesh, input_fn=_replicated_input,  # the head: Replicate() on every rank
                      output_fn=lambda _module, out, _mesh: out.to_local())
    if world == 4 and dp_wrapper == "fsdp":
        from torch.distributed._composable.replicate_with_fsdp import replicate

        replicate(model, mesh=mesh["dp"])
    elif world == 4:
        from torch.distributed.tensor.parallel.ddp import _pre_dp_module_transform

        _pre_dp_module_transform(model)
        return model, torch.nn.parallel.DistributedDataParallel(model, device_mesh=mesh["dp"]), dp
    return model, model, dp


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
