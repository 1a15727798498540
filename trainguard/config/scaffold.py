"""The job file ``trainguard init`` writes for a training script, from what
:mod:`trainguard.config.scriptscan` read in it.

:func:`draft_job` decides the command, the resume arguments, the metric source, the launch
settings and what is left to the user (``TODO``), for each kind of script:

- **Hugging Face Trainer** (``HfArgumentParser`` over ``TrainingArguments``): the Trainer's own
  flags (``--max_steps {steps} --output_dir {checkpoint_dir} --seed {seed} --save_steps 10
  --logging_steps 1``), ``loss: {trainer: huggingface}``, ``--resume_from_checkpoint
  {latest_checkpoint}``, and the script's own options it needs listed as a TODO.
- **Lightning** (``Trainer``; ``LightningCLI``): the script's options matched by name,
  ``loss: {trainer: lightning}``.
- **nanoGPT-style configurators** (module-level settings overridden by ``--key=value``): the
  settings that exist, ``--device=cpu --compile=False``, ``--init_from=resume``, and
  ``distributed_env: false`` when the script's DDP branch needs CUDA.
- **argparse scripts**: the options matched by name, the loss regex from the line it prints.

Every guess is said in a comment of the file, and :attr:`JobDraft.guesses` lists them for the
terminal. :func:`render_job_file` writes the YAML text.
"""

from __future__ import annotations

import ast
import importlib.util
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from trainguard.config.scriptscan import ScriptFacts, ScriptKind, ScriptOption

__all__ = ["SAVE_EVERY", "InitChoices", "JobDraft", "draft_job", "installed_training_arguments",
           "kind_words", "render_job_file"]

#: the checkpoint interval init asks for when the script's default is longer: the smoke check
#: it writes runs 5 steps and wants a checkpoint, the resume check kills the run after step 25
SAVE_EVERY = 5
#: the checks init writes, and whether each needs a resumable job
_CHECKS = (("smoke", "{steps: 5}"), ("canary", "{}"), ("determinism", "{steps: 20}"), ("resume", "{steps: 40, after_step: 25}"))

#: names of the options that set each role, most likely first (matched on the option's dest)
_STEPS = ("steps", "max_steps", "num_steps", "total_steps", "train_steps", "n_steps",
          "training_steps", "num_training_steps", "max_train_steps", "max_iters", "max_iter",
          "num_iters", "n_iters", "iters", "iterations", "num_iterations", "max_iterations")
_CKPT = ("ckpt_dir", "checkpoint_dir", "checkpoints_dir", "ckpt_path_dir", "save_dir", "ckpt",
         "checkpoint", "checkpoints", "output_dir", "out_dir", "outdir", "output", "out",
         "save_path", "checkpoint_path", "model_dir", "default_root_dir")
_SEED = ("seed", "random_seed", "rng_seed", "manual_seed", "global_seed")
_RESUME = ("resume", "resume_from_checkpoint", "resume_from", "resume_path", "resume_ckpt",
           "ckpt_path", "load_ckpt", "load_checkpoint", "restore", "restore_from", "load_from",
           "init_from", "auto_resume", "continue_training")
_INTERVAL = ("ckpt_every", "checkpoint_every", "save_every", "save_interval", "ckpt_interval",
             "checkpoint_interval", "save_steps", "save_freq", "ckpt_freq", "checkpoint_freq",
             "save_every_n_steps", "ckpt_steps", "eval_interval")
#: options of a Hugging Face script that usually need a value when they default to None
_HF_INPUT = re.compile(r"model|tokenizer|config_name|dataset|train_file|validation_file|data_(dir|path|file)")
_FALLBACK_REGEX = r"step (?P<step>\d+) loss (?P<value>\S+)"


@dataclass
class InitChoices:
    """What the user gave on the command line; None: detect it."""

    name: str | None = None
    steps_flag: str | None = None
    ckpt_flag: str | None = None
    seed_flag: str | None = None
    #: the whole resume arguments (``--resume``, ``--init_from=resume``)
    resume_args: str | None = None
    loss_regex: str | None = None
    world_size: int = 1


