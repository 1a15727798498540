"""A plain single-file torch training loop with an LR schedule that changes every step, for
trainguard's own tests of resume and determinism (issue 44's cause table).

One process or many (torchrun, gloo, CPU): an MLP with dropout learns a fixed synthetic
regression task with AdamW and a ``LambdaLR`` schedule (linear warmup, then linear decay: the lr
differs at every step). The data comes through a DataLoader whose DistributedSampler shuffles
each epoch from ``--seed``; each input gets Gaussian noise from numpy's global RNG (augmentation)
and Python's ``random`` picks the per-step noise scale, so all three global generators matter.

Every ``--ckpt-every`` steps rank 0 writes ``step_NNNNNN.pt`` (temp file + rename) holding the
model, the optimizer, the scheduler, every rank's RNG states (torch, Python, numpy) and the data
position (epoch and batch within it). ``--resume`` restores all of it from the newest checkpoint
and goes on from the next batch, so a resumed run prints exactly the uninterrupted run's lines.

Each rank prints ``step N loss X`` per optimizer step (its own micro-batch's loss) and, with
``--print-lr``, ``step N lr R``. The lr is off by default: a check must find a lost schedule
from what it observes in the job, not from a metric the job happens to print.

--plant NAME plants one defect (default: none):

scheduler_not_saved  the checkpoint leaves out only the scheduler's state; everything else is
                     saved and restored. The resumed run's first step uses the lr the optimizer
                     restored; its scheduler then starts the schedule again from the warmup.
rng_not_restored     the RNG states are saved, but the resume never sets them: the resumed run
                     draws dropout masks, noise and noise scales from the start-up seed's states.
replica_drift        after step 5 the last rank alone changes its first layer's weight outside
                     DDP (``param.data.add_``, as a rank-only fix-up or a load on one rank would):
                     the replicas part from step 6 on while the loss still falls (issue 45).
ddp_bypassed         at step 5 the last rank adds a second loss computed through the module inside
                     DDP (``model.module``) and calls backward on it: those gradients are not
                     reduced, so the ranks' gradients differ at that step and their weights after
                     it (issue 45).
set_epoch_never      the sampler's ``set_epoch`` is never called: every epoch replays the first
                     one's order (issue 45; the resume's data position still works).
clip_before_unscale  with --amp: the gradient norm is clipped before ``scaler.unscale_``, so the
                     scaled gradients (x 65536) are clipped to the unscaled limit: every step's
                     update shrinks by the scale (issue 45).

--amp trains with a loss scaler as an fp16 job does (``torch.amp.GradScaler("cpu")``, fp32 weights
on CPU: no fp16 kernels needed): scale, backward, ``unscale_``, clip the norm to 1, step, update.

--check-replicas is a defence against silent data corruption (issue 45's sdc drills): after every
optimizer step the ranks compare a checksum of their parameters (one all-reduce of two numbers); on
a mismatch each rank prints ``replicas differ after step N`` to stderr and exits 1.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.optim.lr_scheduler import LambdaLR
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

PLANTS = ("none", "scheduler_not_saved", "rng_not_restored", "replica_drift", "ddp_bypassed", "set_epoch_never",
          "clip_before_unscale")
#: the step after which replica_drift changes one rank's weights (and at which ddp_bypassed bypasses DDP)
DRIFT_AFTER = 5
SAMPLES = 384
FEATURES = 12


class PositionedSampler(DistributedSampler):  # type: ignore[type-arg]
    """A DistributedSampler that can start its epoch at a batch other than the first."""

    def __init__(self, dataset: TensorDataset, *, local_batch: int, **kwargs: Any) -> None:
        super().__init__(dataset, **kwargs)
        self.local_batch = local_batch
        self.start_batch = 0

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(list(super().__iter__())[self.start_batch * self.local_batch:])

    def __len__(self) -> int:
        return super().__len__() - self.start_batch * self.local_batch


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ckpt-dir", required=True)
    p.add_argument("--ckpt-every", type=int, default=4)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--batch-size", type=int, default=32, help="global batch, split over the ranks")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=6)
    p.add_argument("--decay-steps", type=int, default=200)
    p.add_argument("--dropout", type=float, default=0.2)
    p.add_argument("--sleep", type=float, default=0.0, help="seconds per step")
    p.add_argument("--print-lr", action="store_true")
    p.add_argument("--compile", default=None, metavar="BACKEND",
                   help="torch.compile the model with this backend (eager, aot_eager, inductor)")
    p.add_argument("--plant", choices=PLANTS, default="none")
    p.add_argument("--amp", action="store_true", help="a GradScaler, unscale_ and a norm clip of 1 (see above)")
    p.add_argument("--check-replicas", action="store_true",
                   help="compare a checksum of the parameters across ranks after every step; exit 1 on a mismatch")
    return p.parse_args()


def schedule(warmup: int, decay_steps: int):  # type: ignore[no-untyped-def]
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return max(0.05, 1.0 - (step - warmup) / decay_steps)

    return factor


def rng_states() -> dict[str, Any]:
    return {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}


def set_rng_states(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])


def newest_checkpoint(ckpt_dir: Path) -> Path | None:
    found = sorted(ckpt_dir.glob("step_*.pt"))
    return found[-1] if found else None


def scaled_step(scaler: torch.amp.GradScaler, loss: torch.Tensor, model: nn.Module,
                optimizer: torch.optim.Optimizer, clip_first: bool) -> None:
    """--amp's step: backward on the scaled loss, unscale_, clip the norm to 1, step, update
    (``clip_first``: the clip before ``unscale_``, on the scaled gradients)."""
    scaler.scale(loss).backward()
    if clip_first:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.unscale_(optimizer)
    if not clip_first:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(optimizer)
    scaler.update()


def main() -> int:
    args = parse_args()
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
    torch.manual_seed(args.seed + rank)
    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    torch.use_deterministic_algorithms(True)

    data = torch.Generator().manual_seed(1234)
    x = torch.randn(SAMPLES, FEATURES, generator=data)
    y = (x @ torch.randn(FEATURES, 1, generator=data)).sin() + 0.1 * torch.randn(SAMPLES, 1, generator=data)
    local_batch = args.batch_size // world
    sampler = PositionedSampler(TensorDataset(x, y), local_batch=local_batch, num_replicas=world, rank=rank,
                                shuffle=True, seed=args.seed, drop_last=True)
    # a generator of its own: each pass over a DataLoader draws a seed from it, from the global
    # torch RNG without one (and a resumed run starts one pass more than the uninterrupted run)
    loader = DataLoader(sampler.dataset, batch_size=local_batch, sampler=sampler, drop_last=True,
                        generator=torch.Generator().manual_seed(args.seed))
    batches_per_epoch = len(sampler) // local_batch

    model: nn.Module = nn.Sequential(nn.Linear(FEATURES, 64), nn.GELU(), nn.Dropout(args.dropout),
                                     nn.Linear(64, 64), nn.GELU(), nn.Dropout(args.dropout), nn.Linear(64, 1))
    if args.compile:
        model = torch.compile(model, backend=args.compile)  # type: ignore[assignment]
    if world > 1:
        model = DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    scheduler = LambdaLR(optimizer, schedule(args.warmup, args.decay_steps))

    ckpt_dir = Path(args.ckpt_dir)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    step, epoch, batch_in_epoch = 0, 0, 0
    newest = newest_checkpoint(ckpt_dir) if args.resume else None
    if newest is not None:
        state = torch.load(newest, weights_only=False)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        if "scheduler" in state:
            scheduler.load_state_dict(state["scheduler"])
        step, epoch, batch_in_epoch = state["step"], state["data"]["epoch"], state["data"]["batch_in_epoch"]
        if args.plant != "rng_not_restored":
            set_rng_states(state["rng"][rank])
        print(f"resumed from {newest.name} at step {step}", flush=True)

    scaler = torch.amp.GradScaler("cpu") if args.amp else None
    model.train()
    while step < args.steps:
        if args.plant != "set_epoch_never":
            sampler.set_epoch(epoch)
        sampler.start_batch = batch_in_epoch
        for inputs, targets in loader:
            noise_scale = random.uniform(0.0, 0.1)
            noise = torch.from_numpy(np.random.standard_normal(inputs.shape).astype(np.float32))
            loss = F.mse_loss(model(inputs + noise_scale * noise), targets)
            optimizer.zero_grad(set_to_none=True)
            if scaler is not None:
                scaled_step(scaler, loss, model, optimizer, args.plant == "clip_before_unscale")
            else:
                loss.backward()
            if args.plant == "ddp_bypassed" and step + 1 == DRIFT_AFTER and rank == world - 1:
                # an extra loss through the module inside DDP, on one rank: its gradients add to
                # the reduced ones there only (a rank-0 auxiliary or logging loss)
                F.mse_loss(model.module(inputs), targets).backward()  # type: ignore[operator]
            lr = optimizer.param_groups[0]["lr"]
            if scaler is None:
                optimizer.step()
            scheduler.step()
            step += 1
            if args.check_replicas and world > 1 and not replicas_agree(model):
                print(f"replicas differ after step {step} on rank {rank}", file=sys.stderr, flush=True)
                return 1
            if args.plant == "replica_drift" and step == DRIFT_AFTER and rank == world - 1:
                next(model.parameters()).data.add_(1e-3)
            batch_in_epoch += 1
            if batch_in_epoch == batches_per_epoch:
                epoch, batch_in_epoch = epoch + 1, 0
            if step % args.ckpt_every == 0 or step == args.steps:
                save(args, ckpt_dir, model, optimizer, scheduler, step, epoch, batch_in_epoch, world, rank)
            print(f"step {step} loss {loss.item():.6f}", flush=True)
            if args.print_lr:
                print(f"step {step} lr {lr:.8e}", flush=True)
            if args.sleep:
                time.sleep(args.sleep)
            if step >= args.steps:
                break
    if world > 1:
        dist.barrier()  # every rank done before any leaves (gloo aborts a rank whose peer went first)
        dist.destroy_process_group()
    return 0


def replicas_agree(model: nn.Module) -> bool:
    """Whether every rank holds the same parameters: the largest and the smallest checksum agree."""
    with torch.no_grad():
        total = torch.stack([p.detach().double().sum() for p in model.parameters()]).sum()
        both = torch.stack([total, -total])
        dist.all_reduce(both, op=dist.ReduceOp.MAX)
    return bool(both[0] == -both[1])


def save(args: argparse.Namespace, ckpt_dir: Path, model: nn.Module, optimizer: torch.optim.Optimizer,
         scheduler: LambdaLR, step: int, epoch: int, batch_in_epoch: int, world: int, rank: int) -> None:
    """Rank 0 writes the checkpoint with every rank's RNG states (gathered)."""
    rng = rng_states()
    gathered: list[Any] = [None] * world
    if world > 1:
        dist.all_gather_object(gathered, rng)
    else:
        gathered = [rng]
    if rank == 0:
        write(args, ckpt_dir, model, optimizer, scheduler, step, epoch, batch_in_epoch, gathered)
    if world > 1:
        dist.barrier()  # no rank reports this step before its checkpoint is on disk


def write(args: argparse.Namespace, ckpt_dir: Path, model: nn.Module, optimizer: torch.optim.Optimizer,
          scheduler: LambdaLR, step: int, epoch: int, batch_in_epoch: int, gathered: list[Any]) -> None:
    state: dict[str, Any] = {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "rng": gathered,
        "step": step,
        "data": {"epoch": epoch, "batch_in_epoch": batch_in_epoch},
    }
    if args.plant == "scheduler_not_saved":
        del state["scheduler"]
    target = ckpt_dir / f"step_{step:06d}.pt"
    tmp = target.with_name("." + target.name + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, target)


if __name__ == "__main__":
    code = main()
    # gloo may abort a rank in the interpreter's teardown even after destroy_process_group
    # ("terminate called without an active exception", pytorch#190489; seen once here on a loaded
    # machine): everything this job writes is written, so the rest of the teardown is skipped
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
