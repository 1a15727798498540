"""Train a small MLP on scikit-learn's 8x8 digits, on one process or many (torchrun).

    python train.py --steps 200 --ckpt-dir checkpoints
    torchrun --nproc-per-node 2 train.py --steps 200 --ckpt-dir checkpoints
    python train.py --steps 200 --ckpt-dir checkpoints --resume

After every optimizer step each rank prints ``step N loss L lr R`` (L is that rank's loss on its
own micro-batch); rank 0 also prints ``step N val_loss V`` every --eval-every steps. Everything
else is logged to stderr.

--plant NAME plants one silent defect on purpose (trainguard's invariants yardstick, issue 45; the
default plants none). Each leaves the loss falling; from step PLANT_STEP (5) where a step is named:

  ddp_bypassed          at step 5 the last rank adds a second loss through the model inside DDP
                        (its gradients are not reduced: the ranks' gradients differ)
  clip_one_rank         only rank 0 clips its gradient norm (a clip put under ``if rank == 0``)
  group_dropped         the optimizer gets the weights' param group only; the biases never train
  head_after_optimizer  the head is created again after the optimizer was built (the optimizer
                        steps the old head's parameters, the model uses the new one's)
  layer_frozen          the first layer is frozen (requires_grad off) after the optimizer was built
  zero_grad_missing     the gradients are never zeroed: every step adds to the last one's
  set_epoch_never       the sampler's set_epoch is never called: each epoch replays the first's order
  eval_left_on          validation (rank 0) leaves the model in eval mode: dropout off from then on
  validation_train_mode validation runs with the model in train mode (dropout on)

A scheduler's notice -- SIGTERM (Kubernetes, and Slurm at the time limit) or SIGUSR1 (Slurm's
``--signal=USR1@lead``) -- makes every rank finish its current step, agree on it (an all-reduce
of the stop flag, so no rank stops a step earlier than the others), checkpoint it and exit 0
well inside the grace. A second notice does not interrupt the save.

--batch-size is the global batch: each of the WORLD_SIZE ranks trains on batch_size / WORLD_SIZE
samples per step, and the ranks' micro-batches together are exactly the batch a single process
would draw, so a run on N ranks matches a run on 1 (with --dropout 0: dropout masks are drawn
per rank).
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import random
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.optim.lr_scheduler import LambdaLR
from torch.utils.data import DataLoader

from digits.checkpoint import (
    capture_rng_state,
    latest_valid_checkpoint,
    load_checkpoint,
    remove_stale_temp_files,
    restore_rng_state,
    save_checkpoint,
)
from digits.data import AugmentedDigits, ResumableDistributedSampler, load_split, seed_worker
from digits.model import DigitsMLP

log = logging.getLogger("train")

PLANTS = ("ddp_bypassed", "clip_one_rank", "group_dropped", "head_after_optimizer", "layer_frozen",
          "zero_grad_missing", "set_epoch_never", "eval_left_on", "validation_train_mode")
PLANT_STEP = 5

HERE = os.path.dirname(os.path.abspath(__file__))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse and check the command line (--batch-size against WORLD_SIZE too)."""
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--steps", type=int, default=600, help="total optimizer steps (spans epochs)")
    p.add_argument("--batch-size", type=int, default=64, help="global batch size, split over ranks")
    p.add_argument("--lr", type=float, default=1e-2, help="peak learning rate")
    p.add_argument("--min-lr-ratio", type=float, default=0.1, help="final lr as a fraction of --lr")
    p.add_argument(
        "--warmup-steps", type=int, default=10, help="linear warmup before the cosine decay"
    )
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--grad-clip", type=float, default=1.0, help="max gradient norm (0 disables)")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--depth", type=int, default=2, help="number of hidden layers")
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument(
        "--noise-std", type=float, default=0.05, help="augmentation: gaussian pixel noise"
    )
    p.add_argument("--max-shift", type=int, default=1, help="augmentation: random shift in pixels")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--num-workers", type=int, default=0, help="DataLoader worker processes per rank"
    )
    p.add_argument(
        "--data-dir", default=os.path.join(HERE, "data"), help="where the data set is cached"
    )
    p.add_argument("--ckpt-dir", default=None, help="checkpoint directory (none: no checkpoints)")
    p.add_argument("--ckpt-every", type=int, default=5, help="checkpoint every N steps")
    p.add_argument("--keep-last", type=int, default=2, help="checkpoints to keep")
    p.add_argument(
        "--resume", action="store_true", help="continue from the latest valid checkpoint"
    )
    p.add_argument("--eval-every", type=int, default=20, help="validate every N steps (rank 0)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument(
        "--deterministic",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="use deterministic algorithms only",
    )
    p.add_argument("--log-level", default="INFO")
    p.add_argument("--plant", choices=PLANTS, help="plant a silent defect on purpose (see above)")
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error(f"--steps must be at least 1, got {args.steps}")
    for flag in ("ckpt_every", "eval_every", "keep_last"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}")
    if args.resume and not args.ckpt_dir:
        p.error("--resume needs --ckpt-dir")
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if args.batch_size < world_size or args.batch_size % world_size:
        p.error(
            f"--batch-size {args.batch_size} is the global batch and must be a positive multiple "
            f"of WORLD_SIZE={world_size}; try --batch-size {max(1, args.batch_size // world_size) * world_size}"
        )
    return args


