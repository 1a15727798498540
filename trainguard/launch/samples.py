"""The sample indices each DataLoader batch of a run consumed, as the start-up hook recorded them.

For every command job with ``job.record_samples`` (the default), trainguard's run agent
(:mod:`trainguard.launch.hook`) writes ``{run_dir}/trainguard-samples/rank{rank}.jsonl`` from each
rank's main process: one line per batch a DataLoader iterator yielded,
``{"loader": k, "dataset": "<class>(<len>)", "iter": e, "batch": n, "indices": [...]}``.
:func:`read_samples` reads them back. See docs/metrics.md.
"""

from __future__ import annotations

import json
import os
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainguard._internal.readers import Unreadable, list_entries, read_text_lines
from trainguard.launch.hook import SAMPLES_DIR

__all__ = ["SampleBatch", "read_samples"]

_RANK_FILE = re.compile(r"rank(\d+)\.jsonl")


@dataclass(frozen=True)
class SampleBatch:
    """One batch a DataLoader iterator yielded in a rank's main process."""

    #: the k-th distinct DataLoader object of the process (from 0)
    loader: int
    #: the dataset's class and length, e.g. ``"TensorDataset(512)"``
    dataset: str
    #: the e-th iterator (pass, usually an epoch) created on that loader (from 0)
    iter: int
    #: the batch's number within that iterator (from 0)
    batch: int
    #: the dataset indices the batch holds, in order
    indices: list[Any] = field(default_factory=list)


def _batch(obj: Any) -> SampleBatch | None:
    if not isinstance(obj, dict):
        return None
    try:
        return SampleBatch(
            loader=int(obj["loader"]), dataset=str(obj.get("dataset", "")), iter=int(obj["iter"]),
            batch=int(obj["batch"]), indices=list(obj.get("indices") or []),
        )
    except (KeyError, TypeError, ValueError):
        return None


def read_samples(run_dir: Path) -> dict[int, list[SampleBatch]]:
    """Rank -> the batches its main process consumed, in order; ``{}`` when nothing was recorded
    (``job.record_samples: false``, a job without DataLoaders, a ``ray_train`` job). A line cut
    short by a kill is skipped; a record that is not a regular file inside the folder, or is
    over the read limits, is left out (docs/security.md)."""
    folder = Path(run_dir) / SAMPLES_DIR
    out: dict[int, list[SampleBatch]] = {}
    if not folder.is_dir():
        return out
    try:
        entries = list_entries(folder)
    except Unreadable:
        return out
    for entry in entries:
        match = _RANK_FILE.fullmatch(entry.name)
        batches = _read_batches(folder / entry.name, folder) if match is not None else None
        if match is not None and batches is not None:
            out[int(match.group(1))] = batches
    return dict(sorted(out.items()))


#: records already read, by (path, inode, size, mtime): a check reads the same run's records for
#: its accounting, its replay and its diagnosis; a finished run's records no longer change
_READ: OrderedDict[tuple[str, int, int, int], list[SampleBatch]] = OrderedDict()
_READ_LOCK = threading.Lock()
_READ_KEPT = 32


def _read_batches(path: Path, folder: Path) -> list[SampleBatch] | None:
    """:func:`_parse_batches`, read once per version of the file."""
    try:
        st = os.stat(path, follow_symlinks=False)
    except OSError:
        return None
    key = (str(path), st.st_ino, st.st_size, st.st_mtime_ns)
    with _READ_LOCK:
        kept = _READ.get(key)
        if kept is not None:
            _READ.move_to_end(key)
            return list(kept)
    batches = _parse_batches(path, folder)
    if batches is not None:
        with _READ_LOCK:
            _READ[key] = batches
            while len(_READ) > _READ_KEPT:
                _READ.popitem(last=False)
    return None if batches is None else list(batches)


def _parse_batches(path: Path, folder: Path) -> list[SampleBatch] | None:
    """The batches of one rank's record, read as data: a regular file inside ``folder``, within
    the read limits (None when it is not one, or is over a limit); a line that is not a batch,
    or is nested too deep, is skipped."""
    batches = []
    try:
        for line in read_text_lines(path, max_line=_MAX_RECORD_LINE, root=folder):
            try:
                batch = _batch(json.loads(line))
            except (ValueError, RecursionError):
                continue
            if batch is not None:
                batches.append(batch)
    except Unreadable:
        return None  # a FIFO, a link out, over the limit
    return batches


#: the longest line of a sample record read (a batch's indices); a longer one is cut, so skipped
_MAX_RECORD_LINE = 16 * 1024 * 1024
