"""What ``trainguard init`` learns from a training script's source, read with :mod:`ast`.

The script is never imported or run: only its text is parsed. :func:`scan_script` returns
:class:`ScriptFacts`: which kind of script it is (a Hugging Face Trainer script, a Lightning
script, a nanoGPT-style ``--key=value`` configurator, an argparse script, or none of those), the
options its command line takes (argparse options, the dataclass fields an ``HfArgumentParser``
reads, or a configurator's module-level settings), which of them it needs, where it prints its
loss, how often it saves, and whether it takes a CUDA-only branch when it sees the torchrun
environment. :mod:`trainguard.config.scaffold` turns the facts into a job file.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from trainguard.config.logformat import (
    LossFields,
    PrintedMessage,
    expression_words,
    is_eval_text,
    line_regex,
    literal,
    loss_fields,
    primary_name,
    printed_message,
)
from trainguard.errors import ConfigError

__all__ = ["LossLine", "ScriptFacts", "ScriptKind", "ScriptOption", "scan_script"]

#: what kind of training script ``trainguard init`` found
ScriptKind = Literal["huggingface", "lightning", "configurator", "argparse", "plain"]

#: packages that parse a command line: a script importing one reads its arguments
_ARGUMENT_PACKAGES = frozenset({"argparse", "optparse", "getopt", "click", "fire", "typer", "hydra", "jsonargparse",
                                "absl", "docopt", "tyro", "simple_parsing", "ml_collections"})
#: names that read it: ``sys.argv``, ``parser.parse_args()``, the frameworks' parsers
_ARGUMENT_NAMES = frozenset({"argv", "parse_args", "parse_known_args", "parse_args_into_dataclasses",
                             "HfArgumentParser", "LightningCLI", "ArgumentParser"})

#: names of the Trainer classes and argument parsers that make a script a Hugging Face one
_HF_NAMES = ("Trainer", "Seq2SeqTrainer", "HfArgumentParser", "TrainingArguments",
             "Seq2SeqTrainingArguments")
#: the environment variables of torchrun's contract a script may branch on
_DIST_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE")
#: a call that saves (``torch.save``, ``save_checkpoint``, ``trainer.save_model``)
_SAVE_WORD = re.compile(r"save", re.IGNORECASE)


@dataclass(frozen=True)
class ScriptOption:
    """One setting the script's command line takes."""

    #: the attribute it lands in (``ckpt_dir`` for ``--ckpt-dir``)
    dest: str
    #: the option as typed (``--ckpt-dir``); ``""`` for a positional argument
    flag: str
    #: False for a switch (``action="store_true"``)
    takes_value: bool
    line: int
    #: where it comes from: ``argparse``, a dataclass's name (``ModelArguments``), or ``setting``
    #: (a module-level variable a configurator overrides)
    origin: str
    required: bool = False
    has_default: bool = True
    #: the literal default (None when absent or not a literal; see ``default_text``)
    default: Any = None
    #: the default as written in the source
    default_text: str = ""
    choices: tuple[Any, ...] = ()


@dataclass(frozen=True)
class LossLine:
    """A line the script prints with its loss, as a metric regex."""

    regex: str
    #: whether the regex has a ``step`` group (else its steps are counted: ``step: count``)
    has_step: bool
    line: int
    #: the format string as written (shortened), for the comment naming where it came from
    text: str
    score: int
    #: the name of how often it is printed (``log_interval`` of ``if it % log_interval == 0:``),
    #: or the number (``"200"`` of ``if batch_idx % 200 == 0:``)
    interval: str | None = None
    #: the line as printed, each field a number (what another line's regex is tried on)
    sample: str = ""


