"""A DDP job (gloo) whose steps are CPU work, for trainguard's straggler finding (docs/drills.md
"Stragglers"): each step a small MLP's forward and backward on every rank (DDP all-reduces the
gradients), an optimizer step, a print.

--quota-rank R --quota F   rank R moves itself into the CPU cgroup --cgroup (cgroup v1 or v2 path
                           made by the caller, quota already set) before its first step
--eval-every N            rank 0 alone does an evaluation's worth of extra CPU work every N steps
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
import torch.distributed as dist


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--quota-rank", type=int, default=None)
    p.add_argument("--cgroup", default=None)
    p.add_argument("--eval-every", type=int, default=0)
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if args.cgroup and rank == args.quota_rank:
        (Path(args.cgroup) / "cgroup.procs").write_text(str(os.getpid()))
    torch.manual_seed(0)
    w = args.width
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(
        torch.nn.Linear(w, w), torch.nn.ReLU(), torch.nn.Linear(w, w), torch.nn.ReLU(), torch.nn.Linear(w, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.001)
    gen = torch.Generator().manual_seed(rank)
    for step in range(1, args.steps + 1):
        x = torch.randn(args.batch, w, generator=gen)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        if args.eval_every and rank == 0 and step % args.eval_every == 0:
            with torch.no_grad():  # rank 0's evaluation: the others wait in the next all-reduce
                for _ in range(20):
                    model.module(x)
        opt.step()
        print(f"step {step} loss {loss.item():.6f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
