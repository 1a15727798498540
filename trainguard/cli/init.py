"""``trainguard init SCRIPT``: write a job file (and a pytest file) for an existing training script.

It reads the script's source (never imports or runs it; :mod:`trainguard.config.scriptscan`),
recognises the kind of script (Hugging Face Trainer, Lightning, nanoGPT-style configurator,
argparse), drafts the job file (:mod:`trainguard.config.scaffold`), prints what it detected and
each guess, validates the YAML and writes it. Flags override what it detects. See docs/cli.md.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from trainguard._internal.limits import MAX_WORLD_SIZE
from trainguard.cli.args import positive_int, text, written_path
from trainguard.errors import ConfigError

__all__ = ["FLAG_VALUED", "KINDS", "MAX_SCRIPT_BYTES", "add_parser", "join_flag_values", "run"]

#: the kinds ``--kind`` names (``trainguard.config.scriptscan.ScriptKind`` but ``plain``; not
#: imported from there, so that building the parser stays cheap)
KINDS = ("huggingface", "lightning", "configurator", "argparse")
#: the largest script init reads (a training script is kilobytes; its AST is built in memory)
MAX_SCRIPT_BYTES = 16 * 2**20
#: init options whose values are themselves flags ("--steps-flag --max-steps")
FLAG_VALUED = ("--steps-flag", "--ckpt-flag", "--seed-flag", "--resume-flag")

_TEST_TEMPLATE = '''\
"""trainguard checks of the {name} job, run by pytest (written by `trainguard init`)."""

from pathlib import Path

import pytest

import trainguard.session

JOB_FILE = Path(__file__).resolve().parent.parent / "{yaml_name}"


@pytest.mark.smoke
def test_smoke(tmp_path):
    report = trainguard.session.check(JOB_FILE, only=["smoke"], report_json=str(tmp_path / "r.json"))
    assert report.status == "passed", report.checks[0].summary


@pytest.mark.determinism
def test_determinism(tmp_path):
    report = trainguard.session.check(JOB_FILE, only=["determinism"], report_json=str(tmp_path / "r.json"))
    assert report.status == "passed", report.checks[0].summary
'''


def add_parser(sub: Any) -> None:
    """Add the ``init`` subcommand to ``trainguard``'s subparsers."""
    init = sub.add_parser(
        "init",
        help="scaffold a trainguard.yaml and a test file for an existing training script",
        description="Write a trainguard.yaml (and tests/test_trainguard_job.py) for an existing "
        "training script. It reads the script (never runs it), recognises Hugging Face Trainer, "
        "Lightning, nanoGPT-style --key=value and argparse scripts, and fills the job from the "
        "script's own options; every guess is printed and written as a comment. The flags "
        "override what it detects. In a terminal it asks for what the flags leave open; with "
        "--yes (or without a terminal) it asks nothing.",
    )
    init.add_argument("script", metavar="SCRIPT", type=written_path,
                      help="the training script, e.g. train.py (a name starting with - after --)")
    init.add_argument("--dir", default=".", type=written_path, help="where to write the files (default: .)")
    init.add_argument("--name", type=text, help="job name (default: the script's name)")
    init.add_argument("--kind", choices=KINDS,
                      help="the kind of script, instead of the one detected")
    init.add_argument("--steps-flag", type=text, help="the script's flag for the number of steps (default: "
                      "detected, e.g. --max_steps; --steps when none is found)")
    init.add_argument("--ckpt-flag", type=text, help="its flag for the checkpoint directory (default: detected, "
                      "e.g. --output_dir)")
    init.add_argument("--seed-flag", type=text, help="its flag for the seed (default: detected)")
    init.add_argument("--resume-flag", type=text, help="the arguments that make it resume from the latest "
                      "checkpoint (default: detected, e.g. --resume or "
                      "'--resume_from_checkpoint {latest_checkpoint}')")
    init.add_argument(
        "--loss-regex",
        type=text,
        help=r"regex matching its loss lines, with named groups step and value (default: derived "
        r"from the line the script prints its loss with, else 'step (?P<step>\d+) loss (?P<value>\S+)')",
    )
    init.add_argument("--world-size", type=positive_int(MAX_WORLD_SIZE), default=1,
                      help=f"ranks to launch, 1 to {MAX_WORLD_SIZE} (default: 1)")
    init.add_argument("-y", "--yes", action="store_true", help="ask nothing; use the flags and what was detected")
    init.add_argument("--force", action="store_true", help="overwrite existing files")


def join_flag_values(argv: Sequence[str]) -> list[str]:
    """``argv`` with each :data:`FLAG_VALUED` option joined to its value
    (``--steps-flag=--max-steps``): argparse reads a value starting with ``-`` as the next option
    and fails with "expected one argument"."""
    out: list[str] = []
    tokens = iter(argv)
    for token in tokens:
        value = next(tokens, None) if token in FLAG_VALUED else None
        out.append(token if value is None else f"{token}={value}")
    return out


def _in_docstring(text: str) -> str:
    """``text`` as it can stand inside the test file's docstring: escaped like a Python string
    literal (quotes, backslashes, line breaks), so any job name gives a file that compiles."""
    return repr(text)[1:-1].replace('"', '\\"')