@dataclass
class JobDraft:
    """The job file init proposes, with the reason for each part."""

    kind: ScriptKind
    evidence: str
    name: str
    command: list[str]
    cwd: str = "."
    resume_args: str | None = None
    world_size: int = 1
    distributed_env: bool = True
    #: the script has no option for its number of steps: trainguard ends the runs itself
    stop_after_steps: bool = False
    env: dict[str, str] = field(default_factory=lambda: {"OMP_NUM_THREADS": "1"})
    metric: str | dict[str, str] = _FALLBACK_REGEX
    #: the flags used for each role (``steps``, ``ckpt``, ``seed``), None where none
    flags: dict[str, str | None] = field(default_factory=dict)
    #: one line per guess, for the terminal and the comments (``steps: --max_iters (module-level ...)``)
    guesses: list[str] = field(default_factory=list)
    command_notes: list[str] = field(default_factory=list)
    resume_notes: list[str] = field(default_factory=list)
    launch_notes: list[str] = field(default_factory=list)
    env_notes: list[str] = field(default_factory=list)
    metric_notes: list[str] = field(default_factory=list)
    #: what init could not decide; written as TODO comments at the top
    todos: list[str] = field(default_factory=list)

    @property
    def resumable(self) -> bool:
        """Whether the resume check can run: resume arguments, a checkpoint directory and a
        metric whose step survives a restart."""
        counted = isinstance(self.metric, dict) and self.metric.get("step") == "count"
        return (self.resume_args is not None and "{checkpoint_dir}" in " ".join(self.command)
                and not counted)


def installed_training_arguments() -> set[str] | None:
    """The fields of the installed ``transformers.TrainingArguments``, read from its source
    (``transformers`` is not imported); None when it is not installed here."""
    try:
        spec = importlib.util.find_spec("transformers")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "training_args.py"
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, ValueError):
        return None
    return {stmt.target.id for node in tree.body if isinstance(node, ast.ClassDef)
            and node.name == "TrainingArguments" for stmt in node.body
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)}


def draft_job(facts: ScriptFacts, script: str, choices: InitChoices | None = None, *,
              config_files: tuple[str, ...] = (), hf_fields: set[str] | None = None) -> JobDraft:
    """The job file for ``facts`` (read from ``script``, a path relative to where the job file
    goes). ``config_files``: config files found next to a configurator script;
    ``hf_fields``: the installed ``TrainingArguments`` fields (:func:`installed_training_arguments`)."""
    choices = choices or InitChoices()
    kind = facts.kind
    path = Path(script)
    draft = JobDraft(kind=kind, evidence=facts.evidence,
                     name=choices.name or path.stem, command=["python", _script_token(path.as_posix())],
                     world_size=choices.world_size)
    if kind == "configurator":
        draft.cwd = path.parent.as_posix() if path.parent != Path() else "."
        draft.command = ["python", _script_token(path.name)]
    builder = _Builder(facts, draft, choices, path.name)
    if kind == "huggingface" and facts.hf_cli:
        builder.huggingface_cli(hf_fields)
    elif kind == "lightning" and facts.lightning_cli:
        builder.lightning_cli()
    elif kind == "configurator":
        builder.configurator(config_files)
    else:
        builder.by_options()
    builder.metric()
    builder.launch()
    builder.required()
    return draft


