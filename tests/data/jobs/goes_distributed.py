"""A one-process training script in the style of nanoGPT's train.py: it takes its DDP branch
when it sees RANK in the environment (torchrun's contract), and that branch needs NCCL and GPUs.
On a CPU machine it dies there the way torch does; run as a plain script it trains.

    python goes_distributed.py --steps N
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    ddp = int(os.environ.get("RANK", -1)) != -1
    if ddp:  # nanoGPT: init_process_group(backend="nccl"); torch.cuda.set_device(...)
        raise RuntimeError("ProcessGroupNCCL is only supported with GPUs, no GPUs found!")
    seen = {k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "LOCAL_RANK") if k in os.environ}
    print("env " + json.dumps(seen), flush=True)
    for step in range(1, args.steps + 1):
        print(f"step {step} loss {1.0 / step:.6f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
