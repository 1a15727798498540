"""A tiny job for the oom fault tests: prints ``step N loss L`` every ``--sleep`` seconds.

``--torch`` imports torch and allocates ``--leak-mb`` per step that it keeps (a job whose memory
grows); ``--catch`` catches ``torch.OutOfMemoryError`` in the training loop, reports it and
carries on (a job that handles its own OOMs). Without ``--torch`` nothing but Python runs (the
cgroup tests need no torch: the start-up hook's ballast does the allocating).
"""

from __future__ import annotations

import argparse
import sys
import time


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--sleep", type=float, default=0.25)
    parser.add_argument("--torch", action="store_true")
    parser.add_argument("--leak-mb", type=int, default=0)
    parser.add_argument("--catch", action="store_true")
    parser.add_argument("--tag", default="")
    args = parser.parse_args()
    kept = []
    oom_error: type[BaseException] = MemoryError
    if args.torch:
        import torch

        oom_error = torch.OutOfMemoryError
    for step in range(1, args.steps + 1):
        try:
            time.sleep(args.sleep)
            if args.leak_mb:
                kept.append(torch.ones(args.leak_mb * 2**18))  # float32: leak_mb MB
        except oom_error as exc:
            if not args.catch:
                raise
            print(f"caught {type(exc).__name__} at step {step}: {exc}; skipping the batch",
                  file=sys.stderr, flush=True)
            continue
        print(f"step {step} loss {1.0 / step:.4f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