class _Builder:
    def __init__(self, facts: ScriptFacts, draft: JobDraft, choices: InitChoices, script: str) -> None:
        self.facts, self.draft, self.choices = facts, draft, choices
        self.script = script
        self.eq = draft.kind == "configurator"  # --key=value

    # ---- helpers ------------------------------------------------------------------------------

    def find(self, names: tuple[str, ...], *, value: bool = True) -> ScriptOption | None:
        options = [o for o in self.facts.options if o.flag and (o.takes_value or not value)]
        by_dest = {o.dest.lower(): o for o in options}
        return next((by_dest[n] for n in names if n in by_dest), None)

    def add(self, flag: str, value: str) -> None:
        self.draft.command += [f"{flag}={value}"] if self.eq else [flag, value]

    def role(self, role: str, given: str | None, names: tuple[str, ...], placeholder: str,
             fallback: str | None) -> str | None:
        """Put ``flag placeholder`` for ``role`` on the command; the flag used, or None."""
        if given:
            self.add(given, placeholder)
            self.draft.guesses.append(f"{role}: {given} (given)")
            return given
        option = self.find(names)
        if option is not None:
            self.add(option.flag, placeholder)
            was = f" = {option.default_text}" if option.default_text and self.eq else ""
            self.draft.guesses.append(f"{role}: {option.flag} ({self.where(option)}{was})")
            return option.flag
        if fallback is None:
            return None
        self.add(fallback, placeholder)
        self.draft.guesses.append(f"{role}: {fallback} (a guess: {self.script} has no option init "
                                  "recognised)")
        if self.facts.options:  # else one TODO says all the flags are guesses
                self.draft.todos.append(f"{self.script} has no option init recognised for the {role}; "
                                    f"the command passes {fallback} {placeholder}: replace it with "
                                    "the script's own")
        return fallback

    def where(self, option: ScriptOption) -> str:
        if option.origin == "argparse":
            return f"argparse, line {option.line}"
        if option.origin == "setting":
            return f"module-level setting, line {option.line}"
        return f"{option.origin}.{option.dest}, line {option.line}"

    def interval(self, names: tuple[str, ...]) -> None:
        """Checkpoint often enough for the resume check when the script's default is longer."""
        found = [n for n, _ in self.facts.save_intervals]
        option = self.find(tuple(dict.fromkeys([*found, *names])))
        if option is None:
            return
        if isinstance(option.default, int) and not isinstance(option.default, bool) and 0 < option.default <= SAVE_EVERY:
            self.draft.guesses.append(f"checkpoints: every {option.default} steps ({option.flag} default)")
            return
        self.add(option.flag, str(SAVE_EVERY))
        default = option.default_text or "none"
        shown = f"{option.flag}={SAVE_EVERY}" if self.eq else f"{option.flag} {SAVE_EVERY}"
        self.draft.guesses.append(f"checkpoints: {shown} (default {default})")
        self.draft.command_notes.append(
            f"{shown}: a checkpoint every {SAVE_EVERY} steps (the default is {default}), so the "
            "smoke check (5 steps) has one to load and the resume check (killed after step 25) one "
            "to resume from")

    def resume_from_option(self) -> None:
        if self.choices.resume_args is not None:
            self.draft.resume_args = self.choices.resume_args
            self.draft.guesses.append(f"resume: {self.choices.resume_args} (given)")
            return
        option = self.find(_RESUME, value=False)
        if option is None:
            self.draft.todos.append(f"{self.script} has no option init recognised to resume "
                                    "(--resume, --resume_from_checkpoint PATH, ...): the resume "
                                    "check is left out; add `resume_args` and the check")
            return
        if not option.takes_value:
            args = option.flag
        elif "resume" in self.facts.compared.get(option.dest, set()) or "resume" in option.choices:
            args = f"{option.flag}={'resume'}" if self.eq else f"{option.flag} resume"
        else:
            args = f"{option.flag}={{latest_checkpoint}}" if self.eq else f"{option.flag} {{latest_checkpoint}}"
        self.draft.resume_args = args
        self.draft.guesses.append(f"resume: {args} ({self.where(option)})")
        if "{latest_checkpoint}" in args:
            self.draft.resume_notes.append("{latest_checkpoint}: the newest complete checkpoint "
                                           "under {checkpoint_dir}")

    # ---- each kind ----------------------------------------------------------------------------

    def by_options(self) -> None:
        """argparse scripts, Lightning and Hugging Face scripts with their own options, and
        scripts init cannot read (today's flags, marked as guesses)."""
        plain = self.draft.kind == "plain" or not self.facts.options
        c = self.choices
        if plain and not self.facts.reads_arguments and not any(
                (c.steps_flag, c.ckpt_flag, c.seed_flag, c.resume_args)):
            self.no_arguments()
            return
        self.draft.flags["steps"] = self.role("steps", c.steps_flag, _STEPS, "{steps}", "--steps" if plain else None)
        if self.draft.flags["steps"] is None:  # by epochs, to a time budget: trainguard ends each run
            self.draft.stop_after_steps = True
            self.draft.guesses.append(f"steps: none ({self.script} has no option for a number of steps, so "
                                      "trainguard ends each run after the check's steps: stop_after_steps)")
        self.draft.flags["ckpt"] = self.role("checkpoint directory", c.ckpt_flag, _CKPT,
                                             "{checkpoint_dir}", "--ckpt-dir" if plain else None)
        self.draft.flags["seed"] = self.role("seed", c.seed_flag, _SEED, "{seed}", "--seed" if plain else None)
        if self.draft.flags["ckpt"] is None:
            self.draft.todos.append(f"{self.script} has no option init recognised for its "
                                    "checkpoint directory: pass {checkpoint_dir} to it (or set "
                                    "it in job.env); the resume check needs it")
        if self.draft.flags["seed"] is None:
            self.draft.guesses.append(f"seed: none ({self.script} has no seed option; runs use "
                                      "its own seeding)")
        self.interval(_INTERVAL)
        if plain and c.resume_args is None:
            self.draft.resume_args = "--resume"
            self.draft.guesses.append("resume: --resume (a guess)")
            self.draft.todos.append(f"init found no options in {self.script}: --steps, --ckpt-dir, "
                                    "--seed and --resume are guesses; replace them with the "
                                    "script's own")
        else:
            self.resume_from_option()
        if self.draft.kind == "huggingface":
            self.draft.metric = {"trainer": "huggingface"}
            self.hub_note()

    def no_arguments(self) -> None:
        """A script that reads no command line (no argparse, no ``sys.argv``): flags would be
        ignored, so none is guessed; trainguard ends each run (``stop_after_steps``)."""
        d = self.draft
        d.stop_after_steps = True
        d.guesses.append(f"steps: none ({self.script} reads no command-line arguments, so trainguard "
                         "ends each run after the check's steps: stop_after_steps)")
        d.guesses.append(f"seed: none ({self.script} reads no arguments; runs use its own seeding)")
        d.todos.append(f"{self.script} reads no command-line arguments (init found no argparse, "
                       "sys.argv or argument package in it), so the command passes none: no "
                       "checkpoint directory and no resume, so the resume check is left out; if a "
                       "module it imports reads them, add its options")
        if d.kind == "huggingface":
            d.metric = {"trainer": "huggingface"}
            self.hub_note()

    def fixed(self, role: str, given: str | None, flag: str, placeholder: str, why: str) -> str:
        """A role whose flag the framework defines (``--max_steps`` of ``TrainingArguments``)."""
        self.add(given or flag, placeholder)
        self.draft.guesses.append(f"{role}: {given} (given)" if given else f"{role}: {flag} ({why})")
        return given or flag

    def huggingface_cli(self, hf_fields: set[str] | None) -> None:
        c, d = self.choices, self.draft
        d.flags["steps"] = self.fixed("steps", c.steps_flag, "--max_steps", "{steps}", "TrainingArguments")
        d.flags["ckpt"] = self.fixed("checkpoint directory", c.ckpt_flag, "--output_dir",
                                     "{checkpoint_dir}", "TrainingArguments")
        d.flags["seed"] = self.fixed("seed", c.seed_flag, "--seed", "{seed}", "TrainingArguments")
        d.command += ["--save_steps", str(SAVE_EVERY), "--logging_steps", "1"]
        d.command_notes.append(f"--save_steps {SAVE_EVERY}: a checkpoint-N every {SAVE_EVERY} steps, so "
                               "the smoke check (5 steps) has one to load and the resume check "
                               "(killed after step 25) one to resume from; --logging_steps 1: the "
                               "Trainer logs every step")
        if "do_train" in self.facts.attributes:
            d.command.append("--do_train")
            d.command_notes.append(f"--do_train: {self.script} trains only when it is set")
        d.command += ["--report_to", "none"]
        d.command_notes.append("--report_to none: no tracker integration (wandb, mlflow, ...) starts "
                               "in the checks' runs")
        if hf_fields is not None and "overwrite_output_dir" in hf_fields:
            d.command.append("--overwrite_output_dir")
        if c.resume_args is not None:
            d.resume_args = c.resume_args
        else:
            d.resume_args = "--resume_from_checkpoint {latest_checkpoint}"
            d.resume_notes.append("{latest_checkpoint}: the newest complete checkpoint-N under "
                                  "--output_dir (one with its trainer_state.json)")
            if not self.facts.passes_resume and "resume_from_checkpoint" not in self.facts.attributes:
                d.todos.append(f"{self.script} never reads resume_from_checkpoint nor passes it to "
                               "trainer.train(): pass "
                               "`resume_from_checkpoint=training_args.resume_from_checkpoint` or "
                               "the resume check starts from scratch")
        d.guesses.append(f"resume: {d.resume_args}")
        d.metric = {"trainer": "huggingface"}
        d.metric_notes.append("recorded inside each rank by trainguard's start-up hook: the loss of "
                              "every optimizer step at full precision (the Trainer's own log line "
                              "rounds it and averages --logging_steps steps)")
        self.hub_note()

    def hub_note(self) -> None:
        self.draft.env_notes.append('add HF_HUB_OFFLINE: "1" once the model, tokenizer and data are '
                                    "on disk (or cached): no check's run then reaches the Hub")

    def lightning_cli(self) -> None:
        d = self.draft
        c = self.choices
        d.command.append("fit")
        d.flags["steps"] = self.fixed("steps", c.steps_flag, "--trainer.max_steps", "{steps}", "LightningCLI")
        d.flags["ckpt"] = self.fixed("checkpoint directory", c.ckpt_flag, "--trainer.default_root_dir",
                                     "{checkpoint_dir}", "LightningCLI")
        d.flags["seed"] = self.fixed("seed", c.seed_flag, "--seed_everything", "{seed}", "LightningCLI")
        d.resume_args = self.choices.resume_args or "--ckpt_path {latest_checkpoint}"
        d.guesses.append(f"resume: {d.resume_args} (LightningCLI)")
        d.todos.append("LightningCLI's default ModelCheckpoint saves at the end of each epoch: for "
                       "the resume check add one that saves every few steps, e.g. "
                       "`--trainer.callbacks+=ModelCheckpoint "
                       f"--trainer.callbacks.every_n_train_steps={SAVE_EVERY}`")

    def configurator(self, config_files: tuple[str, ...]) -> None:
        c, d, f = self.choices, self.draft, self.facts
        d.flags["steps"] = self.role("steps", c.steps_flag, _STEPS, "{steps}", "--max_iters")
        d.flags["ckpt"] = self.role("checkpoint directory", c.ckpt_flag, _CKPT, "{checkpoint_dir}", None)
        d.flags["seed"] = self.role("seed", c.seed_flag, _SEED, "{seed}", None)
        if d.flags["seed"] is None:
            d.command_notes.append(f"no seed setting in {self.script}: {{seed}} is not passed (its "
                                   "seeding is fixed in the script, so every run uses the same seed)")
            d.guesses.append(f"seed: none ({self.script} has no seed setting)")
        device = f.option("device")
        if device is not None:
            self.add("--device", "cpu")
            d.command_notes.append("--device=cpu: the checks run on CPU; drop it (or say cuda) to "
                                   "check on a GPU")
            d.guesses.append("device: --device=cpu")
        compile_ = f.option("compile")
        if compile_ is not None and compile_.default is True:
            self.add("--compile", "False")
            d.command_notes.append("--compile=False: no torch.compile warm-up in short checks")
            d.guesses.append("compile: --compile=False")
        self.interval(_INTERVAL)
        evals = f.option("eval_iters")
        if evals is not None and isinstance(evals.default, int) and evals.default > 20:
            d.command_notes.append(f"eval_iters = {evals.default}: each evaluation runs that many "
                                   "batches per split; a small value (e.g. --eval_iters=2) keeps the "
                                   "checks fast")
        if c.resume_args is not None:
            d.resume_args = c.resume_args
        else:
            init_from = f.option("init_from")
            resume = f.option("resume")
            if init_from is not None and "resume" in f.compared.get("init_from", set()) | {str(init_from.default)}:
                d.resume_args = "--init_from=resume"
                d.resume_notes.append(f"init_from = 'resume': {self.script} loads the checkpoint "
                                      "from its output directory")
            elif resume is not None and isinstance(resume.default, bool):
                d.resume_args = "--resume=True"
            if d.resume_args is None:
                d.todos.append(f"{self.script} has no setting init recognised to resume (init_from, "
                               "resume): the resume check is left out")
            else:
                d.guesses.append(f"resume: {d.resume_args}")
        if config_files:
            shown = ", ".join(config_files[:6]) + (", ..." if len(config_files) > 6 else "")
            d.todos.append(f"{self.script} takes a config file as an argument ({shown}): add the "
                           "one your run uses after the script's name, and make sure its data is "
                           "prepared")

    # ---- common -------------------------------------------------------------------------------

    def metric(self) -> None:
        d, lines = self.draft, self.facts.loss_lines
        if self.choices.loss_regex is not None:
            d.metric = self.choices.loss_regex
            d.guesses.append("loss: --loss-regex (given)")
            return
        if isinstance(d.metric, dict):  # a trainer records it
            d.guesses.append(f"loss: {{trainer: {d.metric['trainer']}}}")
            if d.kind == "lightning":
                d.metric_notes.append("recorded inside each rank by trainguard's start-up hook: the "
                                      "training loss of every optimizer step at full precision")
            return
        if d.kind == "lightning":
            d.metric = {"trainer": "lightning"}
            d.guesses.append("loss: {trainer: lightning}")
            d.metric_notes.append("recorded inside each rank by trainguard's start-up hook: the "
                                  "training loss of every optimizer step at full precision")
            return
        if not lines:
            d.metric = _FALLBACK_REGEX
            d.guesses.append(f"loss: {_FALLBACK_REGEX} (a guess)")
            d.todos.append(f"init found no line {self.script} prints with its loss: write the "
                           "regex of its loss lines in job.metrics.loss (docs/metrics.md)")
            return
        best = lines[0]
        d.metric_notes.append(f"from {self.script} line {best.line}: {best.text}")
        every = self.find((best.interval,)) if best.interval else None
        if best.interval and every is None and best.interval.isdigit() and best.interval != "1":
            d.todos.append(f"{self.script} prints its loss line (line {best.line}) only every "
                           f"{best.interval} steps, a number in its code: the checks compare each "
                           "step, so give them a line every step (or a metric file, docs/metrics.md)")
        # a configurator's config file may set it, whatever the script's default
        if every is not None and (self.eq or every.default != 1):
            self.add(every.flag, "1")
            shown = f"{every.flag}=1" if self.eq else f"{every.flag} 1"
            d.command_notes.append(f"{shown}: the loss line every step (it is printed every "
                                   f"{every.dest} steps), as the checks compare each step")
            d.guesses.append(f"loss line: {shown} (printed every {every.dest} steps)")
        if best.has_step:
            d.metric = best.regex
        else:
            d.metric = {"regex": best.regex, "step": "count"}
            d.metric_notes.append("the line has no step: the n-th matching line is step n (a "
                                  "resumed run counts from 1 again, so the resume check is left out)")
        d.guesses.append(f"loss: {best.regex} (line {best.line})")

    def launch(self) -> None:
        d, f = self.draft, self.facts
        if f.cuda_ddp_line is None:
            return
        if d.world_size == 1:
            d.distributed_env = False
            d.launch_notes.append(f"{f.cuda_ddp_evidence}: with RANK/WORLD_SIZE set it goes "
                                  "distributed on CUDA, so it runs as one plain process")
            d.guesses.append("distributed_env: false (its DDP branch needs CUDA)")
        else:
            d.launch_notes.append(f"{f.cuda_ddp_evidence}: its DDP branch needs CUDA and NCCL "
                                  f"for {d.world_size} ranks")

    def required(self) -> None:
        """The script's own options it needs, that init cannot fill."""
        f, d = self.facts, self.draft
        own = [o for o in f.options if o.origin != "setting"]
        need = [o for o in own if o.required]
        if need:
            d.todos.append(f"{self.script} requires: " + ", ".join(
                (o.flag or f"<{o.dest}> (positional)") + f" (line {o.line})" for o in need))
        for group in f.one_of:
            if len(group) > 1:
                flags = [next((o.flag for o in own if o.dest == n), "--" + n) for n in group]
                d.todos.append(f"{self.script} needs one of {', '.join(flags)}")
        if d.kind == "huggingface":
            grouped = {n for g in f.one_of for n in g}
            maybe = [o.flag for o in own if o.has_default and o.default is None and o.flag
                     and o.dest not in grouped and not o.required and _HF_INPUT.search(o.dest)]
            if maybe:
                d.todos.append("its options that default to None and may need a value: " + ", ".join(maybe))
        if d.todos and any("needs one of" in t or "requires" in t for t in d.todos):
            d.todos.append("add them to job.command (paths relative to job.cwd)")


