"""Public scripts run unmodified through the ``invariants`` check (issue 45's constraint: 0 false
findings on public code): each from a temporary directory with data made there, at 2 gloo ranks.

    .venv/bin/python -m tests.benchmarks.public_invariants --run-clm PATH/run_clm.py \\
        --fabric PATH/language_model/train.py --no-trainer PATH/run_clm_no_trainer.py \\
        [--steps 12] [--repeats 1] [--hogs 0] [--out FILE.md]

The scripts are not shipped here (take the versions matching the installed packages):

- ``--run-clm``: transformers' examples/pytorch/language-modeling/run_clm.py (the Trainer), as
  tests/benchmarks/run_clm_hang.py runs it: ``--ddp_backend gloo --use_cpu``, a GPT-2 from scratch
  (2 layers, width 32), the hf_clm example's generated corpus and its word-level tokenizer.
- ``--fabric``: Lightning's examples/fabric/language_model/train.py (Fabric, the demo Transformer
  with dropout, gradient clipping, ``model.eval()`` validation each epoch, 20 epochs), with
  ``data/wikitext-2.txt`` generated (4,080 sequences: 2 optimizer steps an epoch at 2 ranks, 40 in
  all) and ``LT_CLI_USED=1 LT_ACCELERATOR=cpu LT_DEVICES=2 LT_STRATEGY=ddp``, the variables ``fabric run``
  sets in each process it starts through torchrun (trainguard starts the ranks with that environment).
  Its step count is the script's own (it reads no argument: the job file passes ``{steps}`` as
  one it ignores, since trainguard refuses a command without it).

- ``--no-trainer``: transformers' examples/pytorch/language-modeling/run_clm_no_trainer.py (a
  plain loop on ``accelerate.Accelerator``: ``accelerator.prepare``, ``accelerator.backward``,
  ``model.eval()`` validation after each epoch), a GPT-2 from a local config folder (the same
  model), the first ``NO_TRAINER_LINES`` lines of the corpus (4 optimizer steps an epoch at 2
  ranks: 12 steps are 3 epochs) and ``ACCELERATE_USE_CPU=true``, what ``accelerate launch --cpu``
  sets (without it accelerate takes each torchrun rank for a lone process). It logs no training
  loss; the job's metric is the validation's ``eval_loss`` after each epoch.

Nothing is downloaded (``HF_HUB_OFFLINE``). accelerate's own examples download bert-base-cased and
GLUE (``nlp_example.py`` and every ``by_feature`` script) or a pretrained timm model
(``cv_example.py``); the two that build a GPT-2 from a config fail to import against the installed
packages (``deepspeed_with_config_support.py`` imports ``DummyOptim``, which ``accelerate.utils``
exports only with DeepSpeed installed; ``megatron_lm_gpt_pretraining.py`` imports
``send_example_telemetry``, gone from transformers 5). Each row: the script, what each invariant compared
(the ones that applied), the findings (every one is false: the scripts are correct), the steps
recorded and the seconds. ``--repeats N --hogs H`` runs each N times beside H busy loops.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.benchmarks.cause_table import HF, checked_in_tmp, run_child, run_table, table_parser
from tests.benchmarks.run_clm_hang import clm_files, clm_job
from tests.benchmarks.silent_table import hogs

MODULE = "tests.benchmarks.public_invariants"
#: the scripts' paths reach each row's child process through these variables
SCRIPT_VARS = {"run_clm": "TG_PUBLIC_RUN_CLM", "fabric": "TG_PUBLIC_FABRIC",
               "no_trainer": "TG_PUBLIC_NO_TRAINER"}

FABRIC_JOB = """\
job:
  name: fabric-language-model
  # the script trains 20 epochs and reads no argument; trainguard refuses a command without
  # {steps}, so it is passed as one the script ignores: the run is the script's own length
  command: python train.py {steps}
  world_size: 2
  cwd: .
  env: {OMP_NUM_THREADS: "1", LT_CLI_USED: "1", LT_ACCELERATOR: cpu, LT_DEVICES: "2", LT_STRATEGY: ddp}
  metrics:  # what the script prints: the validation's loss after each epoch
    val_loss: {regex: 'val loss (?P<value>\\S+)', step: count}
  timeout: 900
  stall_timeout: 120
