"""The cause table (issue 44): every planted resume, chained-resume, parallel, reshard, compat,
drill and crash-point defect of the project's examples and test jobs, run through the library
(``trainguard.session.check``) from a temporary directory, with the cause each check names first.

    .venv/bin/python -m tests.benchmarks.cause_table [--out FILE.md] [--only SUBSTRING ...] [--list]

Prints a markdown table: check, job, planted defect, the cause named first (its key and text),
the evidence it cites, and the verdict (the check's status, and whether the planted cause is the
one named first). The planted defects come from the tests' own tables (imported, never copied):
tests/distributed/test_digits_checks.py, test_hf_example.py, test_lightning_example.py,
test_fsdp2_checks.py, test_reshard.py, test_compat.py, test_drills_e2e.py, test_crash_points.py,
test_sched_job.py and tests/unit/test_resume_chain.py; the nanoGPT row runs karpathy/nanoGPT's
train.py unmodified (from a local mirror, ``TRAINGUARD_NANOGPT_MIRROR``; skipped without one).

Each row runs in a process of its own (``--row ID``), in a session of its own, killed with all
it started after ``--timeout`` seconds (default: the row's own); a row that errors, times out or
lacks what it needs (an extra, FUSE, the mirror) is a row saying so. ``--only`` keeps the rows
whose id (``job/check/defect``) holds one of the substrings. Rows run one at a time.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from importlib.util import find_spec
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
JOBS = ROOT / "tests" / "data" / "jobs"
NANOGPT_MIRROR = Path(os.environ.get("TRAINGUARD_NANOGPT_MIRROR", "/work/.mirror/karpathy+nanoGPT/repo"))

HF = ("transformers", "accelerate", "tokenizers")
LIGHTNING = ("lightning", "sklearn")
FSDP = ("torchdata",)


@dataclass(frozen=True)
class Row:
    """One planted defect: how to build its job under a temporary folder, which check to run and
    the cause it must name first (a diagnosis key, or words the cause's text or evidence hold)."""

    check: str
    job: str
    defect: str
    expected: str
    build: Callable[[Path], Path]
    only: str
    needs: tuple[str, ...] = ()
    fuse: bool = False
    timeout_s: int = 600

    @property
    def id(self) -> str:
        return f"{self.job}/{self.check}/{self.defect}"


def _sched_rows() -> list[Row]:
    from tests.distributed.test_sched_job import PLANTS, job_file

    return [Row("resume", "sched_train.py", plant, cause, lambda t, p=plant: job_file(t, f"--plant {p}"), "resume",
                timeout_s=300) for plant, cause in PLANTS.items()]


def _digits_rows() -> list[Row]:
    from tests.distributed.test_digits_checks import JOB_FILE, RESUME_BUGS, SAME_SHARD
    from tests.distributed.test_reshard import DIGITS
    from tests.helpers import patched_copy

    example = ROOT / "examples" / "digits"
    rows = [Row("resume", "examples/digits", bug, cause,
                lambda t, b=bug: patched_copy(example, t / "digits", RESUME_BUGS[b][0], JOB_FILE), "resume")
            for bug, (_, _, cause) in RESUME_BUGS.items()]
    rows.append(Row("parallel", "examples/digits", "same_shard", "same shard",
                    lambda t: patched_copy(example, t / "digits", SAME_SHARD, JOB_FILE), "parallel"))
    # dropout on: 2 ranks' RNG states cannot be restored on 1 (why the shipped check turns it off)
    with_dropout = DIGITS.replace("PAIRS", "[[2, 1]]").replace(' args: "ARGS"', "")
    rows.append(Row("reshard", "examples/digits", "dropout_rng_per_rank 2->1", "rng",
                    lambda t: patched_copy(example, t / "digits", {}, with_dropout), "reshard"))
    return rows


def _hf_rows() -> list[Row]:
    from tests.distributed.test_hf_example import DISK_FULL, RESUME, RESUME_DEFECTS, example_copy

    rows = [Row("resume", "examples/hf_clm", d, cause,
                lambda t, a=args, r=resume_args: example_copy(t, RESUME, args=a, resume_args=r), "resume", HF)
            for d, (args, resume_args, cause) in RESUME_DEFECTS.items()]
    rows.append(Row("drill", "examples/hf_clm", "checkpoint_in_place (disk-full)", "in place",
                    lambda t: example_copy(t, DISK_FULL, args=" --plant checkpoint_in_place"), "drill:disk-full", HF))
    return rows


def _lightning_rows() -> list[Row]:
    from tests.distributed.test_lightning_example import (
        DISK_FULL,
        RESUME,
        RESUME_DEFECTS,
        example_copy,
    )

    rows = [Row("resume", "examples/lightning", "usual script (plain DataLoader, no RNG)", "data position",
                lambda t: example_copy(t, RESUME), "resume", LIGHTNING)]
    rows += [Row("resume", "examples/lightning", d, cause,
                 lambda t, d=d: example_copy(t, RESUME, args=f" --resumable-data --plant {d}"), "resume", LIGHTNING)
             for d, cause in RESUME_DEFECTS.items()]
    rows.append(Row("drill", "examples/lightning", "checkpoint_in_place (disk-full)", "in place",
                    lambda t: example_copy(t, DISK_FULL, args=" --resumable-data --plant checkpoint_in_place"),
                    "drill:disk-full", LIGHTNING))
    return rows


def _fsdp2_rows() -> list[Row]:
    from tests.distributed import test_fsdp2_checks as f

    rows = [Row("resume", "examples/fsdp2", d, cause, lambda t, p=patches: f.example_copy(t, p), "resume", FSDP)
            for d, (patches, _, cause) in f.PLANTED.items()]
    rows += [
        Row("resume", "examples/fsdp2", "scaler_not_restored (fp16)", "scaler",
            lambda t: f.example_copy(t, f.SCALER_NOT_RESTORED, f.FP16), "resume", FSDP),
        Row("resume", "examples/fsdp2", "drops_partial_micro_batches", "data_position",
            lambda t: f.example_copy(t, f.DROPS_PARTIAL_MICRO_BATCHES, f.MID_ACCUMULATION), "resume", FSDP),
        Row("chained resume", "examples/fsdp2", "counter_not_saved_again", "next save leaves out",
            lambda t: f.example_copy(t, f.COUNTER_NOT_SAVED_AGAIN, f.CHAIN), "resume", FSDP),
        Row("reshard", "examples/fsdp2", "uneven_shares 2->3", "uneven",
            lambda t: f.example_copy(t, f.UNEVEN_SHARES, f.UNEVEN_RESHARD), "reshard", FSDP),
        Row("drill", "examples/fsdp2", "marker_before_async_save_done", "marked complete",
            lambda t: f.example_copy(t, f.MARKER_BEFORE_ASYNC_SAVE_DONE, f.KILL_DURING_ASYNC_SAVE),
            "drill:kill-async-save", FSDP, fuse=True),
    ]
    return rows


def _toy_rows() -> list[Row]:
    from tests.distributed.test_compat import (
        BUFFER_WITHOUT_DEFAULT,
        DATA_ORDER_CHANGED,
        inexact_repo,
        make_digits_repo,
        renamed_head,
    )
    from tests.distributed.test_crash_points import writer_job
    from tests.distributed.test_drills_e2e import (
        HANG_WITHOUT_TIMEOUT,
        KILL_EXIT_ONLY_CHECKPOINT,
        job_file,
    )
    from tests.distributed.test_reshard import toy_job
    from tests.unit.test_resume_chain import chain_job

    def compat(patches: dict[str, tuple[str, str]], **options: Any) -> Callable[[Path], Path]:
        return lambda t: make_digits_repo(t, patches, **options) / "trainguard.yaml"

    return [
        Row("chained resume", "test_resume_chain job", "counter_left_out_by_resumed_saves", "next save leaves out",
            lambda t: chain_job(t, bug=True, resume="{steps: 26, chain: [6, 17]}"), "resume", timeout_s=300),
        Row("reshard", "reshard_train.py", "offset per rank 1->2", "sampler offset counted per rank",
            lambda t: toy_job(t, "--defect offset", "[[1, 2]]"), "reshard", timeout_s=300),
        Row("reshard", "reshard_train.py", "offset per rank 2->1", "sampler offset counted per rank",
            lambda t: toy_job(t, "--defect offset", "[[2, 1]]"), "reshard", timeout_s=300),
        Row("reshard", "reshard_train.py", "zero_shard 2->1", "optimizer state sharded",
            lambda t: toy_job(t, "--zero --defect zero-shard", "[[2, 1]]"), "reshard", timeout_s=300),
        Row("compat", "examples/digits (git)", "head renamed classifier", "classifier",
            compat({}, new_files={"digits/model.py": renamed_head()}), "compat"),
        Row("compat", "examples/digits (git)", "buffer without default", "input_scale", compat(BUFFER_WITHOUT_DEFAULT),
            "compat"),
        Row("compat", "examples/digits (git)", "data order changed", "data order", compat(DATA_ORDER_CHANGED),
            "compat"),
        Row("compat", "inexact_resume.py (git)", "resume path skips a step", "continues differently",
            lambda t: inexact_repo(t, "resume-path") / "trainguard.yaml", "compat", timeout_s=300),
        Row("drill", "toy_train.py", "checkpoint only at exit (kill_rank)", "no checkpoint",
            lambda t: job_file(t, KILL_EXIT_ONLY_CHECKPOINT), "drill:kill-exit-ckpt", timeout_s=300),
        Row("drill", "toy_train.py", "no collective timeout (hang)", "no timeout",
            lambda t: job_file(t, HANG_WITHOUT_TIMEOUT), "drill:no-timeout", timeout_s=300),
        Row("crash points", "save_writer.py", "inplace (kill)", "rename it over",
            lambda t: writer_job(t, "inplace"), "crash_points", fuse=True, timeout_s=300),
        Row("crash points", "save_writer.py", "unlink-first (kill)", "unlink",
            lambda t: writer_job(t, "unlink-first"), "crash_points", fuse=True, timeout_s=300),
        Row("crash points", "save_writer.py", "rename without fsync (power)", "fsync",
            lambda t: writer_job(t, "rename", "power", limit=3), "crash_points", fuse=True, timeout_s=300),
    ]


def _calibrated_rows() -> list[Row]:
    from tests.distributed.test_calibration import JOB, SCRIPT, planted_script

    def nondet(tmp: Path, *, calibrated: bool) -> Path:
        """nondet_sum.py (correct, not bitwise deterministic) as train.py, calibrated on 5 runs
        and then given its planted bug (the resumed run's schedule one step behind), or neither."""
        path, script = tmp / "trainguard.yaml", tmp / "train.py"
        path.write_text(JOB.format(script="train.py"))
        script.write_text(SCRIPT.read_text())
        if calibrated:
            from trainguard.session.calibrate import calibrate

            calibrate(path, runs=5, only=["resume"])
            script.write_text(planted_script('default="none")', 'default="lr-behind")'))
        return path

    return [
        Row("resume (calibrated)", "nondet_sum.py", "lr schedule one step behind on resume", "scheduler",
            lambda t: nondet(t, calibrated=True), "resume", timeout_s=400),
        Row("resume", "nondet_sum.py", "none planted: correct, not bitwise deterministic, uncalibrated",
            "determinis", lambda t: nondet(t, calibrated=False), "resume", timeout_s=300),
    ]


def _fault_drill_rows() -> list[Row]:
    from tests.distributed import test_preempt_drill as preempt
    from tests.distributed.test_storage_drills import storage_job

    planted = [
        ("preempt", "ignored", "no handler for the notice", preempt.job_file, False),
        ("preempt", "torn", "not atomic", preempt.job_file, False),
        ("preempt", "rank0-alone", "do not agree on the step", preempt.job_file, False),
        ("preempt", "died", "died of the signal", preempt.job_file, False),
        ("storage", "corrupt-silent", "no integrity check on load", storage_job, True),
        ("storage", "eio-write-inplace", "in place", storage_job, True),
        ("storage", "fsync-inplace", "in place", storage_job, True),
        ("storage", "eio-read-scratch", "starts from step 0", storage_job, True),
        ("storage", "kill-save-inplace", "in place", storage_job, True),
        ("storage", "kill-save-pointer", "pointer", storage_job, True),
    ]
    rows = [Row("drill", f"toy_train.py ({fault})", name, expected, make, f"drill:{name}", fuse=fuse, timeout_s=300)
            for fault, name, expected, make, fuse in planted]
    return rows + _more_drill_rows()


def _more_drill_rows() -> list[Row]:
    from tests.distributed.test_drills_faults_e2e import (
        OOM_SWALLOWED,
        disk_full_drill,
        toy_drill_job,
    )
    from tests.distributed.test_kill_worker_drill import workers_job
    from tests.distributed.test_nan_drill import nan_job
    from tests.distributed.test_slow_rank_drill import slow_job
    from tests.distributed.test_soak import exit_only_soak_job

    return [
        Row("drill", "toy_train.py (oom)", "swallows the OOM", "swallow", lambda t: toy_drill_job(t, OOM_SWALLOWED),
            "drill:oom", timeout_s=300),
        Row("drill", "toy_train.py (disk_full)", "in-place writer (hook mode)", "in place",
            lambda t: toy_drill_job(t, disk_full_drill("in-place", "hook", "--sleep 0.1")), "drill:disk",
            timeout_s=300),
        Row("drill", "toy_train.py (kill_worker)", "worker-hangs", "waits for the dead worker", workers_job,
            "drill:worker-hangs", timeout_s=300),
        Row("drill", "nan_train.py (nan)", "nan-train-on", "no check for non-finite values", nan_job,
            "drill:nan-train-on", timeout_s=300),
        Row("drill", "nan_train.py (nan)", "nan-spread", "reads only the loss", nan_job, "drill:nan-spread",
            timeout_s=300),
        Row("drill", "toy_train.py (slow_rank)", "slow-timeout", "timeout", slow_job, "drill:slow-timeout",
            timeout_s=300),
        Row("drill", "toy_train.py (soak)", "checkpoint only at exit", "no checkpoint before the fault",
            exit_only_soak_job, "drill:chaos", timeout_s=300),
    ]


#: nanoGPT's train.py, tiny on CPU: the settings the job file `trainguard init` writes gets added
NANOGPT_SETTINGS = ("--dataset=tiny --n_layer=2 --n_head=2 --n_embd=32 --block_size=32 --batch_size=4 "
                    "--dtype=float32 --eval_iters=2 --gradient_accumulation_steps=1 --always_save_checkpoint=True")
NANOGPT_CHECKS = "checks:\n  resume: {steps: 30, after_step: 12}\n"


NANOGPT_FILES = ("train.py", "model.py", "configurator.py")


def nanogpt_job(tmp: Path, mirror: Path = NANOGPT_MIRROR, *, settings: str = NANOGPT_SETTINGS,
                checks: str = NANOGPT_CHECKS) -> Path:
    """karpathy/nanoGPT's train.py, model.py and configurator.py as cloned, random uint16 tokens
    as its data (data/tiny: train.bin, val.bin, meta.pkl with the vocabulary size) and the job
    file `trainguard init train.py --yes` writes, with ``settings`` (the tiny ones) added to its
    command and ``checks`` (a resume check) as its checks. ``mirror``: the clone's git directory,
    or a folder holding the three files as they are (a GPU machine gets no mirror: docs/gpu.md)."""
    import pickle

    import numpy as np

    root = tmp / "nanogpt"
    root.mkdir(parents=True)
    if all((mirror / name).is_file() for name in NANOGPT_FILES):
        for name in NANOGPT_FILES:
            shutil.copy(mirror / name, root / name)
    else:
        archive = subprocess.run(["git", "--git-dir", str(mirror), "archive", "HEAD", *NANOGPT_FILES],
                                 check=True, capture_output=True, timeout=60).stdout
        subprocess.run(["tar", "-x", "-C", str(root)], input=archive, check=True, timeout=60)
    data = root / "data" / "tiny"
    data.mkdir(parents=True)
    tokens = np.random.default_rng(0)
    for split, size in (("train", 20_000), ("val", 4_000)):
        tokens.integers(0, 64, size, dtype=np.uint16).tofile(data / f"{split}.bin")
    with open(data / "meta.pkl", "wb") as f:
        pickle.dump({"vocab_size": 64}, f)
    subprocess.run([sys.executable, "-m", "trainguard.cli", "init", "train.py", "--yes"], cwd=root, check=True,
                   capture_output=True, timeout=120)
    path = root / "trainguard.yaml"
    text = path.read_text()
    command = "--eval_interval=5 --log_interval=1"
    assert text.count(command) == 1, f"trainguard init no longer writes {command!r} in {path}"
    text = text.replace(command, f"{command} {settings}")
    path.write_text(text.split("checks:\n")[0] + checks)
    return path


def _nanogpt_rows() -> list[Row]:
    return [Row("resume", "nanoGPT train.py (unmodified)", "none planted: saves no RNG state", "rng",
                nanogpt_job, "resume", timeout_s=400)]


def all_rows() -> list[Row]:
    return [*_sched_rows(), *_digits_rows(), *_toy_rows(), *_calibrated_rows(), *_fault_drill_rows(), *_fsdp2_rows(), *_hf_rows(), *_lightning_rows(),
            *_nanogpt_rows()]


def first_cause(check: dict[str, Any]) -> tuple[str, str, list[str]]:
    """``(key, text, evidence)`` of the cause a check's report names first: its diagnosis (of
    the check, or of the first reshard pair that has one), else its first likely cause, else the
    first unsafe boundary and its fix (crash points), else the summary's first sentence."""
    evidence = check.get("evidence") or {}
    holders = [evidence, *[p for p in (evidence.get("pairs") or {}).values() if isinstance(p, dict)]]
    for holder in holders:
        diagnosis = holder.get("diagnosis") or []
        if diagnosis:
            first = diagnosis[0]
            return str(first.get("key", "")), str(first.get("cause", "")), [str(e) for e in first.get("evidence", [])]
    for holder in holders:
        causes = holder.get("likely_causes") or []
        if causes:
            first = causes[0]
            if isinstance(first, dict):
                return str(first.get("key", "")), str(first.get("cause", "")), [str(e) for e in first.get("evidence", [])]
            return "", str(first), []
    unsafe = evidence.get("first_unsafe")
    if unsafe:
        return "", f"unsafe at {unsafe.get('op')} {unsafe.get('path')}: {unsafe.get('outcome')}", [str(evidence.get("fix", ""))]
    return "", str(check.get("summary", "")).split(". ")[0], []


def named(row: Row, key: str, text: str, evidence: list[str]) -> bool:
    """Whether the cause named first is the planted one."""
    words = " ".join([text, *evidence]).lower()
    return key == row.expected.replace(" ", "_") or (not key and row.expected.lower() in words) or \
        (bool(key) and row.expected.lower() in text.lower())


def run_row(row: Row, keep: bool) -> dict[str, Any]:
    """Build the row's job under a temporary folder and run its check there (in this process)."""
    missing = [name for name in row.needs if find_spec(name) is None]
    if missing:
        return {"outcome": "skipped", "why": f"needs {', '.join(missing)}"}
    if row.fuse:
        from trainguard.faults.fusefs import fuse_unavailable

        why = fuse_unavailable()
        if why is not None:
            return {"outcome": "skipped", "why": f"no FUSE layer: {why}"}
    if row.job.startswith("nanoGPT") and not (NANOGPT_MIRROR / "HEAD").exists():
        return {"outcome": "skipped", "why": f"no nanoGPT mirror at {NANOGPT_MIRROR}"}
    with checked_in_tmp(row, keep, "cause-table-") as (result, tmp):
        key, text, evidence = first_cause(result)
        return {"outcome": "ran", "status": result["status"], "summary": result.get("summary", ""), "key": key,
                "cause": text, "evidence": evidence, "named": named(row, key, text, evidence), "tmp": str(tmp)}


@contextlib.contextmanager
def checked_in_tmp(row: Any, keep: bool, prefix: str) -> Iterator[tuple[dict[str, Any], Path]]:
    """Build the row's job under a new temporary folder, run its check (``row.only``) from there
    through the library and yield the check's saved report with the folder (removed after,
    unless ``keep``)."""
    from trainguard.session import check

    tmp = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        path = row.build(tmp)
        os.chdir(tmp)
        report = check(path, only=[row.only], report_json=str(tmp / "report.json"))
        saved = json.loads((tmp / "report.json").read_text())["checks"]
        yield next(c for c in saved if c["name"] == report.checks[0].name), tmp
    finally:
        os.chdir(ROOT)
        if not keep:
            shutil.rmtree(tmp, ignore_errors=True)


def run_isolated(row: Any, timeout_s: int | None, keep: bool,
                 module: str = "tests.benchmarks.cause_table") -> dict[str, Any]:
    """``run_row`` in a child process of its own session (``python -m module --row ID``), killed
    with everything it started after the row's timeout."""
    limit = timeout_s or row.timeout_s
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = Path(f.name)
    command = [sys.executable, "-m", module, "--row", row.id, "--result", str(out),
               *(["--keep"] if keep else [])]
    env = {**os.environ, "TRAINGUARD_TRACKING": "off"}
    started = time.monotonic()
    child = subprocess.Popen(command, cwd=ROOT, env=env, start_new_session=True, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    try:
        output, _ = child.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        child.communicate()
        out.unlink(missing_ok=True)
        return {"outcome": "error", "why": f"timed out after {limit} s", "seconds": time.monotonic() - started}
    seconds = time.monotonic() - started
    with contextlib.suppress(ProcessLookupError):
        os.killpg(child.pid, signal.SIGKILL)  # anything the row left running
    try:
        result = json.loads(out.read_text())
    except (OSError, ValueError):
        tail = [line for line in output.splitlines() if line.strip()][-1:] or [f"exit {child.returncode}"]
        result = {"outcome": "error", "why": tail[0][:300]}
    finally:
        out.unlink(missing_ok=True)
    result["seconds"] = seconds
    return result


def _cell(text: str, limit: int) -> str:
    text = " ".join(str(text).split()).replace("|", "\\|")
    return text if len(text) <= limit else text[: limit - 1] + "…"


HEADER = ("| check | job | planted defect | cause named first (key: text) | evidence it cites | verdict | s |\n"
          "|---|---|---|---|---|---|---|")


def table_row(row: Row, result: dict[str, Any]) -> str:
    seconds = f"{result.get('seconds', 0):.0f}"
    if result["outcome"] != "ran":
        return (f"| {row.check} | {row.job} | {_cell(row.defect, 60)} | — | — | "
                f"{result['outcome'].upper()}: {_cell(result['why'], 200)} | {seconds} |")
    cause = f"{result['key'] or '(no key)'}: {result['cause']}"
    verdict = f"{result['status']}; " + ("planted cause named first" if result["named"]
                                         else f"NOT the planted cause ({row.expected})")
    if result["status"] not in ("failed",):
        verdict += f" — {_cell(result['summary'], 200)}"
    return (f"| {row.check} | {row.job} | {_cell(row.defect, 60)} | {_cell(cause, 220)} | "
            f"{_cell('; '.join(result['evidence']), 320)} | {verdict} | {seconds} |")


def table_parser(doc: str) -> argparse.ArgumentParser:
    """The options of a table of rows (this one, silent_table's): --out, --only, --timeout,
    --list, --keep, and a child's --row and --result."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--out", type=Path, help="write the markdown table here too")
    p.add_argument("--only", action="append", default=[], help="rows whose id holds this substring")
    p.add_argument("--timeout", type=int, default=None, help="seconds per row (default: the row's own)")
    p.add_argument("--list", action="store_true", help="list the rows' ids and stop")
    p.add_argument("--keep", action="store_true", help="keep each row's temporary folder")
    p.add_argument("--row", help=argparse.SUPPRESS)
    p.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    return p


def run_child(rows: list[Any], args: argparse.Namespace, run: Callable[[Any, bool], dict[str, Any]]) -> int:
    """A child (``--row ID``): run that one row, its result as JSON in ``--result``."""
    (row,) = [r for r in rows if r.id == args.row]
    try:
        result = run(row, args.keep)
    except Exception as exc:  # a row that errors is a row saying so
        result = {"outcome": "error", "why": f"{type(exc).__name__}: {exc}"}
    args.result.write_text(json.dumps(result))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = table_parser(__doc__ or "").parse_args(argv)
    rows = all_rows()
    if args.row:  # a child: one row, its result as JSON
        return run_child(rows, args, run_row)
    run_table(rows, args, HEADER, lambda row, result: table_row(row, result))
    return 0


def run_table(rows: list[Any], args: argparse.Namespace, header: str, line: Callable[[Any, dict[str, Any]], str],
              module: str = "tests.benchmarks.cause_table", footer: str = "") -> list[tuple[Any, dict[str, Any]]]:
    """Run the rows ``--only`` keeps, one child each, printing each row's line (and writing the
    table to ``--out`` as it grows); with ``--list`` only their ids. Each row with its result."""
    rows = [r for r in rows if not args.only or any(s in r.id for s in args.only)]
    if args.list:
        print("\n".join(r.id for r in rows))
        return []
    lines, results = [header], []
    print(header, flush=True)
    started = time.monotonic()
    for row in rows:
        results.append((row, run_isolated(row, args.timeout, args.keep, module)))
        lines.append(line(*results[-1]))
        print(lines[-1], flush=True)
        if args.out:
            args.out.write_text("\n".join(lines) + "\n")
    ended = f"\n{len(rows)} rows in {time.monotonic() - started:.0f} s{footer}"
    print(ended)
    if args.out:
        args.out.write_text("\n".join(lines) + "\n" + ended + "\n")
    return results


if __name__ == "__main__":
    raise SystemExit(main())
