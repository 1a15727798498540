"""Golden reports: what trainguard writes for a fixed set of checks and drills, kept to prove that
a change of structure changed no behaviour (issue 25).

Each case writes a job file of the toy job (``tests/data/jobs/toy_train.py``) or the digits
example into a temp directory and runs the CLI in a subprocess -- ``trainguard validate --json``,
``check``, ``drill``, ``gate`` -- the interfaces the report readers depend on, so nothing here
calls trainguard's internals. The outputs are normalized (:func:`normalize`) and compared field
by field with ``tests/golden/<case>.json``:

* every key path, and the JSON type of every value, must be the same;
* every value must be equal, except the fields that differ between two runs of the same code on
  a loaded machine (:data:`VOLATILE`: durations, rates, pids, ports, paths, where a kill landed);
  those keep their type only. Numbers inside strings (summaries) are masked for the same reason;
  the numbers themselves sit in the evidence and are compared there.

``python tests/golden/golden.py --write [CASE ...]`` writes the golden files (run it on the code
before a change); the test (``tests/golden/test_golden_reports.py``) compares.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = Path(__file__).resolve().parent
TOY = ROOT / "tests" / "data" / "jobs" / "toy_train.py"
DIGITS = ROOT / "examples" / "digits"

#: keys whose values differ between two runs of one commit: compared by type only. Each was
#: seen to differ (times, rates, system facts) or depends on where a signal landed in a stream
#: of lines read under load (kill and resume steps, restarts, lags)
VOLATILE = frozenset({
    "created_at", "host", "tracking_uri", "trainguard_version", "job_file", "path", "pid", "pids",
    "port", "run_dir", "run_dirs", "reference_run_dir", "checkpoint_dir", "log", "logs", "stderr",
    "stdout", "cwd", "command", "reproduce", "python", "platform", "machine", "git", "commit",
    "dirty", "estimate_s", "estimate_from", "last_duration_s", "killed_after_step", "resumed_from_step",
    "steps_lost", "lost_steps", "restarts", "attempts", "first_step_after_restart",
    "detected_after_s", "fault_step", "injected_after_step", "last_step_before_fault",
    "max_rss_mb", "peak_memory_mb", "memory_mb", "rss_mb", "rank_stderr_tail", "stacks",
    "step_times", "hang_evidence", "evidence_dir", "samples", "seconds", "wall_s", "timings",
    "lost", "last_step_before", "file", "watched_rank_step_at_injection", "compared_steps", "beside",
    # the gate's cost: the launches' order follows the lane's timing, their seconds the machine
    "records", "rank_seconds", "startup_share", "gpu_hours", "steps_gpu_hours", "step_seconds", "note",
    "startup_s_per_launch",
    # the seconds each check that launched nothing spent reading another check's run
    "reads",
    # where the read of a step line let a checkpoint be kept (as where a kill landed)
    "stopped_after_step",
})
VOLATILE_SUFFIXES = ("_s", "_ms", "_at", "_rate", "_per_s", "_mb", "_path", "_dir", "_pid", "_time",
                     "_sha256")
NUMBER = re.compile(r"(?<![A-Za-z_])-?\d+(?:\.\d+)?(?:e[-+]?\d+)?")
#: the ``-<attempt>`` a run directory's name gets when another run of the same label was
#: created in the same second (launch/rundir.py): as volatile as its time stamp
RUN_DIR_SUFFIX = re.compile(r"(/runs/<n><n>-[^/'\s]*?)-<n>(?:-?<n>)*(?=$|[/'\s])")


def _volatile(key: str) -> bool:
    return key in VOLATILE or key.endswith(VOLATILE_SUFFIXES)


def normalize(value: Any, tmp: str = "") -> Any:
    """``value`` with volatile fields replaced by ``<type>``, paths under ``tmp`` by ``<tmp>``
    and numbers in strings by ``<n>``. Normalizing twice changes nothing, so a golden file
    written before a field was found volatile is normalized again when it is read."""
    if isinstance(value, dict):  # a key may be a path (a run directory) too
        return {(normalize(k, tmp) if "/" in k else k): (_type(v) if _volatile(k) else normalize(v, tmp))
                for k, v in value.items()}
    if isinstance(value, list):
        return [normalize(v, tmp) for v in value]
    if isinstance(value, str):
        text = value.replace(tmp, "<tmp>") if tmp else value
        text = text.replace(sys.executable, "<python>").replace(str(ROOT), "<repo>")
        return RUN_DIR_SUFFIX.sub(r"\1", NUMBER.sub("<n>", text))
    if isinstance(value, float):
        return round(value, 9)
    return value


def _type(value: Any) -> str:
    if isinstance(value, str) and value.startswith("<") and value.endswith(">"):
        return value  # already a placeholder
    return f"<{type(value).__name__}>" if value is not None else "<None>"


def differences(golden: Any, now: Any, where: str = "$") -> list[str]:
    """Every field where ``now`` differs from ``golden``: a key added or gone, a type or a value."""
    if isinstance(golden, dict) and isinstance(now, dict):
        out = [f"{where}.{k}: gone" for k in golden if k not in now]
        out += [f"{where}.{k}: new" for k in now if k not in golden]
        for k in golden.keys() & now.keys():
            out += differences(golden[k], now[k], f"{where}.{k}")
        return out
    if isinstance(golden, list) and isinstance(now, list):
        if len(golden) != len(now):
            return [f"{where}: {len(golden)} items, now {len(now)}"]
        return [d for i, (g, n) in enumerate(zip(golden, now, strict=True)) for d in differences(g, n, f"{where}[{i}]")]
    if golden != now:
        return [f"{where}: {golden!r} -> {now!r}"]
    return []


# ---------------------------------------------------------------------------------------------
# the cases


#: the toy job run as a DDP job behaves: each step ends in a barrier of both ranks (--sync-dir, the
#: all-reduce), and a resume loads the newest step that every rank saved (--ckpt-verify fallback,
#: a checkpoint complete only once every rank's shard is written). Without them the two ranks
#: ran apart: a loaded machine started rank 0 late, the kill after rank 1's step 8 came before
#: rank 0's first checkpoint, and the drills rightly found that the resume began at step 1
TOY_FLAGS = "--sleep 0.02 --sync-dir {run_dir}/sync --ckpt-verify fallback"


def _toy_job(where: Path, checks: str, *, gate: str = "") -> Path:
    path = where / "trainguard.yaml"
    path.write_text(
        "job:\n"
        "  name: golden-toy\n"
        f'  command: "{sys.executable} {TOY} --steps {{steps}} --seed {{seed}} --ckpt-dir {{checkpoint_dir}} {TOY_FLAGS}"\n'
        '  resume_args: "--resume"\n'
        "  world_size: 2\n"
        '  env: {OMP_NUM_THREADS: "1"}\n'
        "  metrics:\n"
        "    loss: 'step (?P<step>\\d+) loss (?P<value>\\S+)'\n"
        "  timeout: 60\n"
        "  stall_timeout: 20\n"
        f"checks:\n{checks}{gate}"
    )
    return path


TOY_CHECKS = (
    "  smoke: {steps: 5}\n"
    "  canary: {steps: 12, min_loss_drop: 0.05}\n"
    "  determinism: {steps: 12}\n"
    "  resume: {steps: 30, after_step: 12}\n"
    "  parallel: {steps: 12, world_size: 2}\n"
    "  drills:\n"
    "    - {name: kill, fault: kill_rank, rank: 1, steps: 30, after_step: 8}\n"
    "    - {name: die, fault: kill_rank, rank: 1, steps: 30, after_step: 8, expect: fail_clean}\n"
)
TOY_GATE = "gate:\n  require: [smoke, determinism, drills]\n"


def _digits(where: Path) -> Path:
    job = where / "digits"
    shutil.copytree(DIGITS, job, ignore=shutil.ignore_patterns(".trainguard", "__pycache__", "data"))
    (job / "data").symlink_to(DIGITS / "data")
    return job / "trainguard.yaml"


@dataclass(frozen=True)
class Case:
    """One golden file: the commands run on one job file, each output normalized."""

    name: str
    make_job: Callable[[Path], Path]
    #: (label, argv after the job file, the JSON the command leaves: "stdout" or a path in the
    #: job's directory)
    commands: tuple[tuple[str, tuple[str, ...], str], ...]
    slow: bool = False


CASES = {
    case.name: case for case in (
        Case("toy", lambda d: _toy_job(d, TOY_CHECKS, gate=TOY_GATE), (
            ("validate", ("validate", "{job}", "--json"), "stdout"),
            ("check", ("check", "{job}", "-q", "--report-json", "{dir}/check.json"), "check.json"),
            ("drill", ("drill", "{job}", "--report-json", "{dir}/drill.json"), "drill.json"),
            ("gate", ("gate", "{job}", "-q"), ".trainguard/gate/latest.json"),
        )),
        Case("digits", _digits, (
            ("validate", ("validate", "{job}", "--json"), "stdout"),
            ("check", ("check", "{job}", "-q", "--only", "smoke", "--only", "canary", "--only", "determinism",
                       "--only", "resume", "--only", "parallel", "--report-json", "{dir}/check.json"), "check.json"),
            ("drill", ("drill", "{job}", "--only", "kill-rank1", "--report-json", "{dir}/drill.json"),
             "drill.json"),
        ), slow=True),
    )
}


def run_case(case: Case, timeout: float = 900.0) -> dict[str, Any]:
    """Run every command of ``case`` in a fresh temp directory; label -> normalized output."""
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix=f"tg-golden-{case.name}-") as tmp:
        job = case.make_job(Path(tmp))
        env = {**os.environ, "TRAINGUARD_TRACKING": "off", "TRAINGUARD_SEED": "0"}
        for label, argv, where in case.commands:
            args = [a.format(job=job, dir=job.parent) for a in argv]
            done = subprocess.run([sys.executable, "-m", "trainguard.cli", *args], cwd=job.parent, env=env,
                                  capture_output=True, text=True, timeout=timeout, check=False)
            text = done.stdout if where == "stdout" else (job.parent / where).read_text(encoding="utf-8")
            try:
                data = json.loads(text)
            except ValueError:
                raise AssertionError(f"{label}: no JSON (exit {done.returncode}):\n{done.stdout[-2000:]}\n"
                                     f"{done.stderr[-2000:]}") from None
            out[label] = {"exit": done.returncode, "output": normalize(data, tmp)}
    return out


def golden_path(name: str) -> Path:
    return GOLDEN / f"{name}.json"


def main(argv: list[str]) -> int:
    if not argv or argv[0] != "--write":
        print(__doc__)
        return 2
    for name in argv[1:] or list(CASES):
        data = run_case(CASES[name])
        golden_path(name).write_text(json.dumps(data, indent=1, sort_keys=True) + "\n", encoding="utf-8")
        print(f"wrote {golden_path(name)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
