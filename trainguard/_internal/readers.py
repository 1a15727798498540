"""Reading files trainguard did not write: checkpoints, Trainer state, logs, records.

The job's code is trusted (trainguard runs it); the files it leaves, or that come from shared
storage, are data and may be hostile (docs/security.md). Every reader of such a file goes
through this module, which

* opens regular files only: the path is stat'ed before it is opened, so a FIFO, a socket or a
  device is refused by name and never opened (an open could block, or have effects);
* keeps a path inside the directory named: links are resolved and one that leads out is
  refused; a name with ``..`` or an absolute path (a DCP entry) is refused the same way;
* reads at most :attr:`ReadLimits.max_bytes` of a file, lists at most
  :attr:`ReadLimits.max_files` entries of a directory and gives up a read after
  :attr:`ReadLimits.seconds` (:class:`Deadline`); what is over a limit raises
  :class:`OverLimit`, which callers report as "skipped: over the limit", never as equal;
* raises :class:`Unreadable` (a ``ValueError``) with the reason for every other refusal, so a
  caller names the file and goes on with the rest.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import stat
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

__all__ = [
    "DEFAULT_LIMITS",
    "OWN_FILE_LIMITS",
    "Deadline",
    "LineTail",
    "OverLimit",
    "ReadLimits",
    "Unreadable",
    "active_limits",
    "contained",
    "copy_tree",
    "file_kind",
    "list_entries",
    "open_regular",
    "read_at_most",
    "read_bytes",
    "read_head_lines",
    "read_json",
    "read_json_streaming",
    "read_text_lines",
    "regular_size",
    "shown_name",
    "use_limits",
]

@dataclass(frozen=True)
class ReadLimits:
    """The most one read of an untrusted file may cost: ``max_bytes`` per file, ``max_files``
    entries listed per directory, ``seconds`` per read (a checkpoint, a log). The settings
    ``read_max_mb``, ``read_max_files`` and ``read_timeout`` set them (docs/security.md)."""

    max_bytes: int = 4 * 1024**3
    max_files: int = 10_000
    seconds: float = 120.0

    def __post_init__(self) -> None:
        if self.max_bytes < 0 or self.max_files < 1 or not self.seconds > 0:
            raise ValueError(f"read limits must be positive, not {self}")


#: the limits when no setting names others
DEFAULT_LIMITS = ReadLimits()
#: the limits of a file trainguard wrote itself and reads back (a report, a profile's report and
#: plots): such a file is kilobytes to a few megabytes, and one over 64 MiB is not one it wrote
#: (parsed whole, a JSON file costs about five times its size; the settings do not raise this)
OWN_FILE_LIMITS = ReadLimits(max_bytes=64 * 2**20, seconds=60.0)
_ACTIVE = [DEFAULT_LIMITS]


def use_limits(limits: ReadLimits) -> None:
    """Make ``limits`` those of every read that names none: the runner sets them once from the
    settings (``read_max_mb``, ``read_max_files``, ``read_timeout``), so every caller, down to
    a judge comparing checkpoints, reads within the same stated limits."""
    _ACTIVE[0] = limits


def active_limits() -> ReadLimits:
    """The limits of a read that names none (:func:`use_limits`; else :data:`DEFAULT_LIMITS`)."""
    return _ACTIVE[0]


class Unreadable(ValueError):
    """A file that is not read, and why (``str(exc)``): not a regular file, a link out of its
    directory, malformed. Callers report it as ``unreadable: <why>`` and read the rest."""


class OverLimit(Unreadable):
    """A file or directory over a :class:`ReadLimits` limit; reported as ``skipped: over the
    limit``, and a comparison that skipped it is never called equal."""


def shown_name(path: Path | str) -> str:
    """A file name as a message or a report shows it: undecodable bytes escaped (``\\xff``), so a
    non-UTF-8 name never breaks the JSON or the terminal."""
    text = os.fsdecode(path) if not isinstance(path, str) else path
    return text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


def contained(root: Path, path: Path) -> Path:
    """``path`` with its links resolved, when it is ``root`` or inside it (``root`` resolved
    too); :class:`Unreadable` when a link, a ``..`` or an absolute name leads out of ``root``,
    or the links loop."""
    try:
        real_root = root.resolve()
        real = path.resolve(strict=False)
    except (OSError, RuntimeError) as exc:  # a loop of links
        raise Unreadable(f"{shown_name(path.name)} cannot be resolved: {exc}") from None
    if real != real_root and not real.is_relative_to(real_root):
        raise Unreadable(f"{shown_name(path.name)} leads outside {shown_name(root)} (to "
                         f"{shown_name(real)}); only files inside the directory named are read")
    return real


def file_kind(mode: int) -> str:
    """What an ``st_mode`` is, in words (``a FIFO``, ``a character device``, ...)."""
    for test, words in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
                        (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                        (stat.S_ISSOCK, "a socket"), (stat.S_ISREG, "a regular file")):
        if test(mode):
            return words
    return "not a regular file"


def copy_tree(source: Path, target: Path) -> dict[str, str]:
    """Copy the directory ``source`` to ``target`` (which must not exist yet) as a resume would
    find it: directories, regular files, and links as links (never followed). A FIFO, a socket
    or a device is left out, never opened (an open could block, or read forever): {its path
    relative to ``source``: why}. An error copying the rest is an ``OSError``."""
    left_out: dict[str, str] = {}

    def special(directory: str, names: list[str]) -> set[str]:
        out = set()
        for name in names:
            path = os.path.join(directory, name)
            try:
                mode = os.lstat(path).st_mode
            except OSError:
                continue  # gone meanwhile: the copy says so
            if not (stat.S_ISDIR(mode) or stat.S_ISREG(mode) or stat.S_ISLNK(mode)):
                left_out[shown_name(os.path.relpath(path, source))] = f"{file_kind(mode)}, not copied"
                out.add(name)
        return out

    shutil.copytree(source, target, symlinks=True, ignore=special)
    return left_out


def regular_size(path: Path, limits: ReadLimits | None = None) -> int:
    """The size of ``path`` after checking, without opening it, that it is a regular file no
    larger than ``limits.max_bytes``; :class:`Unreadable` / :class:`OverLimit` otherwise."""
    limits = limits or active_limits()
    try:
        info = os.stat(path)
    except OSError as exc:
        raise Unreadable(f"{shown_name(path.name)} cannot be read: {exc.strerror}") from None
    if not stat.S_ISREG(info.st_mode):
        raise Unreadable(f"{shown_name(path.name)} is {file_kind(info.st_mode)}, not a regular file; "
                         "not opened")
    if info.st_size > limits.max_bytes:
        raise OverLimit(f"{shown_name(path.name)} is {info.st_size} bytes, over the limit of "
                        f"{limits.max_bytes} (setting read_max_mb)")
    return info.st_size


def open_regular(path: Path, limits: ReadLimits | None = None, *, root: Path | None = None) -> BinaryIO:
    """``path`` opened for reading in binary, when it is a regular file within the limits (and
    inside ``root`` when given). Opened non-blocking and checked again after the open, so a file
    swapped for a FIFO in between is still refused rather than waited on."""
    limits = limits or active_limits()
    if root is not None:
        path = contained(root, path)
    size = regular_size(path, limits)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise Unreadable(f"{shown_name(path.name)} cannot be opened: {exc.strerror}") from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_size > max(size, limits.max_bytes):
        os.close(fd)
        raise Unreadable(f"{shown_name(path.name)} changed while it was opened; not read")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


#: what a read past the size a file had when it was opened takes at a time
_CHUNK = 1024**2


def read_bytes(path: Path, limits: ReadLimits | None = None, *, root: Path | None = None) -> bytes:
    """The whole of a regular file within ``limits.max_bytes`` (see :func:`open_regular`). The
    memory is the file's: its size when opened is read at once, anything it grew by after that
    in chunks, up to the limit (never a buffer of the limit's size: 30 GB for a 3 KB file)."""
    limits = limits or active_limits()
    with open_regular(path, limits, root=root) as handle:
        size = os.fstat(handle.fileno()).st_size
        data = handle.read(min(size, limits.max_bytes) + 1)  # one byte more: did it grow?
        if len(data) > size:  # it grew after the open (or reports no size, as /proc does)
            data += read_at_most(handle, limits.max_bytes + 1 - len(data))
    if len(data) > limits.max_bytes:
        raise OverLimit(f"{shown_name(path.name)} grew past the limit of {limits.max_bytes} bytes")
    return data


def read_at_most(handle: BinaryIO, most: int) -> bytes:
    """At most ``most`` bytes of ``handle``, read :data:`_CHUNK` at a time: the memory is what
    the file holds, never ``most`` allocated up front (``handle.read(most)`` does that)."""
    rest = bytearray()
    while len(rest) < most:
        chunk = handle.read(min(_CHUNK, most - len(rest)))
        if not chunk:
            break
        rest += chunk
    return bytes(rest)


def read_json(path: Path, limits: ReadLimits | None = None, *, root: Path | None = None) -> Any:
    """A JSON file read as data: regular, within the limits, not nested past the parser's
    recursion limit; :class:`Unreadable` saying why otherwise."""
    limits = limits or active_limits()
    return _parse_json(read_bytes(path, limits, root=root), shown_name(path.name))


def _parse_json(data: bytes, name: str) -> Any:
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise Unreadable(f"{name} is not UTF-8 JSON: {exc.reason} at byte {exc.start}") from None
    try:
        return json.loads(text)
    except RecursionError:
        raise Unreadable(f"{name} nests too deep to parse; not read") from None
    except ValueError as exc:
        raise Unreadable(f"{name} is not JSON: {str(exc)[:200]}") from None


#: a JSON file larger than this has its streamed key read one item at a time and not kept
STREAM_OVER_BYTES = 16 * 1024**2
_SPACE = re.compile(r"[ \t\n\r]*")


def read_json_streaming(path: Path, key: str, limits: ReadLimits | None = None, *,
                        root: Path | None = None, over: int = STREAM_OVER_BYTES) -> Any:
    """A JSON object like :func:`read_json`, except that when the file is larger than ``over``
    bytes the list under ``key`` (the Trainer's ``log_history``) is parsed one item at a time and
    not kept: its value becomes ``"<N entries, not read: ...>"``. A log decides nothing, and
    building it whole costs gigabytes for a long run's ``trainer_state.json``."""
    limits = limits or active_limits()
    data = read_bytes(path, limits, root=root)
    name = shown_name(path.name)
    if len(data) <= over:
        return _parse_json(data, name)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise Unreadable(f"{name} is not UTF-8 JSON: {exc.reason} at byte {exc.start}") from None
    del data
    try:
        return _stream_object(text, key, Deadline(limits, name))
    except (ValueError, IndexError, RecursionError) as exc:
        raise Unreadable(f"{name} is not a JSON object: {str(exc)[:200]}") from None


def _stream_object(text: str, key: str, deadline: Deadline) -> dict[str, Any]:
    decoder = json.JSONDecoder()
    at = _SPACE.match(text, 0).end()  # type: ignore[union-attr]
    if text[at] != "{":
        raise ValueError("it does not start with {")
    document: dict[str, Any] = {}
    at = _SPACE.match(text, at + 1).end()  # type: ignore[union-attr]
    while text[at] != "}":
        name, at = decoder.raw_decode(text, at)
        at = _SPACE.match(text, at).end()  # type: ignore[union-attr]
        if text[at] != ":" or not isinstance(name, str):
            raise ValueError(f"no ':' after a key at character {at}")
        at = _SPACE.match(text, at + 1).end()  # type: ignore[union-attr]
        if name == key and text[at] == "[":
            count, at = _skip_array(text, at, decoder, deadline)
            document[name] = f"<{count} entries, not read: a log, and the file is large>"
        else:
            document[name], at = decoder.raw_decode(text, at)
        at = _SPACE.match(text, at).end()  # type: ignore[union-attr]
        if text[at] == ",":
            at = _SPACE.match(text, at + 1).end()  # type: ignore[union-attr]
        elif text[at] != "}":
            raise ValueError(f"no ',' or '}}' at character {at}")
    return document


def _skip_array(text: str, at: int, decoder: json.JSONDecoder, deadline: Deadline) -> tuple[int, int]:
    """(items, the index after the array) of the JSON array starting at ``at``, each item
    parsed and dropped."""
    count = 0
    at = _SPACE.match(text, at + 1).end()  # type: ignore[union-attr]
    if text[at] == "]":
        return 0, at + 1
    while True:
        _, at = decoder.raw_decode(text, at)
        count += 1
        if not count % 1000:
            deadline.check()
        at = _SPACE.match(text, at).end()  # type: ignore[union-attr]
        if text[at] == "]":
            return count, at + 1
        if text[at] != ",":
            raise ValueError(f"no ',' or ']' at character {at}")
        at = _SPACE.match(text, at + 1).end()  # type: ignore[union-attr]


def read_text_lines(path: Path, limits: ReadLimits | None = None, *, max_line: int = 64 * 1024,
                    root: Path | None = None) -> Iterator[str]:
    """The lines of a text file (a log), one at a time, decoded with undecodable bytes replaced,
    each cut to ``max_line`` characters; at most ``limits.max_bytes`` are read and the reading
    stops at ``limits.seconds``. Regular files only."""
    limits = limits or active_limits()
    with open_regular(path, limits, root=root) as handle:
        yield from _lines(handle, limits.max_bytes, max_line, Deadline(limits, shown_name(path.name)))


def read_head_lines(path: Path, most: int, *, max_line: int = 64 * 1024, root: Path | None = None) -> Iterator[str]:
    """The complete lines of the first ``most`` bytes of a text file of any size (a record its
    writer caps, read up to the reader's own cap: the file's size never sets what is read), as
    :func:`read_text_lines` gives them; a line the cap cuts is left out. Regular files only."""
    limits = active_limits()
    size = os.stat(path, follow_symlinks=False).st_size if os.path.lexists(path) else 0
    opened = dataclasses.replace(limits, max_bytes=max(size, limits.max_bytes))
    with open_regular(path, opened, root=root) as handle:
        for line, whole in _lines(handle, most, max_line, Deadline(limits, shown_name(path.name)), cut=True):
            if whole:
                yield line


def _lines(handle: BinaryIO, left: int, max_line: int, deadline: Deadline, *, cut: bool = False) -> Iterator[Any]:
    """The lines of ``handle`` within ``left`` bytes, each cut to ``max_line`` characters;
    ``cut``: each as (line, whether it ended before the ``left`` bytes did)."""
    while left > 0:
        raw = handle.readline(min(max_line, left))
        if not raw:
            return
        left -= len(raw)
        if len(raw) == max_line and not raw.endswith(b"\n"):
            rest = handle.readline(left)  # the rest of a very long line is dropped
            left -= len(rest)
        deadline.check()
        line = raw.decode("utf-8", "replace").rstrip("\r\n")
        yield (line, raw.endswith(b"\n") or left > 0) if cut else line


class LineTail:
    """Follows a file another process appends to (a job's log, a JSONL metrics file): each
    :meth:`lines` gives the complete lines added since the last, as bytes without the newline.

    Regular files only (a FIFO or a device is refused by :func:`open_regular`, never waited on);
    a missing file is not there *yet* (nothing is read). One line at a time is held, cut to
    ``max_line`` bytes (the rest of a longer line is dropped), so the memory is one line's, never
    the file's. An incomplete last line waits for its newline. :class:`OverLimit` once the file
    is over ``limits.max_bytes``; :class:`Unreadable` when it is not a regular file.
    """

    def __init__(self, path: Path, limits: ReadLimits | None = None, *, max_line: int = 64 * 1024) -> None:
        self.path = path
        self.limits = limits
        self.max_line = max_line
        #: where the next complete line starts
        self.offset = 0
        self._dropping = False  # inside the dropped rest of a long line

    def lines(self, until: float | None = None) -> Iterator[bytes]:
        """The complete lines added since the last call. ``until`` (a ``time.monotonic()``): stop
        there and leave the rest for the next call (see :attr:`caught_up`)."""
        self.caught_up = False
        try:
            os.stat(self.path)
        except FileNotFoundError:
            self.caught_up = True
            return
        except OSError as exc:
            raise Unreadable(f"{shown_name(self.path.name)} cannot be read: {exc.strerror}") from None
        with open_regular(self.path, self.limits) as handle:
            handle.seek(self.offset)
            while until is None or time.monotonic() < until:
                raw = handle.readline(self.max_line)
                if not raw.endswith(b"\n") and len(raw) < self.max_line:
                    self.caught_up = True  # the end, or an incomplete last line
                    return
                self.offset += len(raw)
                if self._dropping:
                    self._dropping = not raw.endswith(b"\n")
                    continue
                self._dropping = not raw.endswith(b"\n")  # a line longer than max_line: cut
                yield raw.rstrip(b"\r\n")

    #: whether the last :meth:`lines` read to the end (False: it stopped at ``until``)
    caught_up = True


def list_entries(directory: Path, limits: ReadLimits | None = None) -> list[os.DirEntry[str]]:
    """The entries of ``directory`` (not following links), sorted by name; :class:`OverLimit`
    when it holds more than ``limits.max_files``."""
    limits = limits or active_limits()
    entries: list[os.DirEntry[str]] = []
    try:
        with os.scandir(directory) as scan:
            for entry in scan:
                entries.append(entry)
                if len(entries) > limits.max_files:
                    raise OverLimit(f"{shown_name(directory.name)} holds more than {limits.max_files} "
                                    "entries, over the limit (setting read_max_files)")
    except OSError as exc:
        raise Unreadable(f"{shown_name(directory.name)} cannot be listed: {exc.strerror}") from None
    return sorted(entries, key=lambda e: e.name)


class Deadline:
    """The end of one read's time (``limits.seconds`` from now): :meth:`check` raises
    :class:`OverLimit` naming ``what`` once it has passed. Checked between items, so one
    long step (a huge tensor) still ends, but a read of many small ones stops in time."""

    def __init__(self, limits: ReadLimits, what: str) -> None:
        self.seconds = limits.seconds
        self.what = what
        self.ends = time.monotonic() + limits.seconds

    def check(self) -> None:
        if time.monotonic() > self.ends:
            raise OverLimit(f"reading {self.what} took more than {self.seconds:g} s, over the limit "
                            "(setting read_timeout)")
