"""The digits MLP as a Ray Train function: ``TorchTrainer(train_func, train_loop_config=...)``.

Written the way Ray Train users write it (``ray.train.get_context``, ``prepare_model``,
``ray.train.report(metrics, checkpoint=...)``, ``ray.train.get_checkpoint()`` to resume) and run
unchanged by trainguard (see trainguard.yaml here). The model, data and sampler are the digits
example's (examples/digits/digits, on PYTHONPATH through the job file's env).

Each step reports the loss averaged over the workers, so N workers report what 1 worker would.
A checkpoint is taken every ``ckpt_every`` steps and reported with that step's metrics.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import ray.train
import ray.train.torch
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader

from digits.data import AugmentedDigits, ResumableDistributedSampler, load_split
from digits.model import DigitsMLP

DATA_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "digits", "data")


def train_func(config: dict[str, Any]) -> None:
    """Train ``config["steps"]`` optimizer steps; resume from Ray Train's latest checkpoint."""
    steps = int(config["steps"])
    seed = int(config.get("seed", 0))
    batch_size = int(config.get("batch_size", 64))
    ckpt_every = int(config.get("ckpt_every", 5))
    context = ray.train.get_context()
    rank, world_size = context.get_world_rank(), context.get_world_size()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(seed)

    split = load_split(DATA_DIR)
    train_set = AugmentedDigits(split.train_images, split.train_labels, mean=split.mean, std=split.std,
                                seed=seed, noise_std=0.05, max_shift=1)
    local_batch = batch_size // world_size
    sampler = ResumableDistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True,
                                          seed=seed, drop_last=True)
    steps_per_epoch = sampler.num_samples // local_batch
    model = DigitsMLP(hidden=128, depth=2, dropout=float(config.get("dropout", 0.0)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=float(config.get("lr", 1e-2)), weight_decay=0.01)

    step = 0
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as directory:
            state = torch.load(os.path.join(directory, "state.pt"), map_location="cpu", weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        step = int(state["step"])
        torch.set_rng_state(state["torch_rng"])
    model = ray.train.torch.prepare_model(model)

    while step < steps:
        epoch, batch_in_epoch = divmod(step, steps_per_epoch)
        train_set.set_epoch(epoch)
        sampler.set_epoch(epoch)
        sampler.set_start_index(batch_in_epoch * local_batch)
        loader = DataLoader(train_set, batch_size=local_batch, sampler=sampler, drop_last=True,
                            generator=torch.Generator().manual_seed(seed * 100_003 + epoch))
        for images, labels in loader:
            loss = F.cross_entropy(model(images), labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
            mean_loss = loss.detach().clone()
            if world_size > 1:
                dist.all_reduce(mean_loss)
                mean_loss /= world_size
            metrics = {"step": step, "loss": mean_loss.item()}
            if step % ckpt_every == 0 or step == steps:
                with tempfile.TemporaryDirectory() as directory:
                    if rank == 0:
                        inner = model.module if hasattr(model, "module") else model
                        torch.save({"model": inner.state_dict(), "optimizer": optimizer.state_dict(),
                                    "step": step, "torch_rng": torch.get_rng_state()},
                                   os.path.join(directory, "state.pt"))
                    ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(directory)
                                     if rank == 0 else None)
            else:
                ray.train.report(metrics)
            if step >= steps:
                break