checks:
  invariants: {steps: 40}
"""


NO_TRAINER_JOB = """\
job:
  name: run-clm-no-trainer
  command: >-
    python run_clm_no_trainer.py --config_name cfg --tokenizer_name tok --train_file train.txt
    --block_size 32 --per_device_train_batch_size 8 --max_train_steps {{steps}} --seed {{seed}}
  world_size: 2
  cwd: .
  env: {{OMP_NUM_THREADS: "1", ACCELERATE_USE_CPU: "true", HF_HUB_OFFLINE: "1", HF_DATASETS_OFFLINE: "1",
        TOKENIZERS_PARALLELISM: "false", HF_HOME: "{hf_home}"}}
  metrics:  # what the script prints: the validation's loss after each epoch (no training loss)
    eval_loss: {{regex: 'eval_loss: (?P<value>\\S+)', step: count}}
  timeout: 900
  stall_timeout: 120
checks:
  invariants: {{steps: {steps}}}
"""


def script(kind: str) -> Path:
    """The path given for ``kind`` (through its variable)."""
    return Path(os.environ[SCRIPT_VARS[kind]])


def run_clm_project(tmp: Path, steps: int) -> Path:
    return clm_job(tmp, script("run_clm"), f"  invariants: {{steps: {steps}}}\n")


#: the Fabric script splits its data [n - 4000, 2000, 2000]: 80 training sequences of 35 tokens
FABRIC_SEQUENCES = 4080


def fabric_project(tmp: Path, steps: int) -> Path:
    """Lightning's Fabric language model unmodified, with ``data/wikitext-2.txt`` made from the
    hf_clm example's generated corpus (the demo dataset reads it instead of downloading)."""
    import shutil
    import sys

    from tests.benchmarks.cause_table import ROOT

    sys.path.insert(0, str(ROOT / "examples" / "hf_clm"))
    from tinyclm.data import make_sentences

    shutil.copyfile(script("fabric"), tmp / "train.py")
    need = (FABRIC_SEQUENCES + 1) * 35 + 1
    lines: list[str] = []
    count = 0
    for sentence in make_sentences(100_000):
        lines.append(sentence)
        count += len(sentence.split()) + 1  # and <eos>
        if count >= need:
            break
    (tmp / "data").mkdir()
    (tmp / "data" / "wikitext-2.txt").write_text("\n".join(lines) + "\n")
    job = tmp / "trainguard.yaml"
    job.write_text(FABRIC_JOB)
    return job


#: the corpus lines run_clm_no_trainer.py trains on: 95 % of them make 64 blocks of 32 tokens, 4
#: full batches of 8 a rank (an uneven epoch is padded by accelerate from the epoch's first
#: batches, which the data invariant reads without that tail: docs/invariants.md, "The data")
NO_TRAINER_LINES = 247


def no_trainer_project(tmp: Path, steps: int) -> Path:
    """transformers' run_clm_no_trainer.py unmodified, with run_clm.py's corpus (its first
    ``NO_TRAINER_LINES`` lines) and tokenizer, and that GPT-2 saved as a config folder."""
    from transformers import GPT2Config

    vocab = clm_files(tmp, script("no_trainer"), "run_clm_no_trainer.py")
    lines = (tmp / "train.txt").read_text().splitlines()[:NO_TRAINER_LINES]
    (tmp / "train.txt").write_text("\n".join(lines) + "\n")
    GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=64, vocab_size=vocab).save_pretrained(str(tmp / "cfg"))
    job = tmp / "trainguard.yaml"
    job.write_text(NO_TRAINER_JOB.format(hf_home=tmp / "hf", steps=steps))
    return job


@dataclass(frozen=True)
class Row:
    """One public script's run: how to build its project, its check, the packages it needs."""

    script: str
    kind: str
    build: Callable[[Path], Path]
    repeat: int = 1
    only: str = "invariants"
    extras: tuple[str, ...] = ()
    timeout_s: int = 600

    @property
    def id(self) -> str:
        return f"{self.kind}/{self.repeat}"


