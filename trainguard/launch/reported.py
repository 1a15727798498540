"""Whether a rank reported its failure: the lines of its stderr that say something.

A job that fails cleanly exits non-zero and says why on stderr, in its own words: a traceback,
the text of an ``OSError``, a sentence of its own, in any language. What it says is not judged;
that it said something is. A line says something unless it is one of the lines a rank writes
while it trains anyway:

* a metric line (one of the job's metric regexes matches it);
* a progress bar (tqdm, rich, Keras: a percentage with a bar, ``12/40 [00:03<00:09, ...]``,
  ``it/s``);
* a warning (Python's ``warnings`` format and the source line under it, a logging ``WARNING``
  level, a ``[W ...]`` / ``W0101 ...`` line of torch's C++ side or glog);
* trainguard's own lines (the start-up hook's notes, the rank log's dropped-bytes marker).

:func:`reported_line` gives the last line that says something (the one a summary shows: a
traceback's last line is its exception), or None when the rank said nothing.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

__all__ = ["reported_line", "says_something"]

_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
_PROGRESS = re.compile(
    r"\d+(\.\d+)?%\s*\|"                    # tqdm: " 50%|#####     |"
    r"|\|\s*\d+/\d+\s*\["                    # tqdm: "| 5/10 ["
    r"|\[\d+:\d+(:\d+)?<"                    # tqdm: "[00:03<00:09"
    r"|\d+(\.\d+)?\s*(it|s|ex|samples|batches)/(s|it)\b"  # rates: "49.5it/s", "2.1s/it"
    r"|[\u2580-\u259f\u2500-\u257f]{3,}"     # block and box characters: rich, tqdm's unicode bar
    r"|\[=*>\.*\]|\[=+\.*\]"                # Keras: "[=====>....]"
    r"|^\s*\d+it \[",                        # tqdm without a total: "10it [00:00, ...]"
)
#: Python's warnings format: "path:12: UserWarning: message" (the next, indented line is its source)
_PY_WARNING = re.compile(r":\d+: [A-Z]\w*Warning: ")
_WARNING = re.compile(
    r"^\s*\[W[\s\d]"                         # torch C++: "[W socket.cpp:...]", "[W1230 ...]"
    r"|^W\d{4} "                             # glog: "W0101 12:00:00.000 ..."
    r"|\bWARN(ING)?\b"                       # logging's level: "WARNING:root:...", "... WARNING ..."
    r"|^\s*[A-Z]\w*Warning: "                # a warning printed without its location
)
#: trainguard's own lines in a rank's stderr: the start-up hook's notes (``trainguard run hook:
#: ...``, ``trainguard fault hook not armed: ...``) and the rank log's ``[trainguard: N bytes ...]``
_OWN = re.compile(r"^\s*(trainguard (run|fault) (hook|drill)\b|\[trainguard: )")


def says_something(line: str, metric_regexes: Iterable[re.Pattern[str]] = ()) -> bool:
    """Whether one stderr line (ANSI colours removed) says something: not blank, not a metric
    line, a progress bar, a warning or trainguard's own line."""
    if not line.strip():
        return False
    if _PROGRESS.search(line) or _PY_WARNING.search(line) or _WARNING.search(line) or _OWN.search(line):
        return False
    return not any(rx.search(line) for rx in metric_regexes)


def reported_line(text: str, metric_regexes: Iterable[str] = ()) -> str | None:
    """The last line of ``text`` (a rank's stderr) that says something (:func:`says_something`),
    stripped; None when no line does. Progress-bar redraws (``\\r``) are lines of their own, and
    the indented source line Python prints under a warning belongs to the warning."""
    patterns = []
    for rx in metric_regexes:
        try:
            patterns.append(re.compile(rx))
        except re.error:  # validated at load; an odd one must not cost the verdict
            continue
    last = None
    after_warning = False
    for raw in text.splitlines():
        line = _ANSI.sub("", raw)
        if after_warning and line[:1].isspace():
            after_warning = False
            continue  # "  warnings.warn(...)": the warning's own source line
        after_warning = bool(_PY_WARNING.search(line))
        if says_something(line, patterns):
            last = line.strip()
    return last
