"""A fake epoch-based training script for trainguard's own tests: pure Python, no torch, fast.

Like many real scripts it has no option for a number of steps: it trains ``--epochs`` epochs of
``--batches`` batches each (1000 epochs by default: longer than any test waits), prints
``| epoch E | step S | loss X`` after every batch (S counts batches over the epochs, from 1),
and saves a checkpoint at the end of each epoch only (``--ckpt-dir``). trainguard must end its
runs itself (``job.stop_after_steps``). The loss is a decaying curve plus noise from an RNG
seeded with ``--seed``; ``--nondet`` leaves that RNG unseeded (determinism must fail).
``--resume`` starts after the newest checkpoint's step. It reads RANK (0 without it).
``--start-delay S R`` sleeps S seconds before the first step (its imports, a data load), R more
on every rank but 0 (the start-up of ranks that share no collective is not in step).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=1000)
    parser.add_argument("--batches", type=int, default=50, help="batches per epoch")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ckpt-dir", default="")
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--nondet", action="store_true")
    parser.add_argument("--sleep", type=float, default=0.01)
    parser.add_argument("--start-delay", type=float, nargs=2, default=(0.0, 0.0))
    args = parser.parse_args()
    rank = int(os.environ.get("RANK", "0"))
    time.sleep(args.start_delay[0] + (args.start_delay[1] if rank else 0.0))
    rng = random.Random() if args.nondet else random.Random(args.seed * 1000 + rank)
    step = 0
    ckpt = Path(args.ckpt_dir) if args.ckpt_dir else None
    if args.resume and ckpt is not None:
        saved = sorted(ckpt.glob(f"rank{rank}-step*.json"), key=lambda p: int(p.stem.split("step")[1]))
        if saved:
            state = json.loads(saved[-1].read_text())
            step, rng = state["step"], random.Random()
            rng.setstate((state["rng"][0], tuple(state["rng"][1]), state["rng"][2]))
    for epoch in range(step // args.batches + 1, args.epochs + 1):
        for _ in range(step % args.batches, args.batches):
            step += 1
            time.sleep(args.sleep)
            loss = 2.0 * math.exp(-0.05 * step) + 0.1 * rng.random()
            print(f"| epoch {epoch} | step {step} | loss {loss:.6f}", flush=True)
        if ckpt is not None:
            ckpt.mkdir(parents=True, exist_ok=True)
            tmp = ckpt / f".rank{rank}-step{step}.json"
            tmp.write_text(json.dumps({"step": step, "rng": rng.getstate()}))
            tmp.rename(ckpt / f"rank{rank}-step{step}.json")


if __name__ == "__main__":
    main()
