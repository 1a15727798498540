"""A job that counts its steps from 0, as nanoGPT does (`iter 0: loss ...` through `iter N`), with
no torch: a checkpoint named without a step (`ckpt.json`, replaced atomically every 3 steps).
``--ignore-ckpt`` is the planted defect: a resumed run begins again at iter 0. ``--strict-resume``
is nanoGPT's `--init_from=resume`: without a checkpoint the resumed run dies (FileNotFoundError).
``--exclusive`` prints iter 0 through steps - 1, as a script whose steps are epochs 0..N-1."""

import argparse
import json
import os
import time

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, required=True)
parser.add_argument("--out", required=True)
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--resume", action="store_true")
parser.add_argument("--ignore-ckpt", action="store_true")
parser.add_argument("--strict-resume", action="store_true")
parser.add_argument("--exclusive", action="store_true", help="print iter 0 through steps - 1 (epochs 0..N-1)")
args = parser.parse_args()

os.makedirs(args.out, exist_ok=True)
path = os.path.join(args.out, "ckpt.json")
state = {"iter": 0, "w": 1.0 + args.seed}
if args.resume and not args.ignore_ckpt and (args.strict_resume or os.path.exists(path)):
    with open(path) as handle:
        state = json.load(handle)
    state["iter"] += 1
while state["iter"] < args.steps + (0 if args.exclusive else 1):
    state["w"] *= 0.9
    print(f"iter {state['iter']}: loss {state['w']:.6f}", flush=True)
    if state["iter"] % 3 == 0 and state["iter"] > 0:
        with open(path + ".tmp", "w") as handle:
            json.dump(state, handle)
        os.replace(path + ".tmp", path)
    time.sleep(0.05)
    state["iter"] += 1
