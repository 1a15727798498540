"""A small torch DDP job on gloo that can stall one rank on purpose (trainguard's stall attribution).

Each step: a batch from a DataLoader, forward and backward through DistributedDataParallel (its
gradient all-reduce is issued from C++), an optimizer step, then an explicit all_reduce of the loss
(``dist.all_reduce`` in a second process group, as a job that keeps one for its metrics) and the line ``step {n} loss {x}`` on every rank.

``--fault KIND --fault-rank R --fault-step K`` plants a stall on rank R at step K:

stop       the rank SIGSTOPs itself before step K's work
sleep      sleeps (3600 s) before step K's work: its peers wait in DDP's all-reduce
busy       a Python busy loop before step K's work
gil        a C call that holds the GIL (``sum(range(10**14))``) before step K's work
loader     its DataLoader's worker deadlocks on step K's batch (the loader has one worker)
skip       skips step K's loss all_reduce (one all_reduce fewer than its peers: it waits in the
           next step's gradient all-reduce, its peers in the loss all_reduce)
other      calls broadcast instead of step K's loss all_reduce (another collective)

(With gloo a skipped collective in the *same* group is no stall: the next collective's sizes
differ and gloo aborts the rank, "Received data size doesn't match expected size".)
"""

from __future__ import annotations

import argparse
import os
import signal
import time

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

FAULTS = ("stop", "sleep", "busy", "gil", "loader", "skip", "other")


class Numbers(Dataset):
    """Fixed random pairs; with ``block`` (a worker's deadlock) item ``block`` never returns."""

    def __init__(self, size: int, block: int | None) -> None:
        gen = torch.Generator().manual_seed(0)
        self.x = torch.randn(size, 8, generator=gen)
        self.y = torch.randn(size, 4, generator=gen)
        self.block = block

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.block is not None and i == self.block:
            time.sleep(3600)  # the worker deadlocks here
        return self.x[i], self.y[i]


def stall_before_step(kind: str) -> None:
    if kind == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif kind == "sleep":
        time.sleep(3600)
    elif kind == "busy":
        while True:
            pass
    elif kind == "gil":
        sum(range(10**14))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--sleep", type=float, default=0.05)
    p.add_argument("--fault", choices=FAULTS, default=None)
    p.add_argument("--fault-rank", type=int, default=1)
    p.add_argument("--fault-step", type=int, default=3)
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 4))
    metrics = dist.new_group()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mine = args.fault is not None and rank == args.fault_rank
    batch = 2
    block = (args.fault_step - 1) * batch if mine and args.fault == "loader" else None
    loader = DataLoader(Numbers(args.steps * batch, block), batch_size=batch,
                        num_workers=1 if args.fault == "loader" else 0)
    for step, (x, y) in enumerate(loader, start=1):
        if mine and step == args.fault_step:
            stall_before_step(args.fault)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        total = loss.detach().clone()
        if mine and step == args.fault_step and args.fault == "other":
            dist.broadcast(total, 0, group=metrics)
        elif not (mine and step == args.fault_step and args.fault == "skip"):
            dist.all_reduce(total, group=metrics)
        print(f"step {step} loss {total.item() / world:.6f}", flush=True)
        time.sleep(args.sleep)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
