"""A fake training job whose memory grows with the batch, for the headroom search's tests.

Pure Python, no torch. It holds ``--batch-size x --mb-per-sample`` MB of touched
bytes (the "activations") and prints ``step N loss L``, so the batch that fits a memory budget is
known: (budget - the interpreter's few MB) / mb-per-sample.

--fail-above N   exits 2 with a ValueError-like message when the batch exceeds N (a non-memory
                 failure at large batches: the search must report it, not take it for OOM)
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--batch-size", type=int, required=True)
    p.add_argument("--mb-per-sample", type=float, default=1.0)
    p.add_argument("--sleep", type=float, default=0.05, help="seconds per step")
    p.add_argument("--fail-above", type=int, default=None)
    args = p.parse_args()
    rank = int(os.environ.get("RANK", "0"))
    if args.fail_above is not None and args.batch_size > args.fail_above:
        print(f"memory_train: rank {rank}: ValueError: batch {args.batch_size} is larger than "
              f"the dataset ({args.fail_above} samples)", file=sys.stderr, flush=True)
        return 2
    # every page written (b"x" * n is a memset): resident and charged, held for the whole run so
    # the launcher's 0.5 s memory samples see it too
    activations = b"\x01" * int(args.batch_size * args.mb_per_sample * 2**20)
    for step in range(1, args.steps + 1):
        time.sleep(args.sleep)
        loss = 2.0 * math.exp(-0.1 * step) + 0.0 * activations[step]
        print(f"step {step} loss {loss:.6f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
