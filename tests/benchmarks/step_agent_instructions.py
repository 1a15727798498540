"""The step agent's cost in instructions per optimizer step, off vs on (docs/step-records.md,
"Overhead"): independent of the machine's load, unlike the wall-clock benchmark
(bench_step_records.py). Needs valgrind (with its headers: ``valgrind/callgrind.h``) and a C
compiler.

    .venv/bin/python tests/benchmarks/step_agent_instructions.py digits [--batch-size 32]
    .venv/bin/python tests/benchmarks/step_agent_instructions.py nanogpt [--mirror PATH]
    [--warm 6] [--steps 20] [--only on|off]

Each run is the job's own ``train.py`` in one process (digits: one rank, ``--num-workers 0``,
``--batch-size 32`` being one rank's share at world size 2; nanoGPT: the benchmark's tiny CPU
model) under ``valgrind --tool=callgrind``, the run agent installed with samples recorded either
way and the step records on or off; instructions are counted from the end of optimizer step
``--warm`` over the next ``--steps`` steps (torch's global optimizer post-hook turns counting on
and off). A run takes minutes."""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import io
import json
import os
import re
import runpy
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_CTL = ("#include <valgrind/callgrind.h>\n"
        "void cg_start(void) { CALLGRIND_ZERO_STATS; CALLGRIND_START_INSTRUMENTATION; }\n"
        "void cg_stop(void) { CALLGRIND_STOP_INSTRUMENTATION; CALLGRIND_DUMP_STATS; }\n")


def child(args: argparse.Namespace) -> None:
    """In valgrind: the job with the agent, counting ``args.steps`` steps after ``args.warm``."""
    sys.path.insert(0, str(ROOT / "trainguard" / "launch" / "hook"))
    import _trainguard_run_agent as run_agent  # type: ignore[import-not-found]

    tmp = Path(args.tmp)
    spec = {"samples_dir": str(tmp / "samples")}
    if args.child == "on":
        spec["steps_dir"] = str(tmp / "steps")
    run_agent.install(json.dumps(spec))
    ctl = ctypes.CDLL(args.ctl)
    from torch.optim.optimizer import register_optimizer_step_post_hook

    count = [0]

    def post(*_: object) -> None:
        count[0] += 1
        if count[0] == args.warm:
            ctl.cg_start()
        elif count[0] == args.warm + args.steps:
            ctl.cg_stop()

    register_optimizer_step_post_hook(post)
    total = args.warm + args.steps + 1
    if args.job == "digits":
        where = ROOT / "examples" / "digits"
        argv = ["train.py", "--steps", str(total), "--ckpt-dir", str(tmp / "ck"), "--num-workers", "0",
                "--batch-size", str(args.batch_size)]
    else:
        where = Path(args.nanogpt)
        argv = ["train.py", f"--max_iters={total}", f"--out_dir={tmp / 'ck'}", "--device=cpu", "--compile=False",
                "--eval_interval=1000000", "--log_interval=1", "--dataset=tiny", "--n_layer=2", "--n_head=2",
                "--n_embd=64", "--block_size=64", "--batch_size=8", "--dtype=float32", "--eval_iters=2",
                "--gradient_accumulation_steps=1", "--always_save_checkpoint=True"]
    sys.path.insert(0, str(where))
    os.chdir(where)
    sys.argv = argv
    with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):
        runpy.run_path("train.py", run_name="__main__")


def measure(args: argparse.Namespace, mode: str, tmp: Path, ctl: Path) -> int:
    """Instructions counted in one run of the job with the step records ``mode``."""
    out = tmp / f"callgrind.{mode}"
    cmd = ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}.%p",
           sys.executable, __file__, args.job, "--child", mode, "--tmp", str(tmp / mode), "--ctl", str(ctl),
           "--warm", str(args.warm), "--steps", str(args.steps), "--batch-size", str(args.batch_size),
           "--nanogpt", args.nanogpt]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
                          timeout=3600, check=False)
    counts = [int(m.group(1)) for path in tmp.glob(f"callgrind.{mode}.*")
              for m in re.finditer(r"^(?:totals|summary): (\d+)", path.read_text(), re.M)]
    if proc.returncode != 0 or not counts:
        sys.exit(f"the {mode} run failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return max(counts)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("job", choices=["digits", "nanogpt"])
    p.add_argument("--batch-size", type=int, default=64, help="digits' global batch (32: a rank's at world size 2)")
    p.add_argument("--warm", type=int, default=6)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--only", choices=["on", "off"])
    p.add_argument("--mirror", default="", help="nanoGPT's clone (tests/benchmarks/cause_table.py's by default)")
    p.add_argument("--child", choices=["on", "off"], help=argparse.SUPPRESS)
    p.add_argument("--tmp", help=argparse.SUPPRESS)
    p.add_argument("--ctl", help=argparse.SUPPRESS)
    p.add_argument("--nanogpt", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args)
        return
    with tempfile.TemporaryDirectory(prefix="tg-instr") as name:
        tmp = Path(name)
        (tmp / "cgctl.c").write_text(_CTL)
        ctl = tmp / "libcgctl.so"
        subprocess.run(["cc", "-shared", "-fPIC", "-o", str(ctl), str(tmp / "cgctl.c")], check=True)
        if args.job == "nanogpt":
            sys.path.insert(0, str(ROOT))
            from tests.benchmarks.cause_table import NANOGPT_MIRROR, nanogpt_job

            args.nanogpt = str(nanogpt_job(tmp, Path(args.mirror or NANOGPT_MIRROR)).parent)
        per_step = {mode: measure(args, mode, tmp, ctl) / args.steps / 1e6
                    for mode in ("off", "on") if args.only in (None, mode)}
    label = f"{args.job}" + (f" batch {args.batch_size}" if args.job == "digits" else "")
    if len(per_step) == 2:
        off, on = per_step["off"], per_step["on"]
        print(f"{label}: {off:.2f} M -> {on:.2f} M instructions a step (+{on - off:.2f} M, +{100 * (on / off - 1):.1f} %)")
    else:
        print(f"{label}: " + ", ".join(f"{mode} {value:.2f} M" for mode, value in per_step.items()))


if __name__ == "__main__":
    main()
