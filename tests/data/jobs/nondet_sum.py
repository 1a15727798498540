"""A correct training job that is not bitwise deterministic, for the calibration tests.

Linear regression by gradient descent in plain Python floats, where every step sums its
per-sample terms in an order drawn from the operating system: a reduction whose order follows a
random permutation, as GPU atomics and a nondeterministic all-reduce do. Two runs with one seed
differ in the last bits of every loss; the resume is exact otherwise (the weights and the
schedule's position are checkpointed).

    python nondet_sum.py --steps 40 --seed 0 --ckpt-dir DIR [--resume] [--bug lr-behind]

``--bug lr-behind`` plants a resume bug of the size of that noise: the resumed run's learning-rate
schedule is one step behind (it counts from the checkpoint's step instead of the next one), on a
cosine schedule over ``--schedule-steps`` (a long run's schedule, so one step of it changes the
learning rate by a few parts in 10^15). ``--order fixed`` sums in one order (bitwise deterministic).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import time

SAMPLES, FEATURES = 64, 8


def _data() -> tuple[list[list[float]], list[float]]:
    rng = random.Random(1234)  # the data never depends on --seed
    truth = [rng.gauss(0, 1) for _ in range(FEATURES)]
    xs = [[rng.gauss(0, 1) for _ in range(FEATURES)] for _ in range(SAMPLES)]
    ys = [sum(a * b for a, b in zip(x, truth, strict=True)) + rng.gauss(0, 0.5) for x in xs]
    return xs, ys


def _latest(directory: str) -> tuple[int, list[float]] | None:
    found = sorted(int(m.group(1)) for n in os.listdir(directory) if (m := re.fullmatch(r"ckpt_(\d+)\.json", n)))
    if not found:
        return None
    with open(os.path.join(directory, f"ckpt_{found[-1]:06d}.json")) as f:
        state = json.load(f)
    return int(state["step"]), [float(v) for v in state["w"]]


def _save(directory: str, step: int, w: list[float]) -> None:
    final = os.path.join(directory, f"ckpt_{step:06d}.json")
    tmp = final + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"step": step, "w": w}, f)  # repr of each float: exact
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, final)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ckpt-dir", required=True)
    p.add_argument("--ckpt-every", type=int, default=5)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--lr", type=float, default=0.02)
    p.add_argument("--schedule-steps", type=float, default=3e7)
    p.add_argument("--order", choices=("random", "fixed"), default="random")
    p.add_argument("--bug", choices=("none", "lr-behind"), default="none")
    p.add_argument("--sleep", type=float, default=0.0, help="seconds per step (room for a kill)")
    args = p.parse_args()
    os.makedirs(args.ckpt_dir, exist_ok=True)
    xs, ys = _data()
    init = random.Random(args.seed)
    w = [init.gauss(0, 0.1) for _ in range(FEATURES)]
    start, behind = 1, 0
    if args.resume and (found := _latest(args.ckpt_dir)) is not None:
        done, w = found
        start, behind = done + 1, (1 if args.bug == "lr-behind" else 0)
    order = list(range(SAMPLES))
    shuffle = random.SystemRandom().shuffle  # unseeded on purpose: the nondeterminism under test
    for step in range(start, args.steps + 1):
        if args.order == "random":
            shuffle(order)
        residuals = [sum(a * b for a, b in zip(xs[i], w, strict=True)) - ys[i] for i in range(SAMPLES)]
        loss = sum(residuals[i] * residuals[i] for i in order) / SAMPLES
        grad = [sum(2 * residuals[i] * xs[i][j] for i in order) / SAMPLES for j in range(FEATURES)]
        lr = args.lr * 0.5 * (1 + math.cos(math.pi * (step - behind) / args.schedule_steps))
        w = [wj - lr * gj for wj, gj in zip(w, grad, strict=True)]
        if step % args.ckpt_every == 0:
            _save(args.ckpt_dir, step, w)
        print(f"step {step} loss {loss!r}", flush=True)
        time.sleep(args.sleep)


if __name__ == "__main__":
    main()
