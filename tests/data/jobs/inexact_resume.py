"""A job whose resume is not exact, for the compat tests: minibatch SGD on a linear model in plain
Python whose batches come from ``random.Random(seed)`` created at start. A resumed run loads the
weights and the step, but its batch generator starts again from the seed instead of where the
killed run left it, so after a resume it draws other batches than the uninterrupted run (nanoGPT
resumes the same way). Checkpoints are JSON, written atomically every ``--ckpt-every`` steps.

    python inexact_resume.py --steps 30 --seed 0 --ckpt-dir DIR [--resume] [--sleep S]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import time

SAMPLES, FEATURES, BATCH = 256, 4, 8


def data() -> tuple[list[list[float]], list[float]]:
    rng = random.Random(99)
    truth = [rng.uniform(-1, 1) for _ in range(FEATURES)]
    xs = [[rng.gauss(0, 1) for _ in range(FEATURES)] for _ in range(SAMPLES)]
    return xs, [sum(a * b for a, b in zip(x, truth, strict=True)) + rng.gauss(0, 0.3) for x in xs]


def latest(directory: str) -> dict | None:
    steps = sorted(int(m.group(1)) for n in os.listdir(directory) if (m := re.fullmatch(r"state_(\d+)\.json", n)))
    if not steps:
        return None
    with open(os.path.join(directory, f"state_{steps[-1]:05d}.json")) as f:
        return json.load(f)


def save(directory: str, state: dict) -> None:
    final = os.path.join(directory, f"state_{state['step']:05d}.json")
    with open(final + ".tmp", "w") as f:
        json.dump(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(final + ".tmp", final)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ckpt-dir", required=True)
    p.add_argument("--ckpt-every", type=int, default=5)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--sleep", type=float, default=0.0)
    args = p.parse_args()
    os.makedirs(args.ckpt_dir, exist_ok=True)
    xs, ys = data()
    batches = random.Random(args.seed)
    w, start = [0.0] * FEATURES, 1
    if args.resume and (state := latest(args.ckpt_dir)) is not None:
        w, start = state["w"], state["step"] + 1
    for step in range(start, args.steps + 1):
        picked = [batches.randrange(SAMPLES) for _ in range(BATCH)]
        residuals = [sum(a * b for a, b in zip(xs[i], w, strict=True)) - ys[i] for i in picked]
        loss = sum(r * r for r in residuals) / BATCH
        grad = [sum(2 * r * xs[i][j] for r, i in zip(residuals, picked, strict=True)) / BATCH for j in range(FEATURES)]
        w = [wj - args.lr * gj for wj, gj in zip(w, grad, strict=True)]
        if step % args.ckpt_every == 0:
            save(args.ckpt_dir, {"step": step, "w": w})
        print(f"step {step} loss {loss!r}", flush=True)
        time.sleep(args.sleep)


if __name__ == "__main__":
    main()