class Notice:
    """Set by SIGTERM / SIGUSR1: stop after the current step (the handler only sets a flag;
    the save happens in the training loop, between steps, where the state is consistent)."""

    def __init__(self) -> None:
        self.signal: int | None = None

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, self._on)

    def _on(self, signum: int, frame: object) -> None:
        if self.signal is None:
            self.signal = signum

    def agreed(self, world_size: int, device: torch.device) -> bool:
        """Whether any rank got the notice: every rank stops after the same step."""
        if world_size == 1:
            return self.signal is not None
        flag = torch.tensor([1 if self.signal is not None else 0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


def warmup_cosine(warmup_steps: int, total_steps: int, min_ratio: float) -> Callable[[int], float]:
    """LR multiplier: linear warmup to 1, then cosine decay to ``min_ratio`` at ``total_steps``."""

    def factor(step: int) -> float:  # step 0 is the first optimizer step
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


@torch.no_grad()
def evaluate(
    model: nn.Module, images: torch.Tensor, labels: torch.Tensor, plant: str | None = None
) -> tuple[float, float]:
    """(mean loss, accuracy) on the whole validation set."""
    if plant != "validation_train_mode":
        model.eval()
    logits = model(images)
    if plant != "eval_left_on":
        model.train()
    loss = F.cross_entropy(logits, labels).item()
    accuracy = (logits.argmax(dim=1) == labels).float().mean().item()
    return loss, accuracy


def setup_distributed(args: argparse.Namespace) -> tuple[int, int, torch.device]:
    """Join the process group when launched with WORLD_SIZE > 1; return (rank, world, device)."""
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda was given but CUDA is not available; use --device cpu")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if world_size > 1:
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    return rank, world_size, device


def configure_determinism(args: argparse.Namespace) -> None:
    """Fix the thread count and, with --deterministic, allow deterministic kernels only."""
    # A fixed thread count: results of CPU kernels may depend on how work is split over threads.
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    if args.deterministic:
        # cuBLAS reads this when it creates its first handle: set it before any CUDA work.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def train(args: argparse.Namespace, rank: int, world_size: int, device: torch.device) -> None:
    """Train for --steps optimizer steps, resuming first with --resume."""
    seed_everything(args.seed + rank)  # distinct dropout per rank; DDP copies rank 0's weights

    split = load_split(args.data_dir)
    train_set = AugmentedDigits(
        split.train_images,
        split.train_labels,
        mean=split.mean,
        std=split.std,
        seed=args.seed,
        noise_std=args.noise_std,
        max_shift=args.max_shift,
    )
    val_images = split.normalise(split.val_images).flatten(1).to(device)
    val_labels = split.val_labels.to(device)
    local_batch = args.batch_size // world_size
    sampler = ResumableDistributedSampler(
        train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed, drop_last=True
    )
    steps_per_epoch = sampler.num_samples // local_batch
    if steps_per_epoch == 0:
        raise SystemExit(
            f"--batch-size {args.batch_size} is larger than the train set ({len(train_set)})"
        )

    model = DigitsMLP(hidden=args.hidden, depth=args.depth, dropout=args.dropout).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    if args.plant:
        optimizer = plant_model(args, model, optimizer, device)
    scheduler = LambdaLR(
        optimizer, warmup_cosine(min(args.warmup_steps, args.steps), args.steps, args.min_lr_ratio)
    )

    step, epoch, batch_in_epoch = 0, 0, 0
    rng_to_restore: dict[str, Any] | None = None
    if args.resume:
        state = resume_state(args, rank, world_size)
        if state is not None:
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            scheduler.load_state_dict(state["scheduler"])
            step, epoch, batch_in_epoch = state["step"], state["epoch"], state["batch_in_epoch"]
            rng_to_restore = state["rng"][rank] if len(state["rng"]) == world_size else None
            log.info(
                "resumed at step %d (epoch %d, batch %d of %d)",
                step,
                epoch,
                batch_in_epoch,
                steps_per_epoch,
            )
    if rank == 0 and args.ckpt_dir:
        remove_stale_temp_files(args.ckpt_dir)

    ddp_model: nn.Module = DistributedDataParallel(model) if world_size > 1 else model
    if rng_to_restore is not None:
        # Last thing before the loop: everything above may draw random numbers.
        restore_rng_state(rng_to_restore, device)
    log.info(
        "training %d steps: world size %d, %d samples per rank per step, %d steps per epoch",
        args.steps,
        world_size,
        local_batch,
        steps_per_epoch,
    )
    if step >= args.steps:
        log.info("the checkpoint is at step %d and --steps is %d: nothing to do", step, args.steps)
    started = time.perf_counter()
    notice = Notice()
    if args.ckpt_dir:
        notice.install()
    while step < args.steps:
        train_set.set_epoch(epoch)
        if args.plant != "set_epoch_never":
            sampler.set_epoch(epoch)
        sampler.set_start_index(batch_in_epoch * local_batch)
        loader = DataLoader(
            train_set,
            batch_size=local_batch,
            sampler=sampler,
            drop_last=True,
            num_workers=args.num_workers,
            worker_init_fn=seed_worker,
            # Its own generator, so that creating a loader never draws from the global RNG
            # (a resumed run creates one at a different moment than an uninterrupted run).
            generator=torch.Generator().manual_seed(args.seed * 100_003 + epoch),
            pin_memory=device.type == "cuda",
        )
        for images, labels in loader:
            images, labels = (
                images.to(device, non_blocking=True),
                labels.to(device, non_blocking=True),
            )
            lr = scheduler.get_last_lr()[0]
            loss = F.cross_entropy(ddp_model(images), labels)
            if args.plant != "zero_grad_missing":
                optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if args.plant == "ddp_bypassed" and step + 1 == PLANT_STEP and rank == world_size - 1:
                F.cross_entropy(model(images), labels).backward()  # outside DDP: not reduced
            if args.grad_clip > 0 and (args.plant != "clip_one_rank" or rank == 0):
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
            optimizer.step()
            scheduler.step()
            step += 1
            batch_in_epoch += 1
            if batch_in_epoch == steps_per_epoch:
                epoch, batch_in_epoch = epoch + 1, 0

            val = None
            if rank == 0 and (step % args.eval_every == 0 or step == args.steps):
                val = evaluate(model, val_images, val_labels, args.plant)
            if args.ckpt_dir and (step % args.ckpt_every == 0 or step == args.steps):
                checkpoint(
                    args,
                    model,
                    optimizer,
                    scheduler,
                    step,
                    epoch,
                    batch_in_epoch,
                    rank,
                    world_size,
                    device,
                )
            # Printed after the checkpoint: whoever reads "step N" may rely on checkpoint N.
            print(f"step {step} loss {loss.item():.6f} lr {lr:.6e}", flush=True)
            if val is not None:
                print(f"step {step} val_loss {val[0]:.6f}", flush=True)
                log.info("step %d val accuracy %.4f", step, val[1])
            if args.ckpt_dir and step < args.steps and notice.agreed(world_size, device):
                if step % args.ckpt_every:  # not saved above
                    checkpoint(args, model, optimizer, scheduler, step, epoch, batch_in_epoch, rank,
                               world_size, device)
                log.warning("notice received (signal %s): saved step %d, exiting", notice.signal, step)
                return
            if step >= args.steps:
                break
    log.info("done: %d steps in %.2fs", step, time.perf_counter() - started)


def plant_model(
    args: argparse.Namespace, model: DigitsMLP, optimizer: torch.optim.Optimizer, device: torch.device
) -> torch.optim.Optimizer:
    """The optimizer (and model) of the planted defects that change them: see --plant."""
    if args.plant == "group_dropped":
        weights = [p for name, p in model.named_parameters() if not name.endswith("bias")]
        biases = [p for name, p in model.named_parameters() if name.endswith("bias")]
        groups = [{"params": weights}, {"params": biases, "weight_decay": 0.0}]
        return torch.optim.AdamW(groups[:1], lr=args.lr, weight_decay=args.weight_decay)
    if args.plant == "head_after_optimizer":
        model.head = nn.Linear(model.head.in_features, model.head.out_features).to(device)
    if args.plant == "layer_frozen":
        model.body[0].requires_grad_(False)
    return optimizer


def resume_state(args: argparse.Namespace, rank: int, world_size: int) -> dict[str, Any] | None:
    """Load the latest valid checkpoint (chosen by rank 0 for all ranks), or None."""
    path = latest_valid_checkpoint(args.ckpt_dir) if rank == 0 else None
    if world_size > 1:
        chosen = [path]
        dist.broadcast_object_list(chosen, src=0)
        path = chosen[0]
    if path is None:
        if rank == 0:
            log.warning("--resume: no valid checkpoint in %s; starting from scratch", args.ckpt_dir)
        return None
    state = load_checkpoint(path)
    saved = state.get("config", {})
    if saved.get("batch_size", args.batch_size) != args.batch_size:
        raise SystemExit(
            f"{path} was trained with --batch-size {saved['batch_size']}, not {args.batch_size}: "
            "the data position cannot be restored; resume with the same --batch-size"
        )
    for name in ("steps", "seed"):
        if saved.get(name, getattr(args, name)) != getattr(args, name):
            log.warning(
                "%s was trained with --%s %s, now %s", path, name, saved[name], getattr(args, name)
            )
    if len(state["rng"]) != world_size:
        log.warning(
            "%s was written by %d ranks, now %d: RNG states are not restored",
            path,
            len(state["rng"]),
            world_size,
        )
    if rank == 0:
        log.info("resuming from %s", path)
    return state


def checkpoint(
    args: argparse.Namespace,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: LambdaLR,
    step: int,
    epoch: int,
    batch_in_epoch: int,
    rank: int,
    world_size: int,
    device: torch.device,
) -> None:
    """Rank 0 saves the training state with every rank's RNG state."""
    rng = capture_rng_state(device)
    if world_size > 1:
        gathered: list[Any] = [None] * world_size
        dist.all_gather_object(gathered, rng)
    else:
        gathered = [rng]
    if rank == 0:
        state = {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "step": step,
            "epoch": epoch,
            "batch_in_epoch": batch_in_epoch,  # batches of `epoch` already trained on
            "rng": gathered,
            "config": {
                "batch_size": args.batch_size,
                "steps": args.steps,
                "seed": args.seed,
                "world_size": world_size,
            },
        }
        path = save_checkpoint(state, args.ckpt_dir, step, args.keep_last)
        log.debug("saved %s", path)
    if world_size > 1:
        dist.barrier()  # no rank reports this step before its checkpoint is on disk


def main(argv: list[str] | None = None) -> int:
    """Entry point: set up logging and the process group, train, always leave the group."""
    args = parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(
        stream=sys.stderr,
        level=args.log_level.upper(),
        format=f"%(asctime)s [rank{rank}] %(levelname)s %(name)s: %(message)s",
    )
    configure_determinism(args)
    rank, world_size, device = setup_distributed(args)
    try:
        train(args, rank, world_size, device)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
