"""HSDP on CPU: FSDP2's ``fully_shard`` on a 2 x 2 device mesh (``replicate`` x ``shard``) at 4
gloo ranks, a small MLP trained with AdamW on seeded random data (each replica group its own
batches). Ranks 0 and 2 hold shard 0 of every parameter, ranks 1 and 3 shard 1; the replicate
dimension all-reduces the reduce-scattered gradients, so each shard is equal on its two replicas.

--plant replica_drift: after step 3, rank 2 alone adds 1e-3 to its local shard of ``0.weight``
outside the optimizer (a failing unit, a rank-dependent branch): the loss keeps falling, and the
replicas of shard 0 part (docs/invariants.md, "Replicas agree").

    torchrun --nproc_per_node 4 hsdp_train.py --steps 6 [--plant replica_drift]
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

DRIFT_AFTER = 3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plant", choices=("none", "replica_drift"), default="none")
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(args.seed)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = torch.Generator().manual_seed(args.seed * 100 + rank)
    for step in range(1, args.steps + 1):
        x = torch.randn(16, 8, generator=data)
        loss = (model(x) - x.sum(dim=1, keepdim=True)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        if args.plant == "replica_drift" and step == DRIFT_AFTER and rank == 2:
            with torch.no_grad():
                model[0].weight.to_local().add_(1e-3)
        print(f"step {step} loss {loss.item():.6f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