#: the option of init that sets each part of the job file, named in its errors
_FLAG_FOR_KEY = (("job.metrics", "--loss-regex"), ("job.resume_args", "--resume-flag"),
                 ("job.command", "--steps-flag/--ckpt-flag/--seed-flag"), ("job.name", "--name"),
                 ("job.world_size", "--world-size"))


def _flag_for(key: str | None) -> str | None:
    """The init option that wrote the job file's ``key`` (None for a part no option sets)."""
    return next((flag for prefix, flag in _FLAG_FOR_KEY if key and key.startswith(prefix)), key)


def _ask(question: str, default: str, interactive: bool) -> str:
    if not interactive:
        return default
    try:
        answer = input(f"{question} [{default}]: ").strip()
    except EOFError:  # Ctrl-D, or a terminal that closed: stop, as Ctrl-C does, writing nothing
        print(file=sys.stderr)
        raise ConfigError(f"no answer to {question!r} (end of input): nothing written; run init "
                          "again, or pass --yes to take what it detected") from None
    return answer or default


def _script_paths(script_arg: str, target_dir: Path) -> tuple[Path, str]:
    """Where to read the script, and its path as the job file names it (relative to --dir)."""
    script = Path(script_arg)
    for candidate in (target_dir / script, script):
        if candidate.is_file():
            relative = os.path.relpath(candidate.resolve(), target_dir.resolve())
            shown = Path(relative).as_posix() if not relative.startswith("..") else candidate.resolve().as_posix()
            return candidate, shown
    raise ConfigError(
        f"training script {script_arg!r} not found in {target_dir.resolve()}; pass the "
        "path of your existing script (relative to --dir)"
    )


def run(args: argparse.Namespace) -> int:
    """Run ``trainguard init``; returns the exit code."""
    from trainguard._internal.atomic import atomic_write_text
    from trainguard.config import parse_config
    from trainguard.config.scaffold import (
        InitChoices,
        draft_job,
        installed_training_arguments,
        kind_words,
        render_job_file,
    )
    from trainguard.config.scriptscan import scan_script

    target_dir = Path(args.dir)
    source_path, script = _script_paths(args.script, target_dir)
    try:
        if source_path.stat().st_size > MAX_SCRIPT_BYTES:
            raise ConfigError(f"the script is over {MAX_SCRIPT_BYTES // 2**20} MB: not a training "
                              "script init can read; write the job file by hand (docs/config.md)",
                              path=str(source_path))
        source = source_path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read the training script: {exc}", path=str(source_path)) from None
    facts = scan_script(source, str(source_path), kind=args.kind)
    config_dir = source_path.parent / "config"
    config_files = tuple(sorted(p.relative_to(source_path.parent).as_posix() for p in config_dir.glob("*.py"))
                         ) if facts.kind == "configurator" and config_dir.is_dir() else ()
    hf_fields = installed_training_arguments() if facts.kind == "huggingface" else None
    choices = InitChoices(name=args.name, steps_flag=args.steps_flag, ckpt_flag=args.ckpt_flag,
                          seed_flag=args.seed_flag, resume_args=args.resume_flag,
                          loss_regex=args.loss_regex, world_size=args.world_size)
    draft = draft_job(facts, script, choices, config_files=config_files, hf_fields=hf_fields)

    interactive = not args.yes and sys.stdin.isatty()
    if interactive:
        print(f"{script}: {kind_words(draft.kind)} ({draft.evidence})")
        choices.name = args.name or _ask("job name", draft.name, True)
        for role, attr, question in (("steps", "steps_flag", "flag for the number of steps"),
                                     ("ckpt", "ckpt_flag", "flag for the checkpoint directory"),
                                     ("seed", "seed_flag", "flag for the seed")):
            if getattr(args, attr) is None and draft.flags.get(role):
                answer = _ask(question, draft.flags[role] or "", True)
                setattr(choices, attr, answer if answer != draft.flags[role] else None)
        if args.resume_flag is None and draft.resume_args is not None:
            answer = _ask("arguments to resume from the latest checkpoint", draft.resume_args, True)
            choices.resume_args = answer if answer != draft.resume_args else None
        draft = draft_job(facts, script, choices, config_files=config_files, hf_fields=hf_fields)

    yaml_name = "trainguard.yaml"
    yaml_path = target_dir / yaml_name
    test_path = target_dir / "tests" / "test_trainguard_job.py"
    for path in (yaml_path, test_path):
        if path.exists() and not args.force:
            raise ConfigError(f"{path} already exists; pass --force to overwrite it")
    text = render_job_file(draft, yaml_name)
    try:
        parse_config(text, path=yaml_path)  # what we write must load; a bad --loss-regex stops here
    except ConfigError as exc:
        raise ConfigError(f"{exc.detail} (in {yaml_path}'s {exc.key or 'text'}); nothing written",
                          key=_flag_for(exc.key)) from None
    if not interactive:
        print(f"{script}: {kind_words(draft.kind)} ({draft.evidence})")
    for guess in draft.guesses:
        print(f"  {guess}")
    for todo in draft.todos:
        print(f"  TODO: {todo}")
    atomic_write_text(yaml_path, text)
    test_path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(test_path, _TEST_TEMPLATE.format(name=_in_docstring(draft.name), yaml_name=yaml_name))
    print(f"wrote {yaml_path} and {test_path}")
    print(f"next: trainguard check {yaml_path}   (or: pytest {test_path})")
    return 0
