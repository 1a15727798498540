"""What a training script prints, read from its source with :mod:`ast`: its ``print`` and
logging calls as literal text and fields, and the metric regex of a line that prints a loss.

Used by :mod:`trainguard.config.scriptscan` (``trainguard init``): ``print(f"iter {it}: loss
{lossf:.4f}")`` becomes ``iter (?P<step>\\d+): loss (?P<value>[-+.\\w]+)``.
"""

from __future__ import annotations

import ast
import re
import string
from dataclasses import dataclass
from typing import Any

__all__ = ["LossFields", "Part", "PrintedMessage", "expression_words", "is_eval_text", "line_regex",
           "literal", "loss_fields", "primary_name", "printed_message"]

#: a printed message is literal text and fields ``(expression, format spec)``
Part = str | tuple[ast.AST | None, str]

#: a field of a printed line that holds the step (its name, or the name it is computed from)
_STEP_NAME = re.compile(
    r"^(global_?step|steps?|step_?(num|idx|count)|(cur|current|train|opt)_?step|iter|iter_?num|"
    r"iteration|it|itr|i|update|num_updates|n_?updates|batch_?idx)$"
)
#: calls whose first argument is a line the job prints
_PRINT_ATTRS = ("info", "warning", "debug", "log", "write", "print", "critical", "error")
_EVAL_WORD = re.compile(r"\b(val|eval|valid|validation|test)\b|(val|eval)_", re.IGNORECASE)
#: the text just before a printed field that names it a loss / a step (``loss: {x}``)
_LOSS_LABEL = re.compile(r"\bloss\s*[:=]?\s*$", re.IGNORECASE)
_STEP_LABEL = re.compile(r"\b(step|iter|iteration|it)\s*[:=#]?\s*$", re.IGNORECASE)
_PERCENT_SPEC = re.compile(r"%(\([^)]*\))?([-#0 +]*\d*(?:\.\d+)?)([diouxXeEfFgGcrsa%])")


@dataclass(frozen=True)
class PrintedMessage:
    """One ``print``/logging call's message."""

    message: ast.AST
    parts: list[Part]
    is_print: bool


@dataclass(frozen=True)
class LossFields:
    """The fields of a message that hold the loss and (None when it has none) the step."""

    loss_part: tuple[ast.AST | None, str]
    step_part: tuple[ast.AST | None, str] | None

    @property
    def loss(self) -> ast.AST | None:
        """The loss's expression."""
        return self.loss_part[0]

    @property
    def step(self) -> ast.AST | None:
        """The step's expression (None without a step)."""
        return self.step_part[0] if self.step_part is not None else None


def is_eval_text(text: str) -> bool:
    """Whether ``text`` speaks of validation or testing (``val loss``, ``eval_loss``)."""
    return bool(_EVAL_WORD.search(text))


def literal(node: ast.AST | None) -> tuple[bool, Any]:
    """``(True, value)`` for a literal expression (``ast.literal_eval``), else ``(False, None)``."""
    if node is None:
        return False, None
    try:
        return True, ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return False, None


def expression_words(node: ast.AST) -> list[str]:
    """The identifiers of an expression, and the string keys it subscripts with."""
    out: list[str] = []
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name):
            out.append(sub.id)
        elif isinstance(sub, ast.Attribute):
            out.append(sub.attr)
        elif isinstance(sub, ast.Subscript) and isinstance(sub.slice, ast.Constant) and isinstance(sub.slice.value, str):
            out.append(sub.slice.value)
    return out


