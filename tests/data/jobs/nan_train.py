"""A small torch DDP job (gloo, CPU) for trainguard's numerics drills (``fault: nan``).

A two-layer MLP fits a synthetic regression; each rank trains on its own draws, DDP all-reduces
the gradients, and every rank prints ``step {n} loss {x:.6f}`` after each step (``nan`` when the
loss is not finite). Unmodified by trainguard: the drill's NaN comes in through the start-up hook.

--on-nonfinite stop   a non-finite loss (any rank's) or gradient norm (after the all-reduce)
                      raises FloatingPointError on every rank: exit 1 with a traceback
--on-nonfinite skip   the step is skipped on every rank (gradients zeroed, no optimizer step),
                      a warning goes to stderr, and training goes on
--on-nonfinite ignore nothing is checked: the job trains on NaN weights (a planted defect)
--check local-loss    only this rank's own loss is checked, and only by this rank: a NaN gradient
                      of another rank comes in through the all-reduce unnoticed (a planted defect)
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sleep", type=float, default=0.0, help="seconds per step")
    p.add_argument("--on-nonfinite", choices=("stop", "skip", "ignore"), default="stop")
    p.add_argument("--check", choices=("all", "local-loss"), default="all")
    args = p.parse_args()
    torch.set_num_threads(1)
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
    torch.manual_seed(args.seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    net: nn.Module = DistributedDataParallel(model) if world > 1 else model
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    data = torch.Generator().manual_seed(args.seed * 1000 + rank)
    inputs = torch.randn(256, 8, generator=data)
    targets = inputs @ torch.linspace(-1, 1, 8).unsqueeze(1) + 0.1 * torch.randn(256, 1, generator=data)
    try:
        for step in range(1, args.steps + 1):
            batch = torch.randint(0, 256, (32,), generator=data)
            loss = F.mse_loss(net(inputs[batch]), targets[batch])
            optimizer.zero_grad()
            loss.backward()  # DDP all-reduces the gradients here
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1e6)
            if args.check == "local-loss":
                bad = not math.isfinite(loss.item())
            else:  # every rank's loss and the all-reduced gradients: every rank decides alike
                flag = torch.tensor([float(not math.isfinite(loss.item()) or not math.isfinite(norm.item()))])
                if world > 1:
                    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
                bad = bool(flag.item())
            if bad and args.on_nonfinite == "stop":
                raise FloatingPointError(f"non-finite loss or gradient at step {step} on rank {rank} "
                                         f"(loss {loss.item()}, gradient norm {norm.item()}): stopping")
            if bad and args.on_nonfinite == "skip":
                print(f"warning: step {step} skipped on rank {rank}: non-finite loss or gradient "
                      f"(loss {loss.item()}, gradient norm {norm.item()})", file=sys.stderr, flush=True)
                optimizer.zero_grad()
            else:
                optimizer.step()
            print(f"step {step} loss {loss.item():.6f}", flush=True)
            if args.sleep:
                time.sleep(args.sleep)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
