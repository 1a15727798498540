"""A small torch job that is correct but not bitwise deterministic, for the end-to-end test of
``trainguard calibrate``'s per-tensor spreads (``step_spreads``) under the resume check.

One process, CPU: an MLP learns a fixed synthetic regression task with AdamW and a ``LambdaLR``
schedule (warmup, then linear decay: the lr differs at every step). Every step splits the data
into micro-batches and accumulates their gradients in an order drawn from the operating system
(``os.urandom``), as GPU atomics and a nondeterministic all-reduce sum in no fixed order: two runs
with one seed differ in the last bits of every gradient, weight and loss, and nothing else. No
generator the job seeds is drawn from after the start (the order has a generator of its own).

Every ``--ckpt-every`` steps it writes ``step_NNNNNN.pt`` (temp file + rename) holding the model,
the optimizer, the scheduler and the torch RNG state; ``--resume`` restores all of it from the
newest one, so a resumed run goes on as the uninterrupted run does, up to that noise.

    python nondet_torch.py --steps 24 --seed 0 --ckpt-dir DIR [--resume] [--plant scheduler_not_saved]

``--plant scheduler_not_saved``: the checkpoint leaves out the scheduler's state; the resumed
run's first step uses the lr the optimizer restored, its scheduler then starts the schedule again.
"""

from __future__ import annotations

import argparse
import os
import random
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

SAMPLES, FEATURES, MICRO_BATCHES = 128, 8, 8


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ckpt-dir", required=True)
    p.add_argument("--ckpt-every", type=int, default=4)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--plant", choices=("none", "scheduler_not_saved"), default="none")
    args = p.parse_args()
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    np.random.seed(args.seed)  # seeded and never drawn from: its state is the same at every step

    data = torch.Generator().manual_seed(1234)  # the data never depends on --seed
    x = torch.randn(SAMPLES, FEATURES, generator=data)
    y = (x @ torch.randn(FEATURES, 1, generator=data)).sin()
    model = nn.Sequential(nn.Linear(FEATURES, 32), nn.Tanh(), nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = LambdaLR(optimizer, lambda s: (s + 1) / 5 if s < 5 else max(0.1, 1.0 - (s - 5) / 40))
    # unseeded on purpose: the order the micro-batches' gradients are summed in (the noise under test)
    order = torch.Generator().manual_seed(int.from_bytes(os.urandom(8), "little"))

    ckpt_dir = Path(args.ckpt_dir)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    step = 0
    found = sorted(ckpt_dir.glob("step_*.pt")) if args.resume else []
    if found:
        state = torch.load(found[-1], weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        if "scheduler" in state:
            scheduler.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["rng"])
        step = int(state["step"])
    chunks = SAMPLES // MICRO_BATCHES
    while step < args.steps:
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for i in torch.randperm(MICRO_BATCHES, generator=order).tolist():
            part = slice(i * chunks, (i + 1) * chunks)
            loss = F.mse_loss(model(x[part]), y[part]) / MICRO_BATCHES
            loss.backward()  # accumulates into .grad in the order drawn
            total += loss.item()
        optimizer.step()
        scheduler.step()
        step += 1
        if step % args.ckpt_every == 0 or step == args.steps:
            state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "rng": torch.get_rng_state(),
                     "step": step}
            if args.plant != "scheduler_not_saved":
                state["scheduler"] = scheduler.state_dict()
            tmp = ckpt_dir / f".step_{step:06d}.pt.tmp"
            torch.save(state, tmp)
            os.replace(tmp, ckpt_dir / f"step_{step:06d}.pt")
        print(f"step {step} loss {total!r}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