def primary_name(node: ast.AST) -> str | None:
    """The name a printed field is about: ``step`` for ``step``, ``args.step``, ``step + 1``,
    ``int(step)``."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.BinOp):
        return primary_name(node.left)
    if isinstance(node, ast.Call) and len(node.args) == 1 and isinstance(node.func, ast.Name):
        return primary_name(node.args[0])
    return None


def printed_message(call: ast.Call) -> PrintedMessage | None:
    """The message of a ``print(...)``, ``logger.info(...)``-like call, or None for other calls."""
    func = call.func
    is_print = isinstance(func, ast.Name) and func.id == "print"
    if not (is_print or (isinstance(func, ast.Attribute) and func.attr in _PRINT_ATTRS)):
        return None
    args = list(call.args)
    if isinstance(func, ast.Attribute) and func.attr == "log" and args and not _is_text(args[0]):
        args = args[1:]  # logger.log(level, msg, ...)
    if not args:
        return None
    parts = _message_parts(args[0], args[1:], print_sep=_print_sep(call) if is_print else None)
    return PrintedMessage(args[0], parts, is_print) if parts is not None else None


def loss_fields(parts: list[Part]) -> LossFields | None:
    """The loss field of a message (its expression names a loss, or the text before it says
    ``loss``) and its step field; None without a loss."""
    fields = [(p[0], p[1]) for p in parts if isinstance(p, tuple) and p[0] is not None]
    index = {id(f[0]): i for i, f in enumerate(parts) if isinstance(f, tuple)}

    def labelled(f: tuple[ast.AST, str], label: re.Pattern[str]) -> bool:
        # `loss {1.0 / step:.4f}`: the text before a field names it
        i = index[id(f[0])]
        before = parts[i - 1] if i > 0 else ""
        return isinstance(before, str) and bool(label.search(before))

    loss = next((f for f in fields if any("loss" in w.lower() for w in expression_words(f[0]))), None) or next(
        (f for f in fields if labelled(f, _LOSS_LABEL)), None)
    if loss is None:
        return None
    step = next((f for f in fields if f[0] is not loss[0]
                 and _STEP_NAME.match((primary_name(f[0]) or "").lower())), None) or next(
        (f for f in fields if f[0] is not loss[0] and labelled(f, _STEP_LABEL)), None)
    whole = {id(f[0]): f for f in parts if isinstance(f, tuple)}
    return LossFields(whole[id(loss[0])], whole[id(step[0])] if step is not None else None)


def line_regex(parts: list[Part], found: LossFields) -> tuple[str, str]:
    """The regex of a message up to its loss and step fields, and the text before the loss.
    Literal text is kept, the step is ``(?P<step>\\d+)``, the loss ``(?P<value>[-+.\\w]+)``
    (numbers, nan, inf), other fields ``.*?``."""
    loss, step = found.loss_part, found.step_part
    last = max(parts.index(loss), parts.index(step) if step is not None else -1)
    regex, before_loss = "", ""
    for i, part in enumerate(parts[: last + 1]):
        if isinstance(part, str):
            regex += _escape(part)
            if i < parts.index(loss):
                before_loss += part
        elif part is loss:
            number = part[1] and part[1][-1:] in "eEfFgG%d"
            wrapped = isinstance(part[0], ast.Call)  # float(loss), loss.item()
            # `loss {:5.2f}` prints `loss  6.42` as well as `loss 11.23`
            regex = _padded(regex, part[1]) + ("" if number or wrapped else r"(?:tensor\()?") + r"(?P<value>[-+.\w]+)"
        elif part is step:
            regex = _padded(regex, part[1]) + r"(?P<step>\d+)"
        else:
            regex += ".*?"
    return regex, before_loss


def _padded(regex: str, spec: str | None) -> str:
    """``regex`` before a field whose format ``spec`` pads it to a width (``5.2f``, ``>8``):
    the spaces before it become `` +`` (`` *`` where the text had none)."""
    if not re.match(r"[<>^= ]?\d", spec or ""):
        return regex
    return regex.rstrip(" ") + (" +" if regex.endswith(" ") else " *")


def _is_text(node: ast.AST) -> bool:
    return isinstance(node, ast.JoinedStr) or (isinstance(node, ast.Constant) and isinstance(node.value, str)) or (
        isinstance(node, ast.BinOp) and _is_text(node.left)) or (
        isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "format")


def _print_sep(call: ast.Call) -> str | None:
    for kw in call.keywords:
        if kw.arg == "sep":
            known, value = literal(kw.value)
            return value if known and isinstance(value, str) else None
    return " "


def _message_parts(message: ast.AST, rest: list[ast.expr], print_sep: str | None = None,
                   ) -> list[Part] | None:
    """A printed message as literal text and fields ``(expression, format spec)``: an f-string,
    ``"...".format(...)``, ``"..." % (...)``, logging's ``("...", a, b)`` or ``print`` of several
    values (``print("step", step, "loss", loss)``)."""
    if rest and print_sep is not None:
        return _print_parts([message, *rest], print_sep)
    if isinstance(message, ast.Constant) and isinstance(message.value, str) and not rest:
        return [message.value]
    if isinstance(message, ast.JoinedStr):
        return _fstring_parts(message)
    if (isinstance(message, ast.Call) and isinstance(message.func, ast.Attribute) and message.func.attr == "format"
            and isinstance(message.func.value, ast.Constant) and isinstance(message.func.value.value, str)):
        return _format_parts(message.func.value.value, message)
    if isinstance(message, ast.BinOp) and isinstance(message.op, ast.Mod):
        values = message.right.elts if isinstance(message.right, ast.Tuple) else [message.right]
        return _percent_parts(message.left, list(values))
    if rest:
        return _percent_parts(message, rest)
    return None


def _print_parts(values: list[ast.AST], sep: str) -> list[Part]:
    """``print(a, b, ...)``: each value's own parts (a literal string its text, any other value a
    field), ``sep`` between them."""
    parts: list[Part] = []
    for i, arg in enumerate(values):
        if i:
            parts.append(sep)
        sub = _message_parts(arg, [])
        if sub is None:
            known, value = literal(arg)
            parts += [str(value)] if known and isinstance(value, str) else [(arg, "")]
        else:
            parts += sub
    return _merge_text(parts)


def _fstring_parts(message: ast.JoinedStr) -> list[Part]:
    """An f-string's text and its fields, each with its literal format spec (``:.4f``)."""
    parts: list[Part] = []
    for value in message.values:
        if isinstance(value, ast.Constant):
            parts.append(str(value.value))
        elif isinstance(value, ast.FormattedValue):
            spec = "".join(str(v.value) for v in value.format_spec.values
                           if isinstance(v, ast.Constant)) if isinstance(value.format_spec, ast.JoinedStr) else ""
            parts.append((value.value, spec))
    return parts