# --------------------------------------------------------------------------------------------
# Rendering
# --------------------------------------------------------------------------------------------


def _script_token(path: str) -> str:
    """The script's path as a command token: ``./`` before a leading dash (else python reads
    ``-x.py`` as its own options) and braces doubled (the command's placeholders are
    ``str.format`` fields: ``my{1}.py`` is a name, not a placeholder)."""
    token = f"./{path}" if path.startswith("-") else path
    return token.replace("{", "{{").replace("}", "}}")


def _token(text: str) -> str:
    """A command token as a shell would read it, quoted only when it must be."""
    return text if re.fullmatch(r"[\w@%+=:,./{}\-]+", text) else shlex.quote(text)


def _pairs(tokens: list[str]) -> list[str]:
    """Tokens with each option joined to its value, so a wrapped command keeps them together."""
    out: list[str] = []
    for token in tokens:
        if out and out[-1].startswith("-") and " " not in out[-1] and not token.startswith("-"):
            out[-1] += " " + token
        else:
            out.append(token)
    return out


def _double_quoted(text: str) -> str:
    """``text`` as a YAML double-quoted scalar that loads back exactly: quotes, backslashes,
    line breaks and every character YAML cannot hold raw are escaped (PyYAML's own emitter)."""
    emitted = yaml.safe_dump(text, default_style='"', allow_unicode=True, width=2**31 - 1)
    return emitted.removesuffix("\n...\n").rstrip("\n")


