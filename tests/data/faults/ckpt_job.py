"""A tiny job that checkpoints after every step, in place or atomically (fault tests).

``--writer inplace`` overwrites ``latest.ckpt`` directly (the planted defect: a failed write
leaves it empty or cut short); ``--writer atomic`` writes ``latest.ckpt.tmp``, flushes, fsyncs
and renames it over ``latest.ckpt`` (a failed write leaves the previous checkpoint intact).
``--format bytes`` writes a JSON header line (step, size, sha256) and a payload, in
``--chunk-kb`` pieces with ``--chunk-sleep`` between them (a real checkpoint takes a while to
write); ``--format torch`` uses torch.save to the path.

The checkpoint of step N is written after step N and before ``step N loss L`` is printed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time


def payload(step: int, size: int) -> bytes:
    return (f"step{step:06d}".encode() * (size // 10 + 1))[:size]


def write_bytes(path: str, step: int, size: int, chunk: int, chunk_sleep: float) -> None:
    data = payload(step, size)
    header = json.dumps({"step": step, "size": size,
                         "sha256": hashlib.sha256(data).hexdigest()}).encode() + b"\n"
    with open(path, "wb") as f:
        f.write(header)
        for i in range(0, size, chunk):
            f.write(data[i:i + chunk])
            f.flush()
            if chunk_sleep:
                time.sleep(chunk_sleep)
        os.fsync(f.fileno())


def write_torch(path: str, step: int, size: int) -> None:
    import torch

    torch.save({"step": step, "w": torch.full((size // 4,), float(step))}, path)


def checkpoint(args: argparse.Namespace, step: int) -> None:
    final = os.path.join(args.ckpt_dir, "latest.ckpt")
    target = final if args.writer == "inplace" else final + ".tmp"
    if args.format == "torch":
        write_torch(target, step, args.size_kb * 1024)
    else:
        write_bytes(target, step, args.size_kb * 1024, args.chunk_kb * 1024, args.chunk_sleep)
    if args.writer == "atomic":
        fd = os.open(target, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(target, final)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--ckpt-dir", required=True)
    parser.add_argument("--writer", choices=["inplace", "atomic"], default="atomic")
    parser.add_argument("--format", choices=["bytes", "torch"], default="bytes")
    parser.add_argument("--size-kb", type=int, default=64)
    parser.add_argument("--chunk-kb", type=int, default=64)
    parser.add_argument("--chunk-sleep", type=float, default=0.0)
    parser.add_argument("--sleep", type=float, default=0.25)
    parser.add_argument("--tag", default="")
    args = parser.parse_args()
    if args.format == "torch":
        import torch  # noqa: F401  (imported before the first step, as a training job does)
    rank = int(os.environ.get("RANK", "0"))
    os.makedirs(args.ckpt_dir, exist_ok=True)
    for step in range(1, args.steps + 1):
        time.sleep(args.sleep)
        if rank == 0:
            checkpoint(args, step)
        print(f"step {step} loss {1.0 / step:.4f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
