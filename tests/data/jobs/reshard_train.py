"""A tiny torch job for the reshard check's tests: it resumes at another world size, or plants
one defect that shows only there.

Under torchrun (any WORLD_SIZE, gloo, CPU) it trains a 2-layer MLP on 256 fixed samples with a
fixed global batch (``--batch-size``, split over the ranks): each global step takes the next
``batch_size`` indices of an epoch's seeded permutation, rank r the r-th slice of them, through a
DataLoader (so the start-up hook records the samples). The gradients are averaged by DDP; the
optimizer is Adam, or ZeroRedundancyOptimizer(Adam) with ``--zero`` (each rank holds the state
of its share of the parameters). Rank 0 checkpoints every ``--ckpt-every`` steps (write + rename)
and prints ``step N loss L`` on every rank (its own slice's loss).

Defects, each invisible when the job resumes at the world size it checkpointed at:

--defect offset      the data position is saved as the samples *this rank* has seen and restored
                     as that times the new world size: right at the same size, wrong at another
                     (a per-rank offset saved as if it were a global one)
--defect zero-shard  with --zero, rank 0 saves only its own shard of the optimizer state (no
                     gather of the other ranks' shards); each rank restores the entries it owns,
                     and at another world size it owns parameters whose state was never saved
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset

SAMPLES = 256


class GlobalBatches:
    """Per-rank index lists of the global batches from ``start_step`` of ``epoch`` on."""

    def __init__(self, seed: int, epoch: int, start_step: int, batch: int, rank: int, world: int) -> None:
        self.order = torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(seed * 1000 + epoch)).tolist()
        self.start, self.batch, self.rank, self.local = start_step, batch, rank, batch // world

    def __iter__(self):  # type: ignore[no-untyped-def]
        for s in range(self.start, SAMPLES // self.batch):
            chunk = self.order[s * self.batch:(s + 1) * self.batch]
            yield chunk[self.rank * self.local:(self.rank + 1) * self.local]

    def __len__(self) -> int:
        return SAMPLES // self.batch - self.start


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--ckpt-dir", required=True)
    p.add_argument("--ckpt-every", type=int, default=2)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--zero", action="store_true")
    p.add_argument("--defect", choices=["none", "offset", "zero-shard"], default="none")
    p.add_argument("--sleep", type=float, default=0.0)
    args = p.parse_args()
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
    else:  # ZeroRedundancyOptimizer needs a process group even on one rank
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    torch.manual_seed(args.seed)
    data = torch.Generator().manual_seed(1234)
    x = torch.randn(SAMPLES, 8, generator=data)
    y = (x @ torch.randn(8, 1, generator=data)).tanh() + 0.1 * torch.randn(SAMPLES, 1, generator=data)
    dataset = TensorDataset(x, y)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    names = {p: n for n, p in model.named_parameters()}
    if args.zero:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        optimizer: torch.optim.Optimizer = ZeroRedundancyOptimizer(
            model.parameters(), optimizer_class=torch.optim.Adam, lr=0.01)
        local = optimizer.optim  # type: ignore[attr-defined]
    else:
        optimizer = local = torch.optim.Adam(model.parameters(), lr=0.01)
    ckpt_dir = Path(args.ckpt_dir)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    step, seen = 0, 0  # seen: samples this rank has trained on
    if args.resume:
        found = sorted(ckpt_dir.glob("step-*.pt"), key=lambda f: int(f.stem.split("-")[1]))
        if found:
            state = torch.load(found[-1], weights_only=True)
            model.load_state_dict(state["model"])
            owned = [q for g in local.param_groups for q in g["params"]]
            for q in owned:
                if names[q] in state["optimizer"]["state"]:
                    local.state[q] = dict(state["optimizer"]["state"][names[q]])
            step = state["step"]
            if args.defect == "offset":
                seen = state["data"]["samples_seen"]  # this rank's count at the old size
            else:
                seen = state["data"]["samples_seen"] // world  # the global count, split
            print(f"resumed at step {step} from {found[-1].name}", file=sys.stderr, flush=True)
    ddp = DistributedDataParallel(model) if world > 1 else model
    per_epoch = SAMPLES // args.batch_size
    while step < args.steps:
        position = seen * world // args.batch_size  # global steps of data consumed
        epoch, start = divmod(position, per_epoch)
        loader = DataLoader(dataset, batch_sampler=GlobalBatches(args.seed, epoch, start, args.batch_size, rank, world))
        for xb, yb in loader:
            loss = nn.functional.mse_loss(ddp(xb), yb)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1
            seen += len(xb)
            if step % args.ckpt_every == 0 and step < args.steps:
                save(args, model, local, names, step, seen, rank, world, ckpt_dir)
            print(f"step {step} loss {loss.item():.6f}", flush=True)
            time.sleep(args.sleep)
            if step >= args.steps:
                break
    dist.destroy_process_group()
    return 0


def save(args: argparse.Namespace, model: nn.Module, local: torch.optim.Optimizer, names: dict, step: int,
         seen: int, rank: int, world: int, ckpt_dir: Path) -> None:
    shard = {names[q]: {k: v.clone() if torch.is_tensor(v) else v for k, v in local.state[q].items()}
             for g in local.param_groups for q in g["params"] if q in local.state}
    if args.defect == "zero-shard":
        merged = shard  # rank 0's shard only
    else:
        gathered: list = [None] * world
        dist.all_gather_object(gathered, shard)
        merged = {k: v for part in gathered for k, v in part.items()}
    if rank != 0:
        return
    samples_seen = seen if args.defect == "offset" else seen * world
    state = {"model": model.state_dict(), "optimizer": {"state": merged}, "step": step,
             "data": {"samples_seen": samples_seen}}
    tmp = ckpt_dir / f".step-{step}.pt.tmp"
    torch.save(state, tmp)
    os.replace(tmp, ckpt_dir / f"step-{step}.pt")


if __name__ == "__main__":
    sys.exit(main())
