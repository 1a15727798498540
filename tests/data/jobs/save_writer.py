"""A tiny job whose only point is how it writes its checkpoint (tests of checks.crash_points).

Pure Python (it starts in a few hundredths of a second): the state is a number updated each
step; the loss printed is the state. Every ``--every`` steps it saves ``{"step", "w", "pad"}`` as
JSON (``pad`` spreads it over 3 writes of 4 KiB) to ``ckpt.json`` with ``--writer``:

* ``atomic``: a temp file, written, fsynced, renamed over ``ckpt.json``, the directory fsynced;
* ``rename``: a temp file, written and renamed, no fsync (safe from a process crash, not from a
  power loss);
* ``inplace``: ``ckpt.json`` truncated and written in place;
* ``unlink-first``: the old ``ckpt.json`` deleted, then the new one written atomically.

``--resume`` loads ``ckpt.json`` if there is one (a torn one fails to parse: the job dies).
``--inexact-resume`` plants a resume that never matches the uninterrupted run (the state it
loads is nudged by 1e-6), however the checkpoint was written.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

CHUNK = 4096


def write_all(path: str, data: bytes, *, sync: bool) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for i in range(0, len(data), CHUNK):
            os.write(fd, data[i:i + CHUNK])
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)


def sync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save(ckpt_dir: str, step: int, w: float, writer: str) -> None:
    final = os.path.join(ckpt_dir, "ckpt.json")
    state = {"step": step, "w": w}
    data = json.dumps({**state, "pad": "x" * (3 * CHUNK - len(json.dumps(state)) - 12)}).encode()
    if writer == "inplace":
        write_all(final, data, sync=False)
        return
    if writer == "unlink-first" and os.path.exists(final):
        os.unlink(final)
    tmp = final + ".tmp"
    careful = writer in ("atomic", "unlink-first")
    write_all(tmp, data, sync=careful)
    os.replace(tmp, final)
    if careful:
        sync_dir(ckpt_dir)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ckpt-dir", required=True)
    p.add_argument("--every", type=int, default=5)
    p.add_argument("--writer", choices=("atomic", "rename", "inplace", "unlink-first"), default="atomic")
    p.add_argument("--sleep", type=float, default=0.02)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--inexact-resume", action="store_true")
    args = p.parse_args()
    os.makedirs(args.ckpt_dir, exist_ok=True)
    done, w = 0, 1.0 + args.seed
    path = os.path.join(args.ckpt_dir, "ckpt.json")
    if args.resume and os.path.exists(path):
        with open(path) as f:
            state = json.load(f)  # a torn checkpoint raises here
        done, w = int(state["step"]), float(state["w"]) + (1e-6 if args.inexact_resume else 0.0)
    for step in range(done + 1, args.steps + 1):
        w = w * 0.9 + 0.01 * step
        time.sleep(args.sleep)
        if step % args.every == 0:
            save(args.ckpt_dir, step, w, args.writer)
        print(f"step {step} loss {w:.10f}", flush=True)
    sys.exit(0)


if __name__ == "__main__":
    main()
