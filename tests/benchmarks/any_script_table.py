"""The public-script yardstick (issue 48): public training scripts run as they are, from a temp
dir with data made locally, through the job file ``trainguard init -y`` writes; the table of
docs/any-script.md.

    .venv/bin/python -m tests.benchmarks.any_script_table --examples /path/to/pytorch-examples \\
        [--lightning /path/to/pytorch-lightning] [--transformers /path/to/transformers] [--only NAME...] [--out FILE.md]

Public code stays out of this repository and CI cannot fetch it; each row's script comes from a
checkout given on the command line (a row whose checkout is not given is left out; the commits
are printed in the table):

- ``--examples``: https://github.com/pytorch/examples (word_language_model, time_sequence_prediction,
  gat);
- ``--lightning``: Lightning-AI/pytorch-lightning (examples/pytorch/basics/transformer.py);
- ``--transformers``: a folder holding examples/pytorch/language-modeling/run_mlm_no_trainer.py of a
  transformers whose examples import against the installed one (5.x: the examples of 4.57.0.dev0
  or later; the copy measured is the one of evalstate/transformers at 27c3403, a fork of main at
  4.57.0.dev0, as docs/invariants.md's run_clm_no_trainer.py).

Each row copies one script's folder (without its data) to a temp dir, makes its data there, runs
``trainguard init <script> -y``, applies the row's job-file edits (each one named in the table:
the goal is none beyond what only the user can know, such as a data path), then
``trainguard check trainguard.yaml``, and reads each check's verdict from the report. Nothing of
a row outlives it (``trainguard check`` ends every rank it starts; the temp dir is removed).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

TRAINGUARD = [sys.executable, "-m", "trainguard.cli"]


#: the tiny grammar: a sentence is one choice from each group, then " ."
WORDS = (("the cat", "a dog", "the bird", "my friend", "the teacher", "a child"),
         ("sees", "likes", "finds", "follows", "calls", "helps"),
         ("the ball", "a tree", "the house", "a river", "the garden", "an apple"),
         ("today", "again", "at night", "in the morning", "with joy", "slowly"))


def _sentence(rng: random.Random) -> str:
    return " ".join(rng.choice(w) for w in WORDS) + " ."


def _sentences(folder: Path, lines: dict[str, int]) -> None:
    """``<name>.txt`` for each name: sentences of a tiny grammar (a language model learns it in
    tens of steps, as it would real text's frequent words)."""
    rng = random.Random(0)
    folder.mkdir(parents=True, exist_ok=True)
    for name, count in lines.items():
        text = "".join(" " + _sentence(rng) + " \n" for _ in range(count))
        (folder / f"{name}.txt").write_text(text)


def _cora(work: Path, nodes: int = 1650, features: int = 120, classes: int = 7) -> None:
    """``cora/cora.content`` and ``cora/cora.cites`` in the Cora format (``id word... label`` and
    ``cited citing``), the script's own data folder, which it then reads instead of downloading.
    Each class has its own frequent words and mostly cites itself; ``nodes`` just past the 1600
    the script sets aside for test and validation (its dense attention is O(nodes**2) a head)."""
    rng = random.Random(0)
    folder = work / "cora"
    folder.mkdir(parents=True, exist_ok=True)
    labels = [rng.randrange(classes) for _ in range(nodes)]
    ids = rng.sample(range(1, 10 * nodes), nodes)
    rows = []
    for node, label in zip(ids, labels, strict=True):
        words = ["1" if rng.random() < (0.25 if f % classes == label else 0.03) else "0" for f in range(features)]
        rows.append("\t".join([str(node), *words, f"class_{label}"]))
    (folder / "cora.content").write_text("\n".join(rows) + "\n")
    by_class = {c: [i for i, lab in zip(ids, labels, strict=True) if lab == c] for c in range(classes)}
    cites = [f"{rng.choice(by_class[label]) if rng.random() < 0.8 else rng.choice(ids)}\t{node}"
             for node, label in zip(ids, labels, strict=True) for _ in range(3)]
    (folder / "cora.cites").write_text("\n".join(cites) + "\n")


def _wikitext_demo(work: Path, sequences: int = 5000) -> None:
    """``data/wikitext-2.txt``, which Lightning's demo ``WikiText2`` reads instead of downloading:
    enough of the tiny grammar's sentences for ``sequences`` blocks of 35 tokens (the examples
    split off 4000 of them for validation and test)."""
    rng = random.Random(0)
    lines, count = [], 0
    while count < (sequences + 1) * 35 + 1:
        line = _sentence(rng)
        lines.append(line)
        count += len(line.split()) + 1  # and <eos>
    (work / "data").mkdir(parents=True, exist_ok=True)
    (work / "data" / "wikitext-2.txt").write_text("\n".join(lines) + "\n")


def _mlm(work: Path, block: int = 32, batch: int = 8) -> None:
    """For transformers' run_mlm_no_trainer.py: ``train.txt`` of just ``batch`` blocks of
    ``block`` tokens (one optimizer step an epoch: the script logs only the ``eval_loss`` after
    each epoch, so each step has its loss line), ``valid.txt`` (the same text: the canary reads
    that eval loss, and a held-out one of 8 training blocks barely falls), ``tok`` (a word-level tokenizer
    with BERT's special tokens, ``model_max_length`` = ``block``) and ``cfg`` (a BERT of 2 layers,
    width 32) to train from scratch."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import BertConfig, PreTrainedTokenizerFast

    rng = random.Random(0)
    train: list[str] = []
    while sum(len(s.split()) + 2 for s in train) < block * batch:  # [CLS] ... [SEP]
        train.append(_sentence(rng))
    (work / "train.txt").write_text("\n".join(train) + "\n")
    (work / "valid.txt").write_text("\n".join(train) + "\n")
    special = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    words = sorted({w for group in WORDS for phrase in group for w in phrase.split()} | {"."})
    vocab = {t: i for i, t in enumerate([*special, *words])}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])])
    PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]",
                            sep_token="[SEP]", mask_token="[MASK]", model_max_length=block,
                            ).save_pretrained(str(work / "tok"))
    BertConfig(vocab_size=len(vocab), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
               intermediate_size=64, max_position_embeddings=64).save_pretrained(str(work / "cfg"))


@dataclass(frozen=True)
class Row:
    """One public script: where it is in the checkout, how its data is made, the edits a user
    still makes to the job file init writes (``(what, old, new)`` on its text)."""

    name: str
    #: which checkout the folder is in: ``examples`` (pytorch/examples), ``lightning``,
    #: ``transformers`` (the command-line option of that name gives its path)
    source: str
    folder: str
    script: str
    make_data: Callable[[Path], None]
    data_note: str
    edits: tuple[tuple[str, str, str], ...] = ()
    timeout_s: float = 900.0
    notes: tuple[str, ...] = field(default=())


def _own_generator(script: str) -> Callable[[Path], None]:
    """The data a public example makes itself: its own generator script, run in its folder."""
    return lambda work: subprocess.run([sys.executable, script], cwd=work, check=True, timeout=300)


ROWS = (
    Row("word_language_model", "examples", "word_language_model", "main.py",
        lambda d: _sentences(d / "data" / "wikitext-2", {"train": 6000, "valid": 300, "test": 300}),
        "data/wikitext-2/{train,valid,test}.txt: 6000/300/300 generated sentences (its default --data)"),
    Row("time_sequence_prediction", "examples", "time_sequence_prediction", "train.py",
        _own_generator("generate_sine_wave.py"), "traindata.pt from its own generate_sine_wave.py"),
    Row("gat", "examples", "gat", "main.py", _cora,
        "cora/cora.{content,cites} in the Cora format (its own data folder: it downloads only without it): "
        "1650 nodes, 120 binary words, 7 classes"),
    Row("lightning_transformer", "lightning", "examples/pytorch/basics", "transformer.py", _wikitext_demo,
        "data/wikitext-2.txt (the demo WikiText2 reads it instead of downloading): 5000 blocks of 35 tokens"),
    Row("run_mlm_no_trainer", "transformers", "examples/pytorch/language-modeling", "run_mlm_no_trainer.py", _mlm,
        "train.txt (8 blocks of 32 tokens: one step an epoch), valid.txt (the same text), a word-level tokenizer "
        "with BERT's special tokens (tok/) and a BERT config of 2 layers, width 32 (cfg/)",
        edits=(("the data and the model: --train_file train.txt --validation_file valid.txt --config_name cfg "
                "--tokenizer_name tok; --learning_rate 5e-3 (a tiny model from scratch: at the default 5e-5, a "
                "fine-tuning rate, the canary fails: loss fell 0.5 % in 60 steps)",
                "python run_mlm_no_trainer.py",
                "python run_mlm_no_trainer.py --train_file train.txt --validation_file valid.txt --config_name cfg "
                "--tokenizer_name tok --learning_rate 5e-3"),)),
)
#: the command-line option giving each source's checkout
SOURCES = {"examples": "a checkout of pytorch/examples", "lightning": "a checkout of Lightning-AI/pytorch-lightning",
           "transformers": "a checkout of huggingface/transformers (its examples/pytorch folder is enough)"}


@dataclass
class Result:
    row: Row
    guessed: list[str]
    verdicts: dict[str, str]
    seconds: float
    error: str = ""


def run_row(row: Row, examples: Path) -> Result:
    """init, the row's edits, then ``trainguard check`` in a temp copy of the script's folder
    (``examples``: the checkout of the row's source)."""
    with tempfile.TemporaryDirectory(prefix=f"tg-anyscript-{row.name}-") as tmp:
        work = Path(tmp) / row.folder.rsplit("/", 1)[-1]
        shutil.copytree(examples / row.folder, work, ignore=shutil.ignore_patterns("data"))
        row.make_data(work)
        started = time.monotonic()
        init = subprocess.run([*TRAINGUARD, "init", row.script, "-y"], cwd=work, capture_output=True, text=True,
                              timeout=120)
        guessed = [line.strip() for line in init.stdout.splitlines() if line.startswith("  ")]
        if init.returncode != 0:
            return Result(row, guessed, {}, time.monotonic() - started, f"init exited {init.returncode}: {init.stderr[-500:]}")
        job = work / "trainguard.yaml"
        text = job.read_text()
        for what, old, new in row.edits:
            if old not in text:
                return Result(row, guessed, {}, time.monotonic() - started, f"edit {what!r}: {old!r} not in the job file")
            text = text.replace(old, new)
        job.write_text(text)
        report = work / "report.json"
        subprocess.run([*TRAINGUARD, "check", "trainguard.yaml", "--report-json", str(report)], cwd=work,
                       capture_output=True, text=True, timeout=row.timeout_s)
        if not report.exists():
            return Result(row, guessed, {}, time.monotonic() - started, "no report")
        checks = json.loads(report.read_text())["checks"]
        verdicts = {c["name"]: f"{c['status']}: {c['summary'][:160]}" for c in checks}
        return Result(row, guessed, verdicts, time.monotonic() - started)


def table(results: list[Result], commit: str) -> str:
    lines = [f"{commit}; `trainguard init <script> -y`, the edits named, then "
             "`trainguard check trainguard.yaml`.", "",
             "| script | data made locally | what init guessed | edits to the job file | verdicts | s |",
             "|---|---|---|---|---|---|"]
    for r in results:
        edits = "; ".join(what for what, _, _ in r.row.edits) or "none"
        verdicts = "<br>".join(f"{name} {v}" for name, v in r.verdicts.items()) or r.error
        guessed = "<br>".join(g.replace("|", "\\|") for g in r.guessed)
        lines.append(f"| {r.row.source}: `{r.row.folder}/{r.row.script}` | {r.row.data_note} | {guessed} | {edits} | "
                     f"{verdicts.replace('|', chr(92) + '|')} | {r.seconds:.0f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for source, what in SOURCES.items():
        parser.add_argument(f"--{source}", type=Path, help=f"{what} (its rows are left out without it)")
    parser.add_argument("--out", type=Path, help="write the table here too")
    parser.add_argument("--only", nargs="*", default=None, help="rows whose name holds one of these")
    args = parser.parse_args()
    checkouts: dict[str, Path] = {s: getattr(args, s) for s in SOURCES if getattr(args, s) is not None}
    if not checkouts:
        parser.error(f"give at least one checkout: {', '.join('--' + s for s in SOURCES)}")
    commits = []
    for source, path in checkouts.items():
        git = subprocess.run(["git", "-C", str(path), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
        commits.append(f"{source} at {git.stdout.strip() or 'an unknown commit'}")
    rows = [r for r in ROWS if r.source in checkouts and (args.only is None or any(o in r.name for o in args.only))]
    results = [run_row(row, checkouts[row.source]) for row in rows]
    commit = ", ".join(commits)
    text = table(results, commit)
    print(text)
    if args.out is not None:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