def _one_line(text: str) -> str:
    """``text`` fit for a YAML comment: line breaks and the characters YAML refuses anywhere in
    a file written as Python escapes, so a script named ``a\nb.py`` cannot end the comment."""
    return _UNPRINTABLE.sub(lambda m: repr(m.group())[1:-1], text)


#: what a YAML comment cannot hold raw: control characters (YAML refuses them), line breaks
#: (YAML 1.1 counts NEL, U+2028 and U+2029 too), the byte-order mark, surrogates
_UNPRINTABLE = re.compile(
    "[^\t\x20-\x7e\xa0-\u2027\u202a-\ud7ff\ue000-\ufefe\uff00-\ufffd\U00010000-\U0010ffff]"
)


def _single_quoted(text: str) -> str:
    """``text`` single-quoted (a regex reads best without doubled backslashes); double-quoted
    with escapes when it holds what a single-quoted scalar cannot keep (a line break)."""
    if _one_line(text) != text:
        return _double_quoted(text)
    return "'" + text.replace("'", "''") + "'"


def _comment(text: str, indent: str, width: int = 98) -> list[str]:
    lines, line = [], ""
    for word in _one_line(text).split(" "):
        if line and len(indent) + 2 + len(line) + 1 + len(word) > width:
            lines.append(line)
            line = word
        else:
            line = f"{line} {word}" if line else word
    lines.append(line)
    return [f"{indent}# {lines[0]}"] + [f"{indent}#   {rest}" for rest in lines[1:]]


