"""disk_full determinism (not a CI test): N drills per checkpoint size and writer, each verdict
counted against what it must be (atomic: passed; in place: failed).

    .venv/bin/python tests/benchmarks/bench_disk_full.py [--runs 20] [--mode auto] [--sizes 4,100,1024,51200]

The job is tests/data/jobs/toy_train.py on one rank with one checkpoint file replaced by every
save (``--ckpt-keep-one``, a rename over it frees its space) padded to each size; the drill is
``disk_full`` after step 7 of 14, ``expect: fail_clean``. Prints, per size and writer, how many
verdicts were right and the median drill time.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from tests.helpers import report_evidence
from trainguard.config import load_config
from trainguard.drills import run_drill
from trainguard.run.runner import JobRunner

TOY = Path(__file__).resolve().parents[1] / "data" / "jobs" / "toy_train.py"
JOB = """
job:
  name: bench-disk-full
  command: "{python} {script} --steps {{steps}} --seed {{seed}} --ckpt-dir {{checkpoint_dir}} --sleep 0.05"
  resume_args: "--resume"
  metrics:
    loss: 'step (?P<step>\\d+) loss (?P<value>\\S+)'
  timeout: 120
  stall_timeout: 30
checks:
  drills:
    - {{name: disk, fault: disk_full, rank: 0, steps: 14, after_step: 7, expect: fail_clean,
       deadline: 30, params: {{mode: {mode}}}, args: '{args}'}}
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--mode", default="auto")
    parser.add_argument("--sizes", default="4,100,1024,51200", help="checkpoint sizes in KB")
    args = parser.parse_args()
    wrong = 0
    print(f"{'size':>8} {'writer':>9} {'right':>7} {'median s':>9}  modes")
    for size in (int(s) for s in args.sizes.split(",")):
        for writer in ("atomic", "inplace"):
            want = "passed" if writer == "atomic" else "failed"
            flags = f"--ckpt-keep-one --ckpt-size-kb {size}" + (" --ckpt-inplace" if writer == "inplace" else "")
            right, times, modes = 0, [], set()
            for _ in range(args.runs):
                with tempfile.TemporaryDirectory(prefix="bench-disk-full-") as tmp:
                    path = Path(tmp) / "trainguard.yaml"
                    path.write_text(JOB.format(python=sys.executable, script=TOY, mode=args.mode, args=flags))
                    job_file = load_config(path)
                    runner = JobRunner(job_file)
                    started = time.monotonic()
                    try:
                        result = run_drill(runner, job_file.checks.drills[0])
                    finally:
                        runner.close()
                    times.append(time.monotonic() - started)
                    modes.add(str(report_evidence(result).get("fault_evidence", {}).get("mode_ran")))
                    if result.status == want:
                        right += 1
                    else:
                        print(f"  wrong verdict ({size} KB, {writer}): {result.status}: {result.summary[:300]}")
            wrong += args.runs - right
            print(f"{size:>6}KB {writer:>9} {right:>3}/{args.runs:<3} {statistics.median(times):>9.2f}  "
                  f"{','.join(sorted(modes))}", flush=True)
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