@dataclass
class ScriptFacts:
    """What :func:`scan_script` found in one script."""

    path: str
    kind: ScriptKind
    #: why that kind, in words, with the line: ``imports transformers and uses Trainer (line 12)``
    evidence: str
    options: list[ScriptOption] = field(default_factory=list)
    #: an ``HfArgumentParser`` over ``TrainingArguments``: the Trainer's own flags are the CLI
    hf_cli: bool = False
    #: a ``LightningCLI``: ``fit --trainer.max_steps ...``
    lightning_cli: bool = False
    #: the dataclasses an ``HfArgumentParser`` reads that the script defines itself
    hf_dataclasses: list[str] = field(default_factory=list)
    #: groups of dests of which the script needs one (it raises when all are missing)
    one_of: list[tuple[str, ...]] = field(default_factory=list)
    #: every attribute name the script reads (``training_args.do_train`` -> ``do_train``)
    attributes: set[str] = field(default_factory=set)
    #: it passes ``resume_from_checkpoint=``/``ckpt_path=`` to ``train``/``fit`` from a variable
    passes_resume: bool = False
    #: the line of an ``if`` on RANK/WORLD_SIZE whose branch needs CUDA (torch.cuda.set_device,
    #: NCCL), and what gave it away
    cuda_ddp_line: int | None = None
    cuda_ddp_evidence: str = ""
    #: names that set how often the script saves (``if step % ckpt_every == 0: save``), with the line
    save_intervals: list[tuple[str, int]] = field(default_factory=list)
    #: lines printing the loss, best first
    loss_lines: list[LossLine] = field(default_factory=list)
    #: string constants each name or attribute is compared with (``init_from == 'resume'``)
    compared: dict[str, set[str]] = field(default_factory=dict)
    #: the line of the configurator (``exec(open('configurator.py').read())``)
    configurator_line: int | None = None
    #: it reads its command line: ``sys.argv``, a ``parse_args``, or an argument-parsing
    #: package (argparse, click, fire, hydra, ...); False for one that takes no arguments
    reads_arguments: bool = True

    def option(self, dest: str) -> ScriptOption | None:
        """The option landing in ``dest``, or None."""
        return next((o for o in self.options if o.dest == dest), None)


def scan_script(source: str, path: str = "train.py", kind: ScriptKind | None = None) -> ScriptFacts:
    """The facts of the script whose text is ``source`` (``path`` names it in messages);
    ``kind`` overrides the kind it would detect (its options are then read as that kind's).

    Raises :class:`~trainguard.errors.ConfigError` when the text is not Python."""
    fix = ("trainguard init reads the script's source (it never runs it); pass a Python file, or "
           "write the job file by hand (docs/config.md)")
    try:
        tree = ast.parse(source, filename=path)
        return _Scanner(tree, source, path).facts(kind)
    except SyntaxError as exc:
        where = f"line {exc.lineno}: " if exc.lineno else ""
        raise ConfigError(f"cannot read the training script: {where}{exc.msg}. {fix}", path=path) from None
    except (RecursionError, MemoryError):  # 200000 terms in one expression, 100000 nested '-'
        raise ConfigError(f"cannot read the training script: its code nests too deeply for Python's "
                          f"parser. {fix}", path=path) from None


# --------------------------------------------------------------------------------------------
# The scanner
# --------------------------------------------------------------------------------------------


def _only_its_own(lines: list[LossLine]) -> list[LossLine]:
    """``lines`` with the first one's regex kept off the others: where it also matches another
    loss line the script prints further into it (``loss: `` in time_sequence_prediction's ``test
    loss: ``), the word before becomes a negative lookbehind (``(?<!test )loss: ...``)."""
    if not lines:
        return lines
    best = lines[0]
    regex = best.regex
    for other in lines[1:]:
        found = re.search(regex, other.sample)
        if found is None or found.start() == 0:
            continue
        before = re.search(r"\S*\s*$", other.sample[: found.start()])
        word = before.group(0) if before is not None else ""
        if word:
            escaped = re.escape(word).replace("\\ ", " ")
            regex = f"(?<!{escaped}){regex}"
    return [replace(best, regex=regex), *lines[1:]]