_KIND_WORDS = {
    "huggingface": "a Hugging Face Trainer script",
    "lightning": "a Lightning script",
    "configurator": "a nanoGPT-style script: module-level settings overridden by --key=value",
    "argparse": "an argparse script",
    "plain": "a script init could not read options from",
}


def kind_words(kind: ScriptKind) -> str:
    """The kind in words: ``a Hugging Face Trainer script``."""
    return _KIND_WORDS[kind]



def render_job_file(draft: JobDraft, yaml_name: str = "trainguard.yaml") -> str:
    """The YAML text of ``draft``: the job, its checks, and every guess and TODO as comments."""
    name = draft.name if re.fullmatch(r"[A-Za-z_][\w.-]*", draft.name) else _double_quoted(draft.name)
    cwd = draft.cwd if re.fullmatch(r"[\w./-]+", draft.cwd) else _double_quoted(draft.cwd)
    env = ", ".join(f"{k}: {_double_quoted(v)}" for k, v in draft.env.items())
    out = [
        *_header_lines(draft, yaml_name),
        "job:",
        f"  name: {name}",
        *_notes(draft.command_notes, "  "),
        *_command_lines(draft.command),
        *(["  # the script has no option for a number of steps: trainguard ends each run after the",
            "  #   check's steps (docs/any-script.md)", "  stop_after_steps: true"] if draft.stop_after_steps else []),
        *_resume_lines(draft),
        f"  world_size: {draft.world_size}",
        *_notes(draft.launch_notes, "  "),
        *([] if draft.distributed_env else ["  distributed_env: false"]),
        f"  cwd: {cwd}",
        f"  env: {{{env}}}",
        *_notes(draft.env_notes, "  "),
        "  metrics:",
        *_notes(draft.metric_notes, "    "),
        _loss_line(draft.metric),
        "  timeout: 600",
        "  stall_timeout: 60",
        "checks:",
        *_check_lines(draft.resumable),
    ]
    return "\n".join(out) + "\n"


