"""A fake trainer for trainguard's own tests (pure Python, fast) that checkpoints and resumes as the
Hugging Face Trainer does: every ``--save-every`` steps a ``checkpoint-N/`` directory under
``--output-dir`` whose ``trainer_state.json`` is written last; it resumes only from the directory
``--resume-from PATH`` names (what ``{latest_checkpoint}`` fills) and prints that path.

``--die-at K`` (repeatable): exit 3 at step K, once per K (a marker file remembers it), so a
restarted attempt goes past it. ``--crash-at K``: exit 3 at step K on every attempt (a poison
batch: a crash loop). ``--no-save``: never checkpoints. ``--weights-bytes N``: pads
``weights.json`` to about N bytes (a file over a read limit). ``--resume-defect drift``: a resumed
run prints a loss 1e-6 off (a resume bug the metrics show); ``--resume-defect state``: a resumed run
saves other weights while its loss matches (a resume bug only the final checkpoint shows);
``--resume-defect forget``: a resumed run ignores the checkpoint and starts again from step 1.
``--resume-latest``: resume from the newest complete ``checkpoint-N/`` under ``--output-dir`` by
itself (a job restarted by torchrun, which passes no resume arguments).
``--nondet``: the loss carries unseeded noise of about 1e-7 (two runs with one seed differ).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--output-dir", required=True)
    p.add_argument("--resume-from", default=None)
    p.add_argument("--save-every", type=int, default=2)
    p.add_argument("--sleep", type=float, default=0.05)
    p.add_argument("--die-at", type=int, action="append", default=[])
    p.add_argument("--crash-at", type=int, default=None)
    p.add_argument("--resume-latest", action="store_true")
    p.add_argument("--no-save", action="store_true")
    p.add_argument("--weights-bytes", type=int, default=0)
    p.add_argument("--resume-defect", choices=["none", "drift", "state", "forget"], default="none")
    p.add_argument("--nondet", action="store_true")
    args = p.parse_args()
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    start = 0
    if args.resume_latest and args.resume_from is None:
        done = [d for d in out.glob("checkpoint-*") if (d / "trainer_state.json").exists()]
        if done:
            args.resume_from = str(max(done, key=lambda d: int(d.name.split("-")[1])))
    resumed = args.resume_from is not None
    if resumed and args.resume_defect == "forget":
        resumed = False
    if resumed:
        print(f"resuming from {args.resume_from}", flush=True)
        start = json.loads((Path(args.resume_from) / "trainer_state.json").read_text())["global_step"]
    for step in range(start + 1, args.steps + 1):
        marker = out / f"died-at-{step}"
        if step in args.die_at and not marker.exists():
            marker.touch()
            print(f"dying at step {step}", file=sys.stderr, flush=True)
            return 3
        if step == args.crash_at:
            print(f"crashing at step {step}", file=sys.stderr, flush=True)
            return 3
        if step % args.save_every == 0 and not args.no_save:
            folder = out / f"checkpoint-{step}"
            folder.mkdir(exist_ok=True)
            w = 1.0 / step + (1e-3 if resumed and args.resume_defect == "state" else 0.0)
            (folder / "weights.json").write_text(json.dumps({"w": w, "pad": "x" * args.weights_bytes}))
            (folder / "trainer_state.json").write_text(json.dumps({"global_step": step}))
        drift = 1e-6 if resumed and args.resume_defect == "drift" else 0.0
        drift += random.SystemRandom().uniform(1e-7, 2e-7) if args.nondet else 0.0
        print(f"step {step} loss {1.0 / step + drift:.9f}", flush=True)
        time.sleep(args.sleep)
    return 0


if __name__ == "__main__":
    sys.exit(main())