def _dotted(node: ast.AST) -> str | None:
    """``a.b.c`` for a chain of attributes on a name, else None."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return ".".join([node.id, *reversed(parts)])
    return None


def _strings_in(node: ast.AST) -> Iterator[str]:
    for sub in ast.walk(node):
        if isinstance(sub, ast.Constant) and isinstance(sub.value, str):
            yield sub.value


def _missing_names(test: ast.AST) -> list[str] | None:
    """The attributes a test says are all missing (``a.x is None and not a.y``: ``["x", "y"]``);
    None for any other test."""
    parts = test.values if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And) else [test]
    names = []
    for p in parts:
        if isinstance(p, ast.Compare) and len(p.ops) == 1 and isinstance(p.ops[0], ast.Is | ast.Eq) \
                and isinstance(p.comparators[0], ast.Constant) and p.comparators[0].value is None:
            p = p.left
        elif isinstance(p, ast.UnaryOp) and isinstance(p.op, ast.Not):
            p = p.operand
        else:
            return None
        if not isinstance(p, ast.Attribute):
            return None
        names.append(p.attr)
    return names


def _raises(body: list[ast.stmt]) -> bool:
    """Whether a block ends by raising."""
    return bool(body) and isinstance(body[-1], ast.Raise)


class _Scanner:
    def __init__(self, tree: ast.Module, source: str, path: str) -> None:
        self.tree, self.source, self.path = tree, source, path
        self.aliases: dict[str, str] = {}  # local name -> module.qualified.name
        self.configurator_text = ""
        self.parents: dict[ast.AST, ast.AST] = {}
        for parent in ast.walk(tree):
            for child in ast.iter_child_nodes(parent):
                self.parents[child] = parent
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    self.aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
            elif isinstance(node, ast.ImportFrom) and node.module:
                for a in node.names:
                    self.aliases[a.asname or a.name] = f"{node.module}.{a.name}"

    def qualified(self, node: ast.AST) -> str | None:
        dotted = _dotted(node)
        if dotted is None:
            return None
        head, _, rest = dotted.partition(".")
        base = self.aliases.get(head)
        if base is None:
            return None
        return f"{base}.{rest}" if rest else base

    def uses(self, roots: tuple[str, ...], names: tuple[str, ...]) -> ast.expr | None:
        """The first reference to ``<root>...<name>`` (an imported framework's class)."""
        for node in ast.walk(self.tree):
            if isinstance(node, (ast.Name, ast.Attribute)) and isinstance(getattr(node, "ctx", None), ast.Load):
                q = self.qualified(node)
                if q and q.split(".")[0] in roots and q.rsplit(".", 1)[-1] in names:
                    return node
        return None

    # ---- the kind ---------------------------------------------------------------------------

    def facts(self, kind: ScriptKind | None = None) -> ScriptFacts:
        facts = ScriptFacts(path=self.path, kind="plain", evidence="")
        facts.configurator_line = self.configurator()
        hf = self.uses(("transformers", "trl"), _HF_NAMES) or self.trl_trainer()
        lit = self.uses(("lightning", "pytorch_lightning"), ("Trainer", "LightningCLI"))
        argparse_options = self.argparse_options()
        parser_types = self.hf_argument_parser()
        if hf is not None:
            q = self.qualified(hf) or ""
            facts.kind = "huggingface"
            facts.evidence = f"imports {q.split('.')[0]} and uses {q.rsplit('.', 1)[-1]} (line {hf.lineno})"
        elif lit is not None:
            q = self.qualified(lit) or ""
            facts.kind = "lightning"
            facts.evidence = f"imports {q.split('.')[0]} and uses {q.rsplit('.', 1)[-1]} (line {lit.lineno})"
            facts.lightning_cli = q.endswith("LightningCLI")
        elif facts.configurator_line is not None:
            facts.kind = "configurator"
            facts.evidence = f"{self.configurator_text} at line {facts.configurator_line}"
        elif argparse_options:
            facts.kind = "argparse"
            facts.evidence = f"{len(argparse_options)} argparse options (line {argparse_options[0].line})"
        else:
            facts.evidence = "no argparse options, configurator or known trainer found"
        if kind is not None and kind != facts.kind:
            facts.evidence = f"--kind {kind}; init itself found {facts.kind}: {facts.evidence}"
            facts.kind, facts.lightning_cli = kind, False
        if facts.kind == "huggingface" and parser_types is not None:
            facts.hf_cli = True
            facts.hf_dataclasses = [t for t in parser_types if self.dataclass(t) is not None]
            for name in facts.hf_dataclasses:
                facts.options += self.dataclass_fields(name)
        elif facts.kind == "configurator":
            facts.options = self.settings(facts.configurator_line or len(self.source.splitlines()) + 1)
        else:
            facts.options = argparse_options
        facts.one_of = self.one_of_groups({o.dest for o in facts.options})
        facts.attributes = {n.attr for n in ast.walk(self.tree) if isinstance(n, ast.Attribute)}
        facts.passes_resume = self.passes_resume()
        facts.cuda_ddp_line, facts.cuda_ddp_evidence = self.cuda_ddp(facts)
        facts.save_intervals = self.save_intervals()
        facts.loss_lines = _only_its_own(sorted(self.loss_lines(), key=lambda x: (-x.score, x.line)))
        facts.compared = self.comparisons()
        facts.reads_arguments = facts.configurator_line is not None or self.reads_arguments()
        return facts

    def reads_arguments(self) -> bool:
        """Whether the script reads its command line (it alone: a module it imports may too)."""
        if any(q.split(".")[0] in _ARGUMENT_PACKAGES for q in self.aliases.values()):
            return True
        for node in ast.walk(self.tree):
            name = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else ""
            if name in _ARGUMENT_NAMES:
                return True
        return False

    def trl_trainer(self) -> ast.expr | None:
        for node in ast.walk(self.tree):
            if isinstance(node, (ast.Name, ast.Attribute)):
                q = self.qualified(node)
                if q and q.startswith("trl.") and q.endswith(("Trainer", "Config")):
                    return node
        return None

    def configurator(self) -> int | None:
        """The line of a module-level ``exec(open(...).read())`` or ``globals()[k] = v``
        (:attr:`configurator_text` is set to what it says)."""
        for stmt in self.tree.body:
            for node in ast.walk(stmt):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                    break
                if not isinstance(node, ast.stmt | ast.expr):
                    continue
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                        and node.func.id == "exec" and node.args
                        and any(isinstance(c, ast.Call) and isinstance(c.func, ast.Name) and c.func.id == "open"
                                for c in ast.walk(node.args[0]))):
                    self.configurator_text = ast.get_source_segment(self.source, node) or "exec(...)"
                    return node.lineno
                targets = node.targets if isinstance(node, ast.Assign) else []
                for target in targets:
                    if (isinstance(target, ast.Subscript) and isinstance(target.value, ast.Call)
                            and isinstance(target.value.func, ast.Name) and target.value.func.id == "globals"):
                        self.configurator_text = "globals()[...] = ..."
                        return node.lineno
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                        and node.func.attr == "update" and isinstance(node.func.value, ast.Call)
                        and isinstance(node.func.value.func, ast.Name) and node.func.value.func.id == "globals"):
                    self.configurator_text = "globals().update(...)"
                    return node.lineno
        return None

    # ---- options ------------------------------------------------------------------------------

    def argparse_options(self) -> list[ScriptOption]:
        out: list[ScriptOption] = []
        for node in ast.walk(self.tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "add_argument" and node.args):
                continue
            names = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
            if not names:
                continue
            kw = {k.arg: k.value for k in node.keywords if k.arg}
            longs = [n for n in names if n.startswith("--")]
            flag = longs[0] if longs else names[0] if names[0].startswith("-") else ""
            _, dest = literal(kw.get("dest"))
            if not isinstance(dest, str):
                dest = (longs[0][2:] if longs else names[0].lstrip("-")).replace("-", "_")
            _, action = literal(kw.get("action"))
            switch = action in ("store_true", "store_false", "store_const", "count", "help", "version")
            known, default = literal(kw.get("default"))
            _, required = literal(kw.get("required"))
            _, choices = literal(kw.get("choices"))
            out.append(ScriptOption(
                dest=dest, flag=flag, takes_value=not switch, line=node.lineno, origin="argparse",
                required=bool(required) or not flag, has_default="default" in kw or switch,
                default=default if known else None,
                default_text=ast.get_source_segment(self.source, kw["default"]) or "" if "default" in kw else "",
                choices=tuple(choices) if isinstance(choices, list | tuple) else (),
            ))
        return out

    def hf_argument_parser(self) -> list[str] | None:
        """The type names an ``HfArgumentParser(...)`` call reads, or None without one."""
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Call) and (self.qualified(node.func) or "").endswith("HfArgumentParser"):
                if not node.args:
                    return []
                arg = node.args[0]
                elts = arg.elts if isinstance(arg, ast.Tuple | ast.List) else [arg]
                return [n for e in elts if (n := _dotted(e))]
        return None

    def dataclass(self, name: str) -> ast.ClassDef | None:
        for node in ast.walk(self.tree):
            if isinstance(node, ast.ClassDef) and node.name == name:
                return node
        return None

    def dataclass_fields(self, name: str) -> list[ScriptOption]:
        cls = self.dataclass(name)
        out: list[ScriptOption] = []
        for stmt in cls.body if cls else []:
            if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
                continue
            value, has_default = stmt.value, stmt.value is not None
            if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "field":
                kw = {k.arg: k.value for k in value.keywords if k.arg}
                value = kw.get("default")
                has_default = "default" in kw or "default_factory" in kw
            known, default = literal(value)
            annotation = ast.get_source_segment(self.source, stmt.annotation) or ""
            out.append(ScriptOption(
                dest=stmt.target.id, flag="--" + stmt.target.id, takes_value=annotation != "bool",
                line=stmt.lineno, origin=name, required=not has_default, has_default=has_default,
                default=default if known else None,
                default_text=ast.get_source_segment(self.source, value) or "" if value is not None else "",
            ))
        return out

    def settings(self, before: int) -> list[ScriptOption]:
        """Module-level ``name = value`` before the configurator: what ``--name=value`` sets."""
        out: list[ScriptOption] = []
        for stmt in self.tree.body:
            if stmt.lineno >= before:
                break
            if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
                name = stmt.targets[0].id
                known, value = literal(stmt.value)
                containers = (ast.List, ast.Tuple, ast.Dict, ast.Set, ast.ListComp, ast.DictComp,
                              ast.SetComp, ast.GeneratorExp, ast.Lambda)
                if name.startswith("_") or isinstance(stmt.value, containers) or (
                        known and not isinstance(value, int | float | str)):
                    continue
                out.append(ScriptOption(
                    dest=name, flag="--" + name, takes_value=True, line=stmt.lineno, origin="setting",
                    default=value if known else None,
                    default_text=ast.get_source_segment(self.source, stmt.value) or "",
                ))
        return out

    def one_of_groups(self, dests: set[str]) -> list[tuple[str, ...]]:
        """Options of which one is needed: ``if a is None and b is None: raise`` or an
        ``if a: ... elif b: ... else: raise`` chain."""
        groups: list[tuple[str, ...]] = []
        for names in [*self.raised_when_missing(), *self.chains_raising_at_end()]:
            group = tuple(dict.fromkeys(names))
            if all(n in dests for n in group) and group not in groups:
                groups.append(group)
        return groups

    def raised_when_missing(self) -> Iterator[list[str]]:
        """The names each ``if a is None and not b: ... raise`` tests."""
        for node in ast.walk(self.tree):
            if isinstance(node, ast.If) and _raises(node.body):
                names = _missing_names(node.test)
                if names:
                    yield names

    def chains_raising_at_end(self) -> Iterator[list[str]]:
        """The attributes each ``if a: ... elif b: ... else: raise`` chain tests."""
        for head in self.chain_heads():
            names, branch = [], head
            while len(branch.orelse) == 1 and isinstance(branch.orelse[0], ast.If):
                names += [n.attr for n in ast.walk(branch.test) if isinstance(n, ast.Attribute)]
                branch = branch.orelse[0]
            names += [n.attr for n in ast.walk(branch.test) if isinstance(n, ast.Attribute)]
            if branch is not head and _raises(branch.orelse):
                yield names

    def chain_heads(self) -> Iterator[ast.If]:
        """Each ``if`` that is not the ``elif`` of another."""
        for node in ast.walk(self.tree):
            parent = self.parents.get(node)
            if isinstance(node, ast.If) and not (isinstance(parent, ast.If) and parent.orelse == [node]):
                yield node

    # ---- behaviour ----------------------------------------------------------------------------

    def passes_resume(self) -> bool:
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("train", "fit"):
                for kw in node.keywords:
                    if kw.arg in ("resume_from_checkpoint", "ckpt_path") and not (
                            isinstance(kw.value, ast.Constant) and kw.value.value is None):
                        return True
        return False

    def mentions_dist_env(self, test: ast.AST, assigned: dict[str, ast.expr]) -> bool:
        if any(s in _DIST_VARS for s in _strings_in(test)):
            return True
        return any(isinstance(n, ast.Name) and n.id in assigned
                   and any(s in _DIST_VARS for s in _strings_in(assigned[n.id]))
                   for n in ast.walk(test))

    def cuda_ddp(self, facts: ScriptFacts) -> tuple[int | None, str]:
        """An ``if`` on the torchrun environment whose branch needs CUDA (nanoGPT's DDP branch)."""
        assigned = {t.id: n.value for n in ast.walk(self.tree) if isinstance(n, ast.Assign)
                    for t in n.targets if isinstance(t, ast.Name)}
        nccl_settings = {o.dest for o in facts.options if isinstance(o.default, str) and o.default.lower() == "nccl"}
        for node in ast.walk(self.tree):
            if not (isinstance(node, ast.If) and self.mentions_dist_env(node.test, assigned)):
                continue
            calls, mentions, fallback = [], [], False
            for stmt in node.body:
                for sub in ast.walk(stmt):
                    dotted = _dotted(sub.func) if isinstance(sub, ast.Call) else None
                    if dotted and ".cuda." in f".{dotted}":
                        if dotted.rsplit(".", 1)[-1] in ("is_available", "device_count"):
                            fallback = True
                        else:
                            calls.append(f"calls {dotted}() (line {getattr(sub, 'lineno', '?')})")
                    elif isinstance(sub, ast.Constant) and isinstance(sub.value, str):
                        low = sub.value.lower()
                        if "gloo" in low:
                            fallback = True
                        elif "nccl" in low or low.startswith("cuda"):
                            mentions.append(f"has {sub.value!r} (line {sub.lineno})")
                    elif isinstance(sub, ast.Name) and sub.id in nccl_settings:
                        mentions.append(f"uses {sub.id} = 'nccl' (line {sub.lineno})")
            if (calls or mentions) and not fallback:
                test = ast.get_source_segment(self.source, node.test) or "..."
                return node.lineno, f"under `if {test}:` (line {node.lineno}) it {(calls + mentions)[0]}"
        return None, ""

    def save_intervals(self) -> list[tuple[str, int]]:
        """``x`` of ``if step % x == 0: <save>`` (also inside a function the branch calls) and of
        ``ModelCheckpoint(every_n_train_steps=x)``."""
        savers = {f.name for f in ast.walk(self.tree) if isinstance(f, ast.FunctionDef)
                  and any(self.is_save(c) for c in ast.walk(f) if isinstance(c, ast.Call))}
        assigned = {t.id: n.value for n in ast.walk(self.tree) if isinstance(n, ast.Assign)
                    for t in n.targets if isinstance(t, ast.Name)}
        found: list[tuple[str, int]] = []
        for node in ast.walk(self.tree):
            if isinstance(node, ast.If):
                saves = any(isinstance(c, ast.Call) and (self.is_save(c) or _dotted(c.func) in savers)
                            for s in node.body for c in ast.walk(s))
                if not saves:
                    continue
                # `due = step % every == 0` then `if due:` counts as well
                tests = [node.test] + [assigned[n.id] for n in ast.walk(node.test)
                                       if isinstance(n, ast.Name) and n.id in assigned]
                for sub in (s for t in tests for s in ast.walk(t)):
                    if isinstance(sub, ast.BinOp) and isinstance(sub.op, ast.Mod):
                        name = primary_name(sub.right)
                        if name and (name, node.lineno) not in found:
                            found.append((name, node.lineno))
            elif isinstance(node, ast.Call) and (_dotted(node.func) or "").endswith("ModelCheckpoint"):
                for kw in node.keywords:
                    name = primary_name(kw.value) if kw.arg == "every_n_train_steps" else None
                    if name:
                        found.append((name, node.lineno))
        return found

    def is_save(self, call: ast.Call) -> bool:
        name = _dotted(call.func) or (call.func.attr if isinstance(call.func, ast.Attribute) else "")
        return bool(_SAVE_WORD.search(name.rsplit(".", 1)[-1]))

    def comparisons(self) -> dict[str, set[str]]:
        out: dict[str, set[str]] = {}
        for node in ast.walk(self.tree):
            if not isinstance(node, ast.Compare):
                continue
            sides = [node.left, *node.comparators]
            names = [n for s in sides if (n := primary_name(s)) and not isinstance(s, ast.Constant)]
            consts = [s.value for s in sides if isinstance(s, ast.Constant) and isinstance(s.value, str)]
            for side in sides:  # init_from.startswith('gpt2') counts as well
                if isinstance(side, ast.Call) and isinstance(side.func, ast.Attribute):
                    consts += [a.value for a in side.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
            for n in names:
                out.setdefault(n, set()).update(consts)
        return out

    # ---- printed loss lines --------------------------------------------------------------------

    def loss_lines(self) -> Iterator[LossLine]:
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Call):
                printed = printed_message(node)
                found = loss_fields(printed.parts) if printed is not None else None
                if printed is not None and found is not None:
                    yield self.loss_line(node, printed, found)

    def loss_line(self, call: ast.Call, printed: PrintedMessage, found: LossFields) -> LossLine:
        """The line's regex, scored: a line with a step, in a loop, printed (not logged at
        debug level) wins; one about validation or an aggregate (``losses['val']``) loses."""
        regex, before_loss = line_regex(printed.parts, found)
        words = expression_words(found.loss) if found.loss is not None else []
        score = (3 if found.step is not None else 0) + (2 if self.in_loop(call) else 0)
        score += 1 if printed.is_print else 0
        score -= 3 if is_eval_text(before_loss) or any(is_eval_text(w + " ") for w in words) else 0
        score -= 1 if isinstance(found.loss, ast.Subscript) else 0
        score -= 2 if not regex.strip(" .*?") or regex.startswith("(?P") else 0
        text = ast.get_source_segment(self.source, printed.message) or ""
        sample = "".join(p if isinstance(p, str) else "0.5" for p in printed.parts)
        return LossLine(regex=regex, has_step=found.step is not None, line=call.lineno,
                        text=text if len(text) <= 90 else text[:87] + "...", score=score,
                        interval=self.print_interval(call), sample=sample)

    def print_interval(self, node: ast.AST) -> str | None:
        """``x`` of the innermost enclosing ``if ... % x == 0`` (how often a line is printed); a
        parameter of the function it is in is followed to what its callers pass (gat's
        ``train_iter(..., args.val_every)`` prints ``if epoch % print_every == 0``)."""
        while node in self.parents:
            node = self.parents[node]
            if isinstance(node, ast.If):
                for sub in ast.walk(node.test):
                    if isinstance(sub, ast.BinOp) and isinstance(sub.op, ast.Mod):
                        if isinstance(sub.right, ast.Constant) and isinstance(sub.right.value, int):
                            return str(sub.right.value)  # a number in the code: no option sets it
                        name = primary_name(sub.right)
                        return self.passed_as(sub.right, name) if name else None
            if isinstance(node, ast.For | ast.While | ast.FunctionDef | ast.AsyncFunctionDef):
                return None
        return None

    def passed_as(self, node: ast.AST, name: str) -> str:
        """``name``, or when it is a parameter of the function around ``node``, the name its
        first caller passes for it (by position or keyword)."""
        func = node
        while func in self.parents and not isinstance(func, ast.FunctionDef | ast.AsyncFunctionDef):
            func = self.parents[func]
        if not isinstance(node, ast.Name) or not isinstance(func, ast.FunctionDef | ast.AsyncFunctionDef):
            return name
        params = [a.arg for a in [*func.args.posonlyargs, *func.args.args]]
        for call in ast.walk(self.tree):
            if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == func.name):
                continue
            given = [kw.value for kw in call.keywords if kw.arg == name]
            if name in params and params.index(name) < len(call.args):
                given.append(call.args[params.index(name)])
            passed = primary_name(given[0]) if given else None
            if passed:
                return passed
        return name

    def in_loop(self, node: ast.AST) -> bool:
        while node in self.parents:
            node = self.parents[node]
            if isinstance(node, ast.For | ast.While | ast.AsyncFor):
                return True
        return False