def _header_lines(draft: JobDraft, yaml_name: str) -> list[str]:
    """The file's opening comment: what wrote it, what was detected, how to run it, the TODOs."""
    out = [
        f"# trainguard job file for {_one_line(draft.command[1])}, written by `trainguard init`.",
        *_comment(f"Detected: {kind_words(draft.kind)} ({draft.evidence}). Each guess is said "
                  "next to what it sets; check them. Reference: docs/config.md.", ""),
        f"# Run: trainguard check {yaml_name}",
    ]
    return out + _notes([f"TODO: {todo}" for todo in draft.todos], "")


def _notes(notes: list[str], indent: str) -> list[str]:
    """Each note as a comment at ``indent``."""
    return [line for note in notes for line in _comment(note, indent)]


def _command_lines(command: list[str]) -> list[str]:
    """``command:`` on one line, or folded at 94 columns when long (a folded scalar holds no
    escapes, so a command that needs them stays on one line)."""
    text = " ".join(_token(t) for t in command)
    if len(text) <= 88 or _one_line(text) != text:
        return [f"  command: {_double_quoted(text)}"]
    out = ["  command: >-"]
    line = ""
    for token in _pairs([_token(t) for t in command]):
        if line and len(line) + 1 + len(token) > 94:
            out.append(f"    {line}")
            line = token
        else:
            line = f"{line} {token}" if line else token
    out.append(f"    {line}")
    return out


def _resume_lines(draft: JobDraft) -> list[str]:
    """``resume_args:`` with its notes; commented out when the job cannot resume yet; nothing
    without resume arguments."""
    if draft.resume_args is None:
        return []
    if not draft.resumable:
        return [f"  # resume_args: {_double_quoted(draft.resume_args)}"]
    return [*_notes(draft.resume_notes, "  "), f"  resume_args: {_double_quoted(draft.resume_args)}"]


def _loss_line(metric: str | dict[str, str]) -> str:
    """The ``loss:`` metric: a regex, or a mapping (``{trainer: huggingface}``, ``{regex: ...}``)."""
    if isinstance(metric, str):
        return f"    loss: {_single_quoted(metric)}"
    items = ", ".join(f"{k}: {_single_quoted(v) if k == 'regex' else v}" for k, v in metric.items())
    return f"    loss: {{{items}}}"


def _check_lines(resumable: bool) -> list[str]:
    """The checks init writes; resume commented out, with its TODO, when the job cannot resume."""
    return [
        f"  # {name}: {spec}   # TODO: needs resume_args and {{checkpoint_dir}} (see above)"
        if name == "resume" and not resumable
        else f"  {name}: {spec}"
        for name, spec in _CHECKS
    ]
