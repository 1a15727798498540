"""A small CUDA training job for tests/gpu: an MLP with dropout on seeded synthetic data.

Written like a user's job, knowing nothing of trainguard. Each step's batch is drawn on the
GPU from a generator seeded by (seed, step), so the data position is the step; dropout draws
from the CUDA generator, so a resume is exact only if the checkpoint brings back the CUDA RNG
state. ``--precision fp16`` trains under fp16 autocast with a ``GradScaler`` whose scale grows
every 4 clean steps, so it soon overflows and skips steps: a resume is exact only if the
scaler's state comes back too. Launched with WORLD_SIZE > 1 (or ``--dist``) it joins an NCCL
process group and trains under DDP, each rank on its slice of the global batch (``--backend gloo``:
two ranks may share one GPU). ``--param-dtype bf16`` keeps the parameters themselves in bf16.

Every ``--ckpt-every`` steps and at the end, rank 0 writes ``step_NNNNNN.pt`` (temp file,
fsync, rename; the two newest are kept). ``--resume`` loads the newest. ``--defect`` plants one
of the bugs the GPU tests must catch:

* ``no-cuda-rng``: the checkpoint holds the CPU RNG state but not the CUDA one;
* ``scaler-not-restored``: the scaler's state is saved but not loaded.

``--atomic-context`` adds each hidden column's batch sum to the features, summed with
``index_add_`` (CUDA atomics, whose order varies): a correct job that is not bitwise
deterministic, for the calibration test.

``--mem-per-sample-mb M`` keeps M MB of device memory per sample alive during each step (the
headroom search's probe job); ``--sleep S`` sleeps S seconds after each step.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

FEATURES, CLASSES = 32, 8


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--dropout", type=float, default=0.2)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--precision", choices=("fp32", "fp16"), default="fp32")
    p.add_argument("--ckpt-dir", default=None)
    p.add_argument("--ckpt-every", type=int, default=5)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--dist", action="store_true", help="join a process group even at world size 1")
    p.add_argument("--backend", choices=("nccl", "gloo"), default="nccl",
                   help="gloo: ranks may share one GPU (NCCL refuses two ranks on one device)")
    p.add_argument("--param-dtype", choices=("fp32", "bf16", "fp16"), default="fp32",
                   help="the parameters' own dtype (a bit flip in a half-precision weight)")
    p.add_argument("--mem-per-sample-mb", type=float, default=0.0)
    p.add_argument("--sleep", type=float, default=0.0)
    p.add_argument("--defect", choices=("none", "no-cuda-rng", "scaler-not-restored"), default="none")
    p.add_argument("--loss-digits", type=int, default=6, help="decimals of the printed loss")
    p.add_argument("--atomic-context", action="store_true",
                   help="add each hidden column's batch sum, taken with index_add_ (CUDA atomics: the "
                        "order of the additions varies, so runs of one seed differ in the last bits)")
    return p.parse_args()


def batch(seed: int, step: int, size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(seed * 1_000_003 + step)
    x = torch.randn(size, FEATURES, generator=g, device=device)
    teacher = torch.Generator(device=device).manual_seed(seed)
    w = torch.randn(FEATURES, CLASSES, generator=teacher, device=device)
    y = (x @ w).argmax(dim=1)
    return x, y


class AtomicContext(nn.Module):
    """``h + 0.01 * (column sums of h over the batch)``, the sums taken by ``index_add_``: every
    element added atomically into its column's slot, in an order that varies from run to run."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        columns = torch.arange(h.shape[1], device=h.device).repeat(h.shape[0])
        sums = torch.zeros(h.shape[1], device=h.device, dtype=h.dtype).index_add_(0, columns, h.flatten())
        return h + 0.01 * sums


def newest(ckpt_dir: Path) -> Path | None:
    found = sorted(ckpt_dir.glob("step_*.pt"))
    return found[-1] if found else None


def save(ckpt_dir: Path, step: int, state: dict) -> None:
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    final = ckpt_dir / f"step_{step:06d}.pt"
    tmp = final.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, final)
    for old in sorted(ckpt_dir.glob("step_*.pt"))[:-2]:
        old.unlink()


def main() -> None:
    args = parse()
    if not torch.cuda.is_available():
        raise SystemExit("cuda_train.py needs a CUDA GPU")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    # ranks beyond the devices share them (gloo allows two ranks on one GPU; NCCL does not)
    device = torch.device("cuda", local_rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    distributed = world > 1 or args.dist
    if distributed:
        dist.init_process_group(args.backend, **({"device_id": device} if args.backend == "nccl" else {}))
    torch.manual_seed(args.seed)
    torch.cuda.manual_seed(args.seed + rank)

    first = nn.Linear(FEATURES, args.hidden)
    if args.atomic_context:
        first = nn.Sequential(first, AtomicContext())
    model = nn.Sequential(
        first, nn.ReLU(), nn.Dropout(args.dropout),
        nn.Linear(args.hidden, args.hidden), nn.ReLU(), nn.Dropout(args.dropout),
        nn.Linear(args.hidden, CLASSES),
    ).to(device, dtype={"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.param_dtype])
    if distributed:
        model = nn.parallel.DistributedDataParallel(model, device_ids=[device.index])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    fp16 = args.precision == "fp16"
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0**16, growth_interval=4) if fp16 else None

    ckpt_dir = Path(args.ckpt_dir) if args.ckpt_dir else None
    start = 0
    if args.resume and ckpt_dir is not None and (path := newest(ckpt_dir)) is not None:
        state = torch.load(path, map_location="cpu", weights_only=True)
        (model.module if distributed else model).load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["rng"]["cpu"])
        if "cuda" in state["rng"]:
            torch.cuda.set_rng_state(state["rng"]["cuda"], device)
        if scaler is not None and args.defect != "scaler-not-restored":
            scaler.load_state_dict(state["scaler"])
        start = state["step"]
        if rank == 0:
            print(f"resumed from {path.name} at step {start}", flush=True)

    local = args.batch_size // world
    for step in range(start + 1, args.steps + 1):
        x, y = batch(args.seed, step, args.batch_size, device)
        x = x.to(next(model.parameters()).dtype)
        x, y = x[rank * local:(rank + 1) * local], y[rank * local:(rank + 1) * local]
        ballast = (torch.ones(int(args.mem_per_sample_mb * 2**20 * x.shape[0]), dtype=torch.uint8, device=device)
                   if args.mem_per_sample_mb > 0 else None)
        with torch.autocast("cuda", dtype=torch.float16, enabled=fp16):
            loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        else:
            loss.backward()
            optimizer.step()
        del ballast
        global_loss = loss.detach().clone()
        if distributed:
            dist.all_reduce(global_loss)
            global_loss /= world
        if ckpt_dir is not None and rank == 0 and (step % args.ckpt_every == 0 or step == args.steps):
            rng = {"cpu": torch.get_rng_state()}
            if args.defect != "no-cuda-rng":
                rng["cuda"] = torch.cuda.get_rng_state(device)
            module = model.module if distributed else model
            state = {"model": module.state_dict(), "optimizer": optimizer.state_dict(), "step": step, "rng": rng}
            if scaler is not None:
                state["scaler"] = scaler.state_dict()
            save(ckpt_dir, step, state)
        if rank == 0:
            scale = f" scale {scaler.get_scale():.0f}" if scaler is not None else ""
            print(f"step {step} loss {global_loss.float().item():.{args.loss_digits}f}{scale}", flush=True)
        if args.sleep:
            time.sleep(args.sleep)
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
