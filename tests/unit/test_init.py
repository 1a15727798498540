"""``trainguard init`` recognises the kind of training script and writes a job file that runs.

Each script here is a small one of our own, written in the style of its framework (a Trainer
script over ``HfArgumentParser``, a Lightning script, a nanoGPT-style ``--key=value``
configurator, an argparse script); init only reads their source, so the framework scripts need
not run. The argparse and configurator scripts are pure Python and do run: ``trainguard check
--only smoke`` on what init wrote proves the command, the loss regex, the checkpoints, the resume
arguments and ``distributed_env`` are right.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import get_args

import pytest

from trainguard.cli.init import KINDS
from trainguard.config import MetricRegex, MetricTrainer, load_config, parse_config
from trainguard.config.scaffold import (
    SAVE_EVERY,
    InitChoices,
    draft_job,
    installed_training_arguments,
    render_job_file,
)
from trainguard.config.scriptscan import ScriptKind, scan_script
from trainguard.errors import ConfigError

_SCRIPT = Path(sys.executable).parent / "trainguard"
TRAINGUARD = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "trainguard.cli"]


def run_cli(*args: str | Path, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_")}
    env["TRAINGUARD_TRACKING"] = "off"
    return subprocess.run([*TRAINGUARD, *map(str, args)], env=env, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=timeout, check=False)


def init(directory: Path, name: str, source: str, *flags: str) -> tuple[str, str]:
    """Write ``source`` as ``directory/name``, run init on it: (its stdout, the YAML it wrote)."""
    (directory / name).parent.mkdir(parents=True, exist_ok=True)
    (directory / name).write_text(textwrap.dedent(source), encoding="utf-8")
    done = run_cli("init", name, "--dir", directory, "--yes", "--force", *flags)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout, flat((directory / "trainguard.yaml").read_text(encoding="utf-8"))


def flat(text: str) -> str:
    """``text`` with each wrapped comment joined back into one line."""
    return re.sub(r"\n *# {3}", " ", text)


def line_of(source: str, needle: str) -> int:
    """The line of ``source`` (dedented as init reads it) that holds ``needle``."""
    return next(i for i, line in enumerate(textwrap.dedent(source).splitlines(), 1) if needle in line)


def draft(source: str, name: str = "train.py", **choices: object) -> str:
    """The job file init writes for ``source``, without a subprocess (checked to load)."""
    facts = scan_script(textwrap.dedent(source), name)
    text = render_job_file(draft_job(facts, name, InitChoices(**choices)))  # type: ignore[arg-type]
    parse_config(text)
    return flat(text)


# --------------------------------------------------------------------------------------------
# Scripts (ours, in each framework's style)
# --------------------------------------------------------------------------------------------

#: an argparse script whose flags are none of trainguard's old defaults: it resumes from a
#: checkpoint directory it is given, saves every --save-every steps (its default too long for the
#: checks; checkpoint-N/ with a JSON state, torch-free) and prints a decoy eval line
ARGPARSE = '''
    import argparse, json, math, os, random
    from pathlib import Path

    p = argparse.ArgumentParser()
    p.add_argument("--max-steps", type=int, default=1000)
    p.add_argument("--out-dir", default="runs")
    p.add_argument("--random-seed", type=int, default=7)
    p.add_argument("--save-every", type=int, default=200)
    p.add_argument("--resume-from", default=None, help="a checkpoint file")
    p.add_argument("--lr", type=float, default=0.1)
    args = p.parse_args()
    rank = int(os.environ.get("RANK", 0))
    rng = random.Random(args.random_seed * 100 + rank)
    start = 1
    if args.resume_from:
        state = json.loads((Path(args.resume_from) / "trainer_state.json").read_text())
        start = state["global_step"] + 1
        rng.setstate((state["rng"][0], tuple(state["rng"][1]), state["rng"][2]))
    for it in range(start, args.max_steps + 1):
        loss = 3.0 * math.exp(-0.05 * it) + 0.01 * rng.random()
        print(f"[train] iteration {it:5d} | lr {args.lr:.2e} | loss {loss:.6f}", flush=True)
        if it % 10 == 0:
            print(f"eval at step {it}: val_loss {loss * 1.1:.4f}", flush=True)
        if it % args.save_every == 0 and rank == 0:
            tmp = Path(args.out_dir) / f"tmp-checkpoint-{it}"
            tmp.mkdir(parents=True)
            (tmp / "trainer_state.json").write_text(json.dumps({"global_step": it, "rng": rng.getstate()}))
            os.replace(tmp, tmp.with_name(f"checkpoint-{it}"))
'''

#: our own minimal configurator: config files and --key=value overrides of the script's globals
CONFIGURATOR = '''
    import sys
    from ast import literal_eval
    for arg in sys.argv[1:]:
        if "=" not in arg:
            exec(open(arg).read())
            continue
        key, value = arg[2:].split("=", 1)
        if key not in globals():
            raise ValueError(f"unknown setting {key}")
        try:
            value = literal_eval(value)
        except (SyntaxError, ValueError):
            pass
        globals()[key] = value
'''

#: a nanoGPT-style script: settings at module level, a configurator, a DDP branch that needs
#: CUDA when RANK is set, a loss line every log_interval steps, a checkpoint every eval_interval
NANO = '''
    import json, math, os, random, time
    out_dir = "out"
    max_iters = 5000
    eval_interval = 250
    log_interval = 10
    init_from = "scratch"  # or "resume"
    device = "cuda"
    compile = True
    backend = "nccl"
    exec(open("configurator.py").read())

    ddp = int(os.environ.get("RANK", -1)) != -1
    if ddp:
        import torch
        torch.distributed.init_process_group(backend=backend)
        torch.cuda.set_device(f"cuda:{os.environ['LOCAL_RANK']}")
    rng = random.Random(1337)
    iter_num = 1
    if init_from == "resume":
        state = json.load(open(os.path.join(out_dir, "ckpt.json")))
        iter_num = state["iter_num"] + 1
        rng.setstate((state["rng"][0], tuple(state["rng"][1]), state["rng"][2]))
    while iter_num <= max_iters:
        t0 = time.time()
        lossf = 4.0 * math.exp(-0.03 * iter_num) + 0.01 * rng.random()
        dt = time.time() - t0
        if iter_num % log_interval == 0:
            print(f"iter {iter_num}: loss {lossf:.4f}, time {dt*1000:.2f}ms")
        if iter_num % eval_interval == 0:
            os.makedirs(out_dir, exist_ok=True)
            with open(os.path.join(out_dir, "ckpt.tmp"), "w") as f:
                json.dump({"iter_num": iter_num, "rng": rng.getstate()}, f)
            os.replace(os.path.join(out_dir, "ckpt.tmp"), os.path.join(out_dir, "ckpt.json"))
        iter_num += 1
'''

#: a Trainer script over HfArgumentParser, with its own required and one-of options
HF = '''
    from dataclasses import dataclass, field

    from transformers import AutoModelForCausalLM, HfArgumentParser, Trainer, TrainingArguments


    @dataclass
    class DataArguments:
        corpus: str = field(metadata={"help": "a text file"})
        block_size: int = 64
        tokenizer_dir: str | None = None


    @dataclass
    class ModelArguments:
        model_name_or_path: str | None = None
        config_name: str | None = None

        def __post_init__(self):
            if self.model_name_or_path is None and self.config_name is None:
                raise ValueError("give --model_name_or_path or --config_name")


    def main():
        parser = HfArgumentParser((DataArguments, ModelArguments, TrainingArguments))
        data_args, model_args, training_args = parser.parse_args_into_dataclasses()
        model = AutoModelForCausalLM.from_pretrained(model_args.model_name_or_path)
        trainer = Trainer(model=model, args=training_args)
        if training_args.do_train:
            trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)


    if __name__ == "__main__":
        main()
'''

#: a Lightning script with argparse: a checkpoint path to resume from, ModelCheckpoint every N
LIGHTNING = '''
    import argparse

    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    p = argparse.ArgumentParser()
    p.add_argument("--max_steps", type=int, default=500)
    p.add_argument("--default_root_dir", default="lightning_runs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--every", type=int, default=100)
    p.add_argument("--ckpt_path", default=None, help="resume from this checkpoint")
    args = p.parse_args()
    pl.seed_everything(args.seed)
    every = ModelCheckpoint(dirpath=args.default_root_dir, every_n_train_steps=args.every, save_last=True)
    trainer = pl.Trainer(max_steps=args.max_steps, callbacks=[every], accelerator="cpu")
    trainer.fit(model=None, ckpt_path=args.ckpt_path)
'''


# --------------------------------------------------------------------------------------------
# Each kind, through the CLI; the two runnable ones run their smoke check
# --------------------------------------------------------------------------------------------


def test_argparse_script_gets_its_own_flags_a_derived_regex_and_a_smoke_that_passes(tmp_path: Path) -> None:
    out, text = init(tmp_path, "train.py", ARGPARSE)
    assert "train.py: an argparse script" in out
    assert "steps: --max-steps (argparse, line" in out
    job = load_config(tmp_path / "trainguard.yaml").job
    assert job.command == ["python", "train.py", "--max-steps", "{steps}", "--out-dir", "{checkpoint_dir}",
                           "--random-seed", "{seed}", "--save-every", str(SAVE_EVERY)]
    assert job.resume_args == ["--resume-from", "{latest_checkpoint}"]
    # the training line, not the eval line that also has a loss and a step
    assert job.metrics["loss"] == r"\[train\] iteration +(?P<step>\d+) \| lr .*? \| loss (?P<value>[-+.\w]+)"
    assert f"from train.py line {line_of(ARGPARSE, '[train] iteration')}:" in text and "--save-every 5: a checkpoint every 5 steps (the default is 200)" in text

    run = run_cli("check", tmp_path / "trainguard.yaml", "--only", "smoke")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "PASSED  smoke: 5 steps" in run.stdout and "resumed from the checkpoint of step 5 at step 6" in run.stdout


def test_configurator_script_runs_as_one_plain_process(tmp_path: Path) -> None:
    (tmp_path / "configurator.py").write_text(textwrap.dedent(CONFIGURATOR), encoding="utf-8")
    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "small.py").write_text("max_iters = 100\n", encoding="utf-8")
    out, text = init(tmp_path, "train.py", NANO)
    assert "a nanoGPT-style script" in out
    assert f"exec(open(\"configurator.py\").read()) at line {line_of(NANO, 'exec(')}" in out
    job = load_config(tmp_path / "trainguard.yaml").job
    assert job.command == ["python", "train.py", "--max_iters={steps}", "--out_dir={checkpoint_dir}",
                           "--device=cpu", "--compile=False", f"--eval_interval={SAVE_EVERY}", "--log_interval=1"]
    assert job.resume_args == ["--init_from=resume"]
    assert job.distributed_env is False
    assert job.metrics["loss"] == r"iter (?P<step>\d+): loss (?P<value>[-+.\w]+)"
    assert "no seed setting in train.py: {seed} is not passed" in text
    assert (f"under `if ddp:` (line {line_of(NANO, 'if ddp:')}) it calls torch.cuda.set_device() "
            f"(line {line_of(NANO, 'set_device')})") in text
    assert "TODO: train.py takes a config file as an argument (config/small.py)" in text

    # RANK unset (distributed_env: false) keeps it out of its CUDA branch; --log_interval=1
    # gives a loss line every step; --eval_interval=5 a checkpoint to resume from
    run = run_cli("check", tmp_path / "trainguard.yaml", "--only", "smoke")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "resumed from the checkpoint of step 5 at step 6" in run.stdout


def test_huggingface_trainer_script(tmp_path: Path) -> None:
    out, text = init(tmp_path, "train_hf.py", HF)
    assert "a Hugging Face Trainer script (imports transformers and uses" in out
    job = load_config(tmp_path / "trainguard.yaml").job
    overwrite = ["--overwrite_output_dir"] if "overwrite_output_dir" in (installed_training_arguments() or ()) else []
    assert job.command == ["python", "train_hf.py", "--max_steps", "{steps}", "--output_dir", "{checkpoint_dir}",
                           "--seed", "{seed}", "--save_steps", str(SAVE_EVERY), "--logging_steps", "1",
                           "--do_train", "--report_to", "none", *overwrite]
    assert job.metrics["loss"] == MetricTrainer(trainer="huggingface")
    assert job.resume_args == ["--resume_from_checkpoint", "{latest_checkpoint}"]
    assert f"# TODO: train_hf.py requires: --corpus (line {line_of(HF, 'corpus: str')})" in text
    assert "# TODO: train_hf.py needs one of --model_name_or_path, --config_name" in text
    assert "--tokenizer_dir" in text  # defaults to None: may need a value
    assert 'HF_HUB_OFFLINE: "1"' in text


def test_lightning_script(tmp_path: Path) -> None:
    out, _ = init(tmp_path, "train_pl.py", LIGHTNING)
    assert "a Lightning script (imports lightning and uses Trainer" in out
    job = load_config(tmp_path / "trainguard.yaml").job
    assert job.command == ["python", "train_pl.py", "--max_steps", "{steps}", "--default_root_dir",
                           "{checkpoint_dir}", "--seed", "{seed}", "--every", str(SAVE_EVERY)]
    assert job.metrics["loss"] == MetricTrainer(trainer="lightning")
    assert job.resume_args == ["--ckpt_path", "{latest_checkpoint}"]


def test_explicit_flags_override_detection(tmp_path: Path) -> None:
    (tmp_path / "configurator.py").write_text(textwrap.dedent(CONFIGURATOR), encoding="utf-8")
    _, text = init(tmp_path, "train.py", NANO, "--steps-flag", "--max_steps", "--resume-flag",
                   "--init_from=resume --strict=1", "--loss-regex", r"it (?P<step>\d+) (?P<value>\S+)",
                   "--name", "nano")
    job = load_config(tmp_path / "trainguard.yaml").job
    assert job.name == "nano"
    assert job.command[2] == "--max_steps={steps}"  # a configurator takes --key=value
    assert job.resume_args == ["--init_from=resume", "--strict=1"]
    assert job.metrics["loss"] == r"it (?P<step>\d+) (?P<value>\S+)"
    _, text = init(tmp_path, "train.py", NANO, "--kind", "argparse")
    assert "--kind argparse; init itself found configurator" in text
    assert (*KINDS, "plain") == get_args(ScriptKind)


# --------------------------------------------------------------------------------------------
# What init reads: each guess with a case it must catch and one it must leave alone
# --------------------------------------------------------------------------------------------


def test_cuda_only_ddp_branch_and_a_branch_with_a_cpu_fallback() -> None:
    cuda = '''
        import os, torch
        if "LOCAL_RANK" in os.environ:
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
            torch.distributed.init_process_group("nccl")
        for step in range(10):
            print(f"step {step} loss {0.1:.3f}")
    '''
    assert "distributed_env: false" in draft(cuda)
    fallback = cuda.replace('init_process_group("nccl")',
                            'init_process_group("nccl" if torch.cuda.is_available() else "gloo")')
    assert "distributed_env" not in draft(fallback)
    # a CUDA-only branch with more ranks asked for: launched distributed, and said so
    text = draft(cuda, world_size=2)
    assert "distributed_env: false" not in text and "its DDP branch needs CUDA and NCCL for 2 ranks" in text


@pytest.mark.parametrize(
    ("line", "regex"),
    [
        ('print("step {} loss {:.4f}".format(step, loss))', r"step (?P<step>\d+) loss (?P<value>[-+.\w]+)"),
        ('print("step %d | loss %.3f" % (step, loss.item()))', r"step (?P<step>\d+) \| loss (?P<value>[-+.\w]+)"),
        # %s of a loss may print a tensor: tensor(0.52, grad_fn=...)
        ('logger.info("global step %d: loss=%s", global_step, loss)',
         r"global step (?P<step>\d+): loss=(?:tensor\()?(?P<value>[-+.\w]+)"),
        ('print("step", step, "loss", loss)', r"step (?P<step>\d+) loss (?:tensor\()?(?P<value>[-+.\w]+)"),
        ('print(f"{epoch=} it {i}: loss {running / n:.4f}")', r"epoch=.*? it (?P<step>\d+): loss (?P<value>[-+.\w]+)"),
    ],
)
def test_loss_regex_from_the_printed_line(line: str, regex: str) -> None:
    source = f"import argparse\np = argparse.ArgumentParser()\np.add_argument('--steps')\nfor step in range(9):\n    {line}\n"
    facts = scan_script(source)
    assert facts.loss_lines[0].regex == regex
    assert facts.loss_lines[0].has_step


def test_a_loss_line_without_a_step_counts_lines_and_leaves_resume_out() -> None:
    source = '''
        import argparse
        p = argparse.ArgumentParser()
        p.add_argument("--steps", type=int)
        p.add_argument("--ckpt-dir")
        p.add_argument("--resume", action="store_true")
        args = p.parse_args()
        for batch in range(args.steps):
            print(f"loss: {0.5:.4f}")
    '''
    text = draft(source)
    job = parse_config(text).job
    assert job.metrics["loss"] == MetricRegex(regex=r"loss: (?P<value>[-+.\w]+)", step="count")
    assert job.resume_args == []
    assert "# resume: {steps: 40, after_step: 25}" in text


def test_a_script_init_cannot_read_keeps_the_old_flags_marked_todo() -> None:
    # it reads its command line in a way init cannot follow (a script that reads none gets no
    # flags: tests/unit/test_any_script.py)
    text = draft("import sys\nimport torch\nsettings = sys.argv[1:]\nmodel = torch.nn.Linear(2, 2)\n")
    job = parse_config(text).job
    assert job.command == ["python", "train.py", "--steps", "{steps}", "--ckpt-dir", "{checkpoint_dir}",
                           "--seed", "{seed}"]
    assert job.resume_args == ["--resume"]
    assert "# TODO: init found no options in train.py" in text
    assert "# TODO: init found no line train.py prints with its loss" in text


def test_hf_script_that_never_passes_resume_gets_a_todo() -> None:
    source = HF.replace("trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)",
                        "trainer.train()")
    assert "never reads resume_from_checkpoint nor passes it to" in draft(source)
    assert "never reads resume_from_checkpoint" not in draft(HF)


def test_a_file_that_is_not_python_exits_2_naming_the_line(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text("def broken(:\n", encoding="utf-8")
    done = run_cli("init", "train.py", "--dir", tmp_path, "--yes")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "train.py: cannot read the training script: line 1:" in done.stderr
    assert not (tmp_path / "trainguard.yaml").exists()
    with pytest.raises(ConfigError, match="never runs it"):
        scan_script("x = (", "t.py")


# --------------------------------------------------------------------------------------------
# odd names: what init writes loads back exactly and runs (issue 13, item 13)
# --------------------------------------------------------------------------------------------

_TOY = Path(__file__).resolve().parents[1] / "data" / "jobs" / "toy_train.py"

ODD_NAMES = [
    "my train", "it's", 'say "hi"', "a #b", "key: value", "-lead", "--double", "ünïcødé 训练",
    "{steps}", "back\\slash", "tab\there", "line\nbreak", "sep\u2028arator", "  padded  ",
    "emoji 🚀", "del\x7f", "trailing #", "&*!|;$(x)`y`",
]


def init_in_process(directory: Path, script: str, *flags: str,
                    capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    from trainguard.cli import main

    try:
        code = main(["init", "--dir", str(directory), "--yes", "--force", *flags, "--", script])
    except SystemExit as exc:
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return code, out, err


@pytest.mark.parametrize("name", ODD_NAMES)
def test_an_odd_job_name_and_script_name_load_back_exactly(
    name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    script = f"{name}.py"
    (tmp_path / script).write_text(_TOY.read_text())
    code, out, err = init_in_process(tmp_path, script, f"--name={name}", capsys=capsys)  # = for "-lead"
    assert code == 0, out + err
    job = load_config(tmp_path / "trainguard.yaml").job
    assert job.name == name
    shown = f"./{script}" if script.startswith("-") else script
    assert job.command[:2] == ["python", shown.replace("{", "{{").replace("}", "}}")]
    from trainguard.config.schema import render_placeholders

    assert render_placeholders(job.command[1], {}) == shown  # a brace is not a placeholder
    test_file = tmp_path / "tests" / "test_trainguard_job.py"
    module = compile(test_file.read_text(encoding="utf-8"), str(test_file), "exec")
    assert module.co_consts[0] == f"trainguard checks of the {name} job, run by pytest (written by `trainguard init`)."


def test_the_written_command_runs_a_script_with_a_space_a_quote_a_hash_and_a_leading_dash(
    tmp_path: Path,
) -> None:
    script = "-my train's #1 {x}.py"
    (tmp_path / script).write_text(_TOY.read_text())
    done = run_cli("init", "--dir", tmp_path, "--yes", "--name", "a #b", "--", script)
    assert done.returncode == 0, done.stdout + done.stderr
    text = (tmp_path / "trainguard.yaml").read_text(encoding="utf-8")
    assert "python './-my train'\"'\"'s #1 {{x}}.py'" in text  # one shell word
    run = run_cli("check", tmp_path / "trainguard.yaml", "--only", "smoke")
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.startswith("PASSED  smoke: 5 steps in")


def test_a_script_name_that_is_not_utf8_is_refused_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = init_in_process(tmp_path, "bad\udcff.py", capsys=capsys)
    assert code == 2 and "argument SCRIPT" in err and "not UTF-8" in err
    assert not (tmp_path / "trainguard.yaml").exists()


def test_end_of_input_at_a_question_exits_2_writing_nothing(tmp_path: Path) -> None:
    """Interactive init in a real terminal (a pty): Ctrl-D at the first question."""
    import pty

    (tmp_path / "train.py").write_text(_TOY.read_text())
    leader, follower = pty.openpty()
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_")}
    try:
        proc = subprocess.Popen([*TRAINGUARD, "init", "train.py", "--dir", str(tmp_path)], stdin=follower,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        os.close(follower)
        follower = -1
        os.write(leader, b"\x04")  # Ctrl-D: input() reads end of file
        out, err = proc.communicate(timeout=60)
    finally:
        os.close(leader)
        if follower >= 0:
            os.close(follower)
    assert proc.returncode == 2 and "Traceback" not in err, out + err
    assert "(end of input): nothing written" in err
    assert not (tmp_path / "trainguard.yaml").exists()


def test_a_script_nested_past_the_parser_exits_2(tmp_path: Path) -> None:
    (tmp_path / "deep.py").write_text("x = " + "+".join(["1"] * 200_000) + "\n")
    done = run_cli("init", "deep.py", "--dir", tmp_path, "--yes")
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert "deep.py: cannot read the training script: its code nests too deeply" in done.stderr


@pytest.mark.parametrize(
    ("flag", "named"),
    [("--loss-regex=(", "--loss-regex: '(' is not a valid regular expression"),
     ("--loss-regex=step (?P<step>\\d+)", "--loss-regex: regex"),
     ("--steps-flag={bogus}", "--steps-flag/--ckpt-flag/--seed-flag: unknown placeholder {bogus}")],
)
def test_a_flag_that_makes_the_job_file_invalid_is_named(
    flag: str, named: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "train.py").write_text(_TOY.read_text())
    code, _, err = init_in_process(tmp_path, "train.py", flag, capsys=capsys)
    assert code == 2 and named in err and "nothing written" in err, err
    assert not (tmp_path / "trainguard.yaml").exists()