def rows(repeats: int) -> list[Row]:
    """Each script given (its variable set), ``repeats`` times."""
    steps = int(os.environ.get("TG_PUBLIC_STEPS", "12"))
    kinds = [("transformers run_clm.py (Trainer)", "run_clm", run_clm_project, ("datasets", "evaluate", *HF)),
             ("Lightning examples/fabric/language_model/train.py (Fabric)", "fabric", fabric_project, ("lightning",)),
             ("transformers run_clm_no_trainer.py (accelerate)", "no_trainer", no_trainer_project,
              ("datasets", *HF))]
    return [Row(name, kind, lambda t, b=build: b(t, steps), i + 1, extras=extras)
            for name, kind, build, extras in kinds if os.environ.get(SCRIPT_VARS[kind]) for i in range(repeats)]


def run_row(row: Row, keep: bool) -> dict[str, Any]:
    """Build the row's project under a temporary folder and run the invariants check there."""
    from importlib.util import find_spec

    missing = [name for name in row.extras if find_spec(name) is None]
    if missing:
        return {"outcome": "skipped", "why": f"needs {', '.join(missing)} (pip install -e '.[public,frameworks]')"}
    with checked_in_tmp(row, keep, "public-invariants-") as (result, tmp):
        evidence = result.get("evidence") or {}
        return {"outcome": "ran", "status": result["status"], "summary": result.get("summary", ""),
                "findings": [f for f in evidence.get("findings") or [] if isinstance(f, dict)],
                "coverage": [c for c in evidence.get("coverage") or [] if isinstance(c, dict)],
                "steps": recorded_steps(Path(evidence.get("run_dir") or tmp)), "tmp": str(tmp)}


def recorded_steps(run_dir: Path) -> str:
    """The optimizer steps rank 0 recorded (each optimizer's last step number)."""
    from trainguard.launch.steps import read_steps

    rank0 = read_steps(run_dir).ranks.get(0)
    last: dict[int, int] = {}
    for record in rank0.steps if rank0 else ():
        last[record.opt] = max(last.get(record.opt, 0), record.n)
    return ", ".join(str(n) for _, n in sorted(last.items())) or "none"


HEADER = ("| script | run | invariants that applied (what each compared) | not applying | findings | steps | "
          "verdict | s |\n|---|---|---|---|---|---|---|---|")


def table_row(row: Row, result: dict[str, Any]) -> str:
    seconds = f"{result.get('seconds', 0):.0f}"
    if result["outcome"] != "ran":
        return f"| {row.script} | {row.repeat} | — | — | — | — | {result['outcome'].upper()}: {result['why']} | {seconds} |"
    applied = "; ".join(f"{c['invariant']}: {c['what']}" for c in result["coverage"] if c.get("compared"))
    skipped = "; ".join(f"{c['invariant']}" for c in result["coverage"] if not c.get("compared"))
    found = result["findings"]
    names = "; ".join(f"{f['invariant']} {f['name']} ranks {f['ranks']} step {f['step']}" for f in found[:3])
    verdict = f"{result['status']}" + ("" if not found else f" — FALSE FINDING(S): {names}")
    return (f"| {row.script} | {row.repeat} | {applied or '—'} | {skipped or '—'} | {len(found)} | "
            f"{result['steps']} | {verdict} | {seconds} |")


def main(argv: list[str] | None = None) -> int:
    p = table_parser(__doc__ or "")
    for kind, var in SCRIPT_VARS.items():
        p.add_argument(f"--{kind.replace('_', '-')}", type=Path, help=f"the script's path (or ${var})")
    p.add_argument("--steps", type=int, default=12, help="optimizer steps of run_clm's and run_clm_no_trainer's runs")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--hogs", type=int, default=0, help="busy-loop processes beside the runs")
    args = p.parse_args(argv)
    for kind, var in SCRIPT_VARS.items():
        given = getattr(args, kind)
        if given is not None:
            os.environ[var] = str(given.resolve())
    if not args.row:
        os.environ["TG_PUBLIC_STEPS"] = str(args.steps)
    table = rows(args.repeats if not args.row else 100)
    if args.row:  # a child: one row, its result as JSON
        return run_child(table, args, run_row)
    with hogs(args.hogs):
        results = run_table(table, args, HEADER, table_row, MODULE, f", {args.hogs} CPU hogs beside them")
    false = sum(len(result.get("findings") or []) for _, result in results)
    print(f"findings (each one false: the scripts are correct): {false}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
