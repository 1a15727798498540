"""A public script run unmodified (issue 46): Hugging Face transformers' ``run_clm.py`` at 2 ranks
with ``--ddp_backend gloo``, from a temp dir, and a ``hang`` drill on each rank; the stall
attribution must name that rank.

    .venv/bin/python -m tests.benchmarks.run_clm_hang --script PATH/run_clm.py [--ranks 0,1]
        [--steps 30] [--after-step 8] [--stall 10] [--json FILE]

``run_clm.py`` is transformers' examples/pytorch/language-modeling/run_clm.py (not shipped here:
take the one of the installed transformers' version). It needs ``datasets`` and
``evaluate`` (the ``public`` extra: ``pip install -e ".[public]"``). Nothing is downloaded: the
temp dir gets a copy of the script as it is, a text file of the hf_clm example's generated corpus (``--train_file``), that
corpus's word-level tokenizer saved as a tokenizer folder (``--tokenizer_name``), and a GPT-2
from scratch (``--model_type gpt2 --config_overrides``: 2 layers, width 32). trainguard runs it
through ``trainguard drill`` with a job file whose loss comes from the Trainer (``{trainer:
huggingface}``) and whose resume is the script's own ``--resume_from_checkpoint``.

Per drill: the culprit(s) the attribution named, right or not, the drill's verdict, the seconds
from the hang to the attribution's end (stall limit + detection + the ask to the end), and the
attribution's words (the evidence it cites).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]

JOB = """\
job:
  name: run-clm
  command: >-
    python run_clm.py --model_type gpt2
    --config_overrides n_layer=2,n_embd=32,n_head=2,n_positions=64,vocab_size={vocab}
    --tokenizer_name tok --train_file train.txt --do_train --block_size 32
    --per_device_train_batch_size 8 --output_dir {{checkpoint_dir}} --max_steps {{steps}}
    --seed {{seed}} --ddp_backend gloo --use_cpu true --report_to none --save_steps 5
    --logging_steps 5 --disable_tqdm true --dataloader_drop_last true
  resume_args: "--resume_from_checkpoint {{latest_checkpoint}}"
  world_size: 2
  cwd: .
  env: {{OMP_NUM_THREADS: "1", HF_HUB_OFFLINE: "1", HF_DATASETS_OFFLINE: "1",
        TOKENIZERS_PARALLELISM: "false", HF_HOME: "{hf_home}"}}
  metrics:
    loss: {{trainer: huggingface}}
  timeout: 900
  stall_timeout: 120
checks:
{checks}"""


def clm_files(where: Path, script: Path, name: str = "run_clm.py") -> int:
    """Into ``where``: the script unmodified (as ``name``), ``train.txt`` (the hf_clm example's
    generated corpus) and ``tok`` (that corpus's word-level tokenizer); the vocabulary's size."""
    sys.path.insert(0, str(ROOT / "examples" / "hf_clm"))
    from tinyclm.data import build_tokenizer, make_sentences

    shutil.copyfile(script, where / name)
    sentences = make_sentences(2000)
    (where / "train.txt").write_text("\n".join(sentences) + "\n")
    tokenizer = build_tokenizer(sentences)
    tokenizer.save_pretrained(str(where / "tok"))
    return len(tokenizer)


def clm_job(where: Path, script: Path, checks: str) -> Path:
    """The temp project: run_clm.py unmodified with its data (:func:`clm_files`) and the job file
    running ``checks`` (the YAML under ``checks:``)."""
    vocab = clm_files(where, script)
    job = where / "trainguard.yaml"
    job.write_text(JOB.format(vocab=vocab, hf_home=where / "hf", checks=checks))
    return job


def make_project(where: Path, script: Path, ranks: list[int], steps: int, after_step: int, stall: float) -> Path:
    """The temp project with a hang drill on each of ``ranks``."""
    drills = "".join(f"    - {{name: hang-rank{r}, fault: hang, rank: {r}, world_size: 2, steps: {steps}, "
                     f"after_step: {after_step}, stall_timeout: {stall:g}}}\n" for r in ranks)
    return clm_job(where, script, "  drills:\n" + drills)


def cell(result: dict[str, Any], rank: int) -> dict[str, Any]:
    """One drill's row: named, right, verdict, seconds from the hang to the detection and to the
    attempt's end (the attribution done, the group torn down), the words."""
    evidence = result.get("evidence") or {}
    attempts = evidence.get("attempts") or []
    hung = next((a for a in attempts if a.get("culprits") is not None or a.get("attribution")), {})
    named = hung.get("culprits") or []
    # the attribution is made between the detection and the teardown: the attempt's end bounds it
    return {"drill": result["name"], "rank": rank, "status": result["status"], "named": named,
            "right": named == [rank], "fault_to_detection_s": evidence.get("detected_after_s"),
            "fault_to_attempt_end_s": evidence.get("attempt_ended_after_s"),
            "attribution": hung.get("attribution"), "summary": result.get("summary")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--script", type=Path, required=True, help="transformers' run_clm.py")
    p.add_argument("--ranks", default="0,1")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--after-step", type=int, default=8)
    p.add_argument("--stall", type=float, default=10.0)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    ranks = [int(r) for r in args.ranks.split(",")]
    with tempfile.TemporaryDirectory(prefix="tg-run-clm-") as tmp:
        job = make_project(Path(tmp), args.script.resolve(), ranks, args.steps, args.after_step, args.stall)
        report = Path(tmp) / "report.json"
        started = time.monotonic()
        done = subprocess.run([sys.executable, "-m", "trainguard.cli", "drill", str(job), "--report-json",
                               str(report)], cwd=tmp, check=False)
        seconds = time.monotonic() - started
        data = json.loads(report.read_text()) if report.is_file() else {"checks": []}
        if args.json:
            args.json.write_text(json.dumps(data, indent=1, default=str))
    rows = [cell(c, int(c["name"].removeprefix("drill:hang-rank"))) for c in data["checks"]]
    for row in rows:
        print(json.dumps(row, indent=1), flush=True)
    right = sum(r["right"] for r in rows)
    print(f"{right} of {len(ranks)} drills named their rank; trainguard drill exited {done.returncode} "
          f"after {seconds:.0f} s")


if __name__ == "__main__":
    main()
