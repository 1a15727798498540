"""Train an MLP on scikit-learn's 8x8 digits with the Lightning Trainer (CPU; DDP over gloo).

    python train.py --steps 200 --ckpt-dir checkpoints
    torchrun --nproc-per-node 2 train.py --steps 200 --ckpt-dir checkpoints
    python train.py --steps 200 --ckpt-dir checkpoints --resume          # from last.ckpt

A typical Lightning script: a LightningModule (litdigits/model.py) with a shuffled DataLoader,
``seed_everything``, a ``ModelCheckpoint`` every --ckpt-every steps that also keeps ``last.ckpt``,
and ``fit(ckpt_path="last")`` on --resume. Launched by torchrun (or trainguard, which sets the same
environment), Lightning finds the torchelastic environment and runs one DDP rank per process.

Lightning restores model, optimizer, scheduler and its loop counters on resume, but neither the
RNG nor the position of a plain DataLoader: a run resumed mid-epoch re-draws the epoch's order
and trains again on samples it already saw, so it does not continue like the uninterrupted run.
--resumable-data fixes both (a checkpointed sampler position and every rank's RNG state;
litdigits/data.py), and its resume is exact. --batch-size is the global batch (per rank: batch
size / WORLD_SIZE).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy

from litdigits.model import DigitsClassifier
from litdigits.plants import PLANTS, InPlaceCheckpointIO

log = logging.getLogger("train")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse and check the command line (--batch-size against WORLD_SIZE too)."""
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--steps", type=int, default=600, help="optimizer steps (spans epochs)")
    p.add_argument("--batch-size", type=int, default=64, help="global batch, split over ranks")
    p.add_argument("--lr", type=float, default=1e-2, help="peak learning rate")
    p.add_argument("--warmup-steps", type=int, default=10)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ckpt-dir", default="checkpoints", help="ModelCheckpoint's directory")
    p.add_argument("--ckpt-every", type=int, default=5, help="checkpoint every N steps")
    p.add_argument("--eval-every", type=int, default=20, help="validate every N steps")
    p.add_argument("--resume", action="store_true", help='fit(ckpt_path="last")')
    p.add_argument(
        "--resumable-data",
        action="store_true",
        help="checkpoint the data position and every rank's RNG state (exact resume)",
    )
    p.add_argument("--plant", choices=PLANTS, help="plant a checkpointing defect (litdigits/plants.py)")
    args = p.parse_args(argv)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if args.batch_size < world_size or args.batch_size % world_size:
        p.error(
            f"--batch-size {args.batch_size} is the global batch and must be a positive multiple "
            f"of WORLD_SIZE={world_size}"
        )
    if args.plant and not args.resumable_data:
        p.error("--plant breaks the exact resume of --resumable-data; add --resumable-data")
    return args


def checkpointing(args: argparse.Namespace) -> tuple[list[pl.Callback], list[object]]:
    """The checkpoint callback and plugins: every --ckpt-every steps, a new file per step plus
    last.ckpt (Lightning writes each to a temporary file and moves it into place)."""
    if args.plant == "checkpoint_only_at_exit":
        return [], []
    if args.plant == "checkpoint_in_place":
        only_last = ModelCheckpoint(
            dirpath=args.ckpt_dir, every_n_train_steps=args.ckpt_every, save_top_k=0, save_last=True
        )
        return [only_last], [InPlaceCheckpointIO()]
    every = ModelCheckpoint(
        dirpath=args.ckpt_dir, every_n_train_steps=args.ckpt_every, save_top_k=-1, save_last=True
    )
    return [every], []


def main(argv: list[str] | None = None, callbacks: list[pl.Callback] | None = None) -> int:
    """Build the module and the Trainer, then fit (from last.ckpt with --resume)."""
    args = parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(
        stream=sys.stderr,
        level=logging.INFO,
        format=f"%(asctime)s [rank{rank}] %(levelname)s %(name)s: %(message)s",
    )
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    pl.seed_everything(args.seed, workers=True)
    model = DigitsClassifier(
        hidden=args.hidden,
        dropout=args.dropout,
        lr=args.lr,
        warmup_steps=args.warmup_steps,
        total_steps=args.steps,
        batch_size=args.batch_size,
        seed=args.seed,
        resumable_data=args.resumable_data,
        plant=args.plant,
    )
    checkpoint_callbacks, plugins = checkpointing(args)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world_size,
        strategy=DDPStrategy(process_group_backend="gloo") if world_size > 1 else "auto",
        max_steps=args.steps,
        max_epochs=-1,
        val_check_interval=args.eval_every,
        check_val_every_n_epoch=None,
        num_sanity_val_steps=0,
        deterministic=True,
        use_distributed_sampler=not args.resumable_data,
        callbacks=[*checkpoint_callbacks, *(callbacks or [])],
        plugins=plugins,
        enable_checkpointing=bool(checkpoint_callbacks),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=args.ckpt_dir,
    )
    trainer.fit(model, ckpt_path="last" if args.resume else None)
    if args.plant == "checkpoint_only_at_exit":
        trainer.save_checkpoint(os.path.join(args.ckpt_dir, "last.ckpt"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
