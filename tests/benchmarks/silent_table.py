"""The silent-bug yardstick (issue 45): realistic silent defects, each beside its clean twin, run
through the ``invariants`` check (and the ``sdc`` drill) from a temporary directory, with the step
each is caught at against the first step it affects.

    .venv/bin/python -m tests.benchmarks.silent_table [--out FILE.md] [--only SUBSTRING ...] [--list]
    .venv/bin/python -m tests.benchmarks.silent_table --clean-repeats 5 --hogs 2 [--out FILE.md]

The defects are ``--plant`` options of the shipped examples (examples/digits) and of the test job
tests/data/jobs/sched_train.py, and two patches applied to karpathy/nanoGPT's train.py in a temp
dir (from a local mirror, ``TRAINGUARD_NANOGPT_MIRROR``; rows skipped without one). Each row:
the defect, the job, the invariant expected to name it, the verdict, the step (or epoch) caught
against the first one it affects (issue 45's bar: within 2 optimizer steps; a missing
``set_epoch``: the next epoch) and what was named. A defect whose invariant needs a record the run
agent does not write yet (docs/invariants.md, "The plan") says which: "not caught" is expected.

``--clean-repeats N --hogs H`` runs the false-finding bar instead: the invariants check on each
clean example at 2 ranks and on nanoGPT unmodified (1 rank), N times each, beside H busy-loop
processes (started here, always reaped); every finding is a false one. Each row runs in a child
process of its own session (cause_table's ``run_isolated``), killed with all it started after its
timeout.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from importlib.util import find_spec
from pathlib import Path
from typing import Any

from tests.benchmarks.cause_table import (
    FSDP,
    HF,
    LIGHTNING,
    NANOGPT_MIRROR,
    ROOT,
    checked_in_tmp,
    nanogpt_job,
    run_child,
    run_table,
    table_parser,
)

JOBS = ROOT / "tests" / "data" / "jobs"
EXAMPLES = ROOT / "examples"
MODULE = "tests.benchmarks.silent_table"

@dataclass(frozen=True)
class Row:
    """One defect (or clean twin): how to build its job under a temporary folder, the check to
    run, the invariant expected to name it, the first step (or ``epoch N``) it affects, and the
    record it needs when the agent does not write that record yet (``needs``: not caught today)."""

    defect: str
    job: str
    invariant: str
    build: Callable[[Path], Path]
    affects: str = ""
    needs: str = ""
    only: str = "invariants"
    extras: tuple[str, ...] = ()
    timeout_s: int = 420

    @property
    def id(self) -> str:
        return f"{self.job}/{self.defect}"

    @property
    def clean(self) -> bool:
        return not self.affects


def example_job(tmp: Path, name: str, args: str = "", steps: int = 12, world: int = 2) -> Path:
    """A copy of ``examples/<name>`` whose job file runs ``world`` ranks with ``args`` added and
    the invariants check alone (``steps`` steps, one run of its own)."""
    root = tmp / name
    shutil.copytree(EXAMPLES / name, root, ignore=shutil.ignore_patterns(".trainguard", "__pycache__", "checkpoints"))
    job = (root / "trainguard.yaml").read_text().split("checks:\n")[0]
    job = job.replace("world_size: 1", f"world_size: {world}").replace("world_size: 2", f"world_size: {world}")
    if args:
        assert job.count("--seed {seed}") == 1, f"{name}'s job file no longer runs '--seed {{seed}}'"
        job = job.replace("--seed {seed}", "--seed {seed} " + args)
    (root / "trainguard.yaml").write_text(job + f"checks:\n  invariants: {{steps: {steps}}}\n")
    return root / "trainguard.yaml"


def sched_job(tmp: Path, args: str = "", steps: int = 8) -> Path:
    from tests.distributed.test_sched_job import job_file

    return job_file(tmp, args, checks=f"  invariants: {{steps: {steps}}}\n")


def sdc_job(tmp: Path) -> Path:
    """tests/data/jobs/sdc.trainguard.yaml (its drills flip rank 1's tensor at step 4; a row runs one)."""
    text = (JOBS / "sdc.trainguard.yaml").read_text().replace("python sched_train.py", f"python {JOBS / 'sched_train.py'}")
    path = tmp / "sdc.trainguard.yaml"
    path.write_text(text)
    return path


#: nanoGPT's train.py patched after its optimizer is built (after ``checkpoint = None``)
NANOGPT_ANCHOR = "checkpoint = None # free up memory\n"
NANOGPT_PATCHES = {
    "layer_frozen": "model.transformer.h[0].mlp.c_fc.weight.requires_grad_(False)\n",
    "head_after_optimizer": ("model.transformer.h[-1].mlp.c_proj = torch.nn.Linear(4 * n_embd, n_embd, bias=bias)"
                             ".to(device)\n"),
}


def nanogpt_invariants(tmp: Path, patch: str = "", steps: int = 12) -> Path:
    """nanoGPT's train.py (tiny, CPU, 1 rank) with ``patch`` inserted after its optimizer is
    built, and the invariants check alone."""
    path = nanogpt_job(tmp)
    train = path.parent / "train.py"
    text = train.read_text()
    assert text.count(NANOGPT_ANCHOR) == 1, f"nanoGPT's train.py no longer has {NANOGPT_ANCHOR!r}"
    train.write_text(text.replace(NANOGPT_ANCHOR, NANOGPT_ANCHOR + patch))
    path.write_text(path.read_text().split("checks:\n")[0] + f"checks:\n  invariants: {{steps: {steps}}}\n")
    return path


def _digits(args: str, steps: int = 12) -> Callable[[Path], Path]:
    return lambda t: example_job(t, "digits", f"--eval-every 4 {args}".strip(), steps)


def planted_rows() -> list[Row]:
    """The defects and their clean twins (a twin: ``affects`` empty, every finding false)."""
    digits = "examples/digits"
    sched = "sched_train.py"
    return [
        Row("clean twin (dropout seeded per rank: intended)", digits, "none", _digits("", 30)),
        Row("ddp_bypassed", digits, "replicas", _digits("--plant ddp_bypassed"), "5"),
        Row("clip_one_rank", digits, "replicas", _digits("--plant clip_one_rank"), "1"),
        Row("group_dropped", digits, "trains", _digits("--plant group_dropped"), "1"),
        Row("head_after_optimizer", digits, "trains", _digits("--plant head_after_optimizer"), "1"),
        Row("layer_frozen", digits, "trains", _digits("--plant layer_frozen"), "1"),
        Row("zero_grad_missing", digits, "zero grads", _digits("--plant zero_grad_missing"), "2"),
        Row("set_epoch_never", digits, "data", _digits("--plant set_epoch_never", 30), "epoch 1"),
        Row("eval_left_on", digits, "modes", _digits("--plant eval_left_on"), "5"),
        Row("validation_train_mode", digits, "modes", _digits("--plant validation_train_mode"), "4"),
        Row("clean twin", sched, "none", lambda t: sched_job(t, steps=16)),
        Row("replica_drift", sched, "replicas", lambda t: sched_job(t, "--plant replica_drift"), "6"),
        Row("ddp_bypassed", sched, "replicas", lambda t: sched_job(t, "--plant ddp_bypassed"), "5"),
        Row("set_epoch_never", sched, "data", lambda t: sched_job(t, "--plant set_epoch_never", 16), "epoch 1"),
        Row("clean twin (--amp: GradScaler, unscale_ then clip)", sched, "none", lambda t: sched_job(t, "--amp")),
        Row("clip_before_unscale (--amp)", sched, "scaler", lambda t: sched_job(t, "--amp --plant clip_before_unscale"),
            "1"),
        Row("clean twin (unmodified)", "nanoGPT train.py", "none", nanogpt_invariants),
        *[Row(f"{name} (patched)", "nanoGPT train.py", "trains", lambda t, p=patch: nanogpt_invariants(t, p), "1")
          for name, patch in NANOGPT_PATCHES.items()],
        Row("sdc transient parameter flip (rank 1)", "sched_train.py DDP", "replicas (sdc drill)",
            sdc_job, "4", only="drill:sdc-parameter"),
        Row("sdc persistent exponent flip (rank 1)", "sched_train.py DDP", "replicas (sdc drill)",
            sdc_job, "4", only="drill:sdc-persistent"),
    ]


def clean_rows(repeats: int) -> list[Row]:
    """The false-finding bar: each clean example at 2 ranks and nanoGPT unmodified, ``repeats`` times."""
    jobs: list[tuple[str, Callable[[Path], Path], tuple[str, ...]]] = [
        ("examples/digits", lambda t: example_job(t, "digits", steps=30), ()),
        ("examples/fsdp2", lambda t: example_job(t, "fsdp2", steps=12), FSDP),
        ("examples/hf_clm (run_clm-style Trainer script)", lambda t: example_job(t, "hf_clm", steps=12), HF),
        ("examples/lightning", lambda t: example_job(t, "lightning", steps=12), LIGHTNING),
        ("nanoGPT train.py (unmodified, 1 rank)", nanogpt_invariants, ()),
    ]
    return [Row(f"clean run {i + 1}", job, "none", build, extras=extras) for job, build, extras in jobs
            for i in range(repeats)]


def run_row(row: Row, keep: bool) -> dict[str, Any]:
    """Build the row's job under a temporary folder and run its check there (in this process)."""
    missing = [name for name in row.extras if find_spec(name) is None]
    if missing:
        return {"outcome": "skipped", "why": f"needs {', '.join(missing)}"}
    if row.job.startswith("nanoGPT") and not (NANOGPT_MIRROR / "HEAD").exists():
        return {"outcome": "skipped", "why": f"no nanoGPT mirror at {NANOGPT_MIRROR}"}
    with checked_in_tmp(row, keep, "silent-table-") as (result, tmp):
        evidence = result.get("evidence") or {}
        return {"outcome": "ran", "status": result["status"], "summary": result.get("summary", ""),
                "findings": [f for f in evidence.get("findings") or [] if isinstance(f, dict)], "tmp": str(tmp)}


def caught_at(result: dict[str, Any]) -> str:
    """The first finding's step (``epoch N`` for a data finding), or "" without one."""
    if not result.get("findings"):
        return ""
    first = result["findings"][0]
    return str(first["step"]) if first.get("step") is not None else f"epoch {first.get('epoch')}"


def verdict(row: Row, result: dict[str, Any]) -> str:
    """Whether the row meets issue 45's bar: a twin with no finding; a defect caught within 2
    optimizer steps of the first step it affects (a data defect: at that epoch); a defect whose
    record is not written yet: not caught, as expected."""
    if result["outcome"] != "ran":
        return f"{result['outcome'].upper()}: {result['why']}"
    findings, status = result["findings"], result["status"]
    if row.clean:
        return f"ok: {status}, 0 findings" if not findings and status != "failed" else \
            f"FALSE FINDING ({len(findings)}): {status}"
    if row.only.startswith("drill:"):
        return f"{'ok' if status == 'passed' else 'NOT caught'}: drill {status}"
    at = caught_at(result)
    if not at:
        return f"not caught (expected: needs {row.needs})" if row.needs else f"NOT CAUGHT: {status}"
    if row.affects.startswith("epoch"):
        return "ok: caught at its epoch" if at == row.affects else f"LATE: {at}"
    late = int(at) - int(row.affects) if at.isdigit() else 99
    return "ok: caught within 2 steps" if 0 <= late <= 2 else f"OUTSIDE 2 STEPS ({late})"


def named(result: dict[str, Any]) -> str:
    """What the findings named: each invariant, tensor or loader, and ranks (at most 4)."""
    if result["outcome"] != "ran":
        return "—"
    findings = result["findings"]
    if not findings:
        return result["summary"].split(". ")[0]
    parts = [f"{f['invariant']}: {f['name']} ranks {f['ranks']}" for f in findings[:4]]
    more = f" (+{len(findings) - 4})" if len(findings) > 4 else ""
    return "; ".join(parts) + more + f" — {findings[0]['observation'].split(' (')[0].split(': ')[0]}"


def _cell(text: str, limit: int) -> str:
    text = " ".join(str(text).split()).replace("|", "\\|")
    return text if len(text) <= limit else text[: limit - 1] + "…"


HEADER = ("| defect | job | invariant | first affected | caught at | what was named | verdict | s |\n"
          "|---|---|---|---|---|---|---|---|")


def table_row(row: Row, result: dict[str, Any]) -> str:
    at = caught_at(result) if result["outcome"] == "ran" else ""
    if row.only.startswith("drill:") and result["outcome"] == "ran":
        at = f"drill {result['status']}"
    return (f"| {row.defect} | {row.job} | {row.invariant} | {row.affects or '—'} | {at or '—'} | "
            f"{_cell(named(result) if not row.only.startswith('drill:') else result.get('summary', ''), 240)} | "
            f"{_cell(verdict(row, result), 200)} | {result.get('seconds', 0):.0f} |")


@contextmanager
def hogs(count: int) -> Iterator[None]:
    """``count`` busy-loop processes beside the runs, always reaped."""
    started = [subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
               for _ in range(count)]
    try:
        yield
    finally:
        for hog in started:
            hog.kill()
            hog.wait()


def main(argv: list[str] | None = None) -> int:
    p = table_parser(__doc__ or "")
    p.add_argument("--clean-repeats", type=int, default=0, help="the false-finding bar: each clean job N times")
    p.add_argument("--hogs", type=int, default=0, help="busy-loop processes beside the runs")
    args = p.parse_args(argv)
    rows = clean_rows(args.clean_repeats) if args.clean_repeats else planted_rows()
    if args.row:  # a child, of any row: it is not told --clean-repeats
        return run_child([*planted_rows(), *clean_rows(100)], args, run_row)
    with hogs(args.hogs):
        results = run_table(rows, args, HEADER, table_row, MODULE, f", {args.hogs} CPU hogs beside them")
    false = sum(len(result.get("findings") or []) for row, result in results if row.clean)
    if results:
        print(f"findings on the clean runs: {false}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
