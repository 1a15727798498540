"""A small fast Ray Train function for trainguard's own Ray tests (tests/ray/test_ray_drills.py).

It behaves like a Ray Train user's function as trainguard sees one: every step all-reduces its
loss over the workers (a real gloo collective, so a stopped worker blocks its peers), reports
``{"step": n, "loss": x}`` with ``ray.train.report`` and, every ``ckpt_every`` steps, a checkpoint
(rank 0 writes ``state.json``); ``ray.train.get_checkpoint()`` resumes it. The loss is a decaying
curve plus noise from an RNG seeded with ``seed`` and the step, so two runs with the same seed
report identical values whatever their restarts. No model: a fit costs Ray's start-up, not
training.

Config keys: ``steps``, ``seed``, ``ckpt_every`` (3), ``sleep`` (seconds per step, 0.2),
``ballast_mb`` (memory each worker holds, 0), and planted defects: ``ignore_checkpoint`` (never
resume), ``swallow_checkpoint_errors`` (a failed checkpoint report is caught and training goes
on without it), ``sync_mlflow`` (rank 0 logs the loss with MLflow's fluent API,
``mlflow.log_metric``, inside the loop: a synchronous call to the store at
``MLFLOW_TRACKING_URI`` each step, so a slow tracking server slows training; the network drill
must catch it -- only when ``MLFLOW_TRACKING_URI`` is set, so no ``./mlruns`` is written here).
"""

from __future__ import annotations

import json
import math
import os
import random
import tempfile
import time
from typing import Any

import ray.train
import torch
import torch.distributed as dist


def train_func(config: dict[str, Any]) -> None:
    """Report ``config["steps"]`` steps, resuming from Ray Train's latest checkpoint."""
    steps = int(config["steps"])
    seed = int(config.get("seed", 0))
    ckpt_every = int(config.get("ckpt_every", 3))
    sleep = float(config.get("sleep", 0.2))
    context = ray.train.get_context()
    rank, world_size = context.get_world_rank(), context.get_world_size()
    ballast = bytearray(int(config.get("ballast_mb", 0)) * 2**20)  # noqa: F841 -- held on purpose
    sync_mlflow = bool(config.get("sync_mlflow")) and rank == 0 and bool(os.environ.get("MLFLOW_TRACKING_URI"))
    if sync_mlflow:
        import mlflow

    step, weight = 0, 1.0
    checkpoint = None if config.get("ignore_checkpoint") else ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as directory, open(os.path.join(directory, "state.json")) as f:
            state = json.load(f)
        step, weight = int(state["step"]), float(state["weight"])

    while step < steps:
        step += 1
        time.sleep(sleep)
        noise = random.Random(seed * 1_000_003 + step).gauss(0.0, 0.01)
        weight *= 0.9
        local = torch.tensor([weight + noise + 0.001 * rank], dtype=torch.float64)
        if world_size > 1 and dist.is_initialized():
            dist.all_reduce(local)
            local /= world_size
        loss = round(float(local.item()), 10) + math.exp(-step / 10)
        metrics = {"step": step, "loss": loss}
        if step % ckpt_every == 0 or step == steps:
            with tempfile.TemporaryDirectory() as directory:
                if rank == 0:
                    with open(os.path.join(directory, "state.json"), "w") as f:
                        json.dump({"step": step, "weight": weight}, f)
                try:
                    ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(directory)
                                     if rank == 0 else None)
                except Exception as exc:
                    if not config.get("swallow_checkpoint_errors"):
                        raise
                    print(f"checkpoint at step {step} failed, going on without it: {exc}", flush=True)
                    ray.train.report(metrics)
        else:
            ray.train.report(metrics)
        if sync_mlflow:
            mlflow.log_metric("loss", loss, step=step)  # the defect: blocks on the store