def _format_parts(template: str, call: ast.Call) -> list[Part] | None:
    """``template.format(...)``: its text and fields, each field with the argument it names
    (``{}`` the next positional one, ``{0}`` by index, ``{name}`` by keyword; None when the call
    does not pass it). None for a template ``str.format`` cannot parse."""
    keywords = {k.arg: k.value for k in call.keywords if k.arg}
    parts: list[Part] = []
    auto = 0
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError:
        return None
    for text, name, format_spec, _conv in parsed:
        if text:
            parts.append(text)
        if name is None:
            continue
        base = re.split(r"[.\[]", name)[0]
        expr: ast.AST | None
        if base == "":
            expr = call.args[auto] if auto < len(call.args) else None
            auto += 1
        elif base.isdigit():
            expr = call.args[int(base)] if int(base) < len(call.args) else None
        else:
            expr = keywords.get(base)
        parts.append((expr, format_spec or ""))
    return parts


def _percent_parts(template: ast.AST, values: list[ast.expr]) -> list[str | tuple[ast.AST | None, str]] | None:
    if not (isinstance(template, ast.Constant) and isinstance(template.value, str)):
        return None
    parts: list[str | tuple[ast.AST | None, str]] = []
    text, at, index = template.value, 0, 0
    for match in _PERCENT_SPEC.finditer(text):
        parts.append(text[at:match.start()])
        at = match.end()
        if match.group(3) == "%":
            parts.append("%")
            continue
        expr = values[index] if index < len(values) else None
        index += 1
        parts.append((expr, match.group(2) + match.group(3)))
    parts.append(text[at:])
    return [p for p in parts if p != ""]


def _merge_text(parts: list[str | tuple[ast.AST | None, str]]) -> list[str | tuple[ast.AST | None, str]]:
    out: list[str | tuple[ast.AST | None, str]] = []
    for part in parts:
        if isinstance(part, str) and out and isinstance(out[-1], str):
            out[-1] += part
        elif part != "":
            out.append(part)
    return out


def _escape(text: str) -> str:
    """``text`` as a regex, escaping only what regexes treat specially (spaces stay readable)."""
    return re.sub(r"([.^$*+?{}\[\]\\|()])", r"\\\1", text).replace("\n", r"\n").replace("\t", r"\t")
