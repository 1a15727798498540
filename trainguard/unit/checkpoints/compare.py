"""Comparing the final checkpoints of two runs, key by key, summarised by component."""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from trainguard.evidence import UNSET, Evidence, Unset
from trainguard.unit.checkpoints.files import (
    CheckpointContents,
    checkpoint_candidates,
    describe_candidates,
    read_checkpoint,
    resolve_checkpoint,
)
from trainguard.unit.checkpoints.state import (
    COMPONENTS,
    Entry,
    classify_path,
    describe_keys,
    flatten_parts,
)

__all__ = ["LayoutDifference", "LayoutEvidence", "StateComparison", "StateEvidence", "compare_checkpoint_dirs", "compare_layouts"]


@dataclass
class StateComparison:
    """Result of comparing the final checkpoints of two runs.

    ``differing``: (key, what differs) for every state key that differs (or is in one run only);
    ``by_component``: component -> those keys; ``metadata_differing``: keys whose values are paths
    or times and differ (reported apart, never a failure); ``skipped``: file -> why not read."""

    compared: bool
    reason: str = ""
    files: tuple[str, str] | None = None
    differing: list[tuple[str, str]] = field(default_factory=list)
    by_component: dict[str, list[str]] = field(default_factory=dict)
    metadata_differing: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    #: the parts not compared because one run's was over a read limit: never counted as equal
    over_limit: list[str] = field(default_factory=list)
    #: how many state keys were compared
    compared_keys: int = 0
    #: neither run left anything that looks like a checkpoint trainguard reads (no candidate,
    #: complete or not): there was no state to compare, which is not a comparison skipped
    absent: bool = False
    _described: dict[str, str] = field(default_factory=dict, repr=False)

    @property
    def ok(self) -> bool:
        """Compared, no difference, and nothing left uncompared for a read limit."""
        return self.compared and not self.differing and not self.over_limit

    @property
    def uncompared(self) -> str:
        """Why a comparison that the checkpoints on disk called for was not made (or not made
        whole): a part over a read limit, one run's checkpoint missing, torn or unreadable while
        the other left one. Empty when it was made whole, or when neither run left a checkpoint
        (:attr:`absent`). A check never passes on a skipped comparison (docs/security.md, "What
        never passes")."""
        if self.over_limit:
            return (f"{', '.join(self.over_limit[:3])} not compared: over the read limit "
                    "(setting read_max_mb / read_max_files, docs/security.md)")
        if not self.compared and not self.absent:
            return self.reason
        return ""

    def uncompared_problem(self, where: str, allowed: Iterable[str]) -> str:
        """The problem a check reports when :attr:`uncompared` is set and its spec (``where``:
        ``checks.resume``) does not allow it by name; empty otherwise."""
        if not self.uncompared or "state" in allowed:
            return ""
        return (f"the final state was not compared ({self.uncompared}), so the run cannot be called "
                f"equal; fix what stopped the comparison, or set `allow_uncompared: [state]` under "
                f"{where} to judge on the metrics alone (the report then says so)")

    def note(self, where: str) -> str:
        """What a passing check's summary says of the state: `` (state not compared: why;
        allowed by checks.resume.allow_uncompared)`` or `` (state not compared: neither run ...)``;
        empty when it was compared whole."""
        if self.uncompared:
            return f" (state not compared: {self.uncompared}; allowed by {where}.allow_uncompared)"
        if not self.compared:
            return f" (state not compared: {self.reason})"
        return ""

    def summary(self) -> str:
        """The differing state by component, in :data:`COMPONENTS` order:
        ``optimizer (12 keys: exp_avg, exp_avg_sq of 6 params), scheduler (last_epoch)``."""
        parts = [f"{c} ({self._described.get(c) or len(self.by_component[c])})"
                 for c in COMPONENTS if self.by_component.get(c)]
        if self.over_limit:
            parts.append(f"{', '.join(self.over_limit[:3])} (not compared: over the read limit, "
                         "docs/security.md)")
        return ", ".join(parts)

    def as_evidence(self) -> StateEvidence:
        evidence = StateEvidence(
            self.compared, self.reason, list(self.files) if self.files else None, self.compared_keys,
            [k for k, _ in self.differing][:50], [f"{k}: {what}" for k, what in self.differing][:20],
            {c: keys[:20] for c, keys in self.by_component.items()}, self.summary(), self.uncompared)
        if self.metadata_differing:
            evidence.metadata_differing = self.metadata_differing[:20]
        if self.skipped:
            evidence.skipped = self.skipped
        if self.over_limit:
            evidence.over_limit = self.over_limit
        return evidence


@dataclass
class StateEvidence(Evidence):
    """Two final checkpoints compared, in the report (:meth:`StateComparison.as_evidence`)."""

    compared: bool
    reason: str
    files: list[str] | None
    compared_keys: int
    #: the first 50 keys that differ, and the first 20 with what differs
    differing_keys: list[str]
    differences: list[str]
    #: component -> its first 20 differing keys
    by_component: dict[str, list[str]]
    summary: str
    #: what a read limit left uncompared, in words ("" when nothing)
    uncompared: str
    metadata_differing: list[str] | Unset = UNSET
    skipped: dict[str, str] | Unset = UNSET
    over_limit: list[str] | Unset = UNSET


def _entries(path: Path, roots: tuple[str, ...]) -> tuple[dict[str, Entry], CheckpointContents]:
    contents = read_checkpoint(path)
    entries: dict[str, Entry] = {}
    for flat in flatten_parts(contents, roots).values():
        for entry in flat:
            entries[entry.key] = entry
    return entries, contents


def _roots(*dirs: Path) -> tuple[str, ...]:
    """The directories whose appearance in a string value makes it a path: the two checkpoint
    directories and the run directories around them."""
    roots = {str(d.resolve()) for d in dirs} | {str(d.resolve().parent) for d in dirs}
    return tuple(sorted(r for r in roots if len(r) > 1))


def compare_checkpoint_dirs(
    actual_dir: Path,
    expected_dir: Path,
    *,
    rtol: float = 0.0,
    atol: float = 0.0,
    labels: tuple[str, str] = ("resumed", "reference"),
) -> StateComparison:
    """Compare the newest complete checkpoint under ``actual_dir`` with the same-named one under
    ``expected_dir`` (else its newest), every file of it, value by value.

    Directories (Hugging Face ``checkpoint-N``, DCP, several files) compare file by file; files
    that cannot be read safely (``training_args.bin``) are skipped by name and the rest still
    compared. Paths and times go to ``metadata_differing``, never to ``differing``."""
    actual_dir, expected_dir = Path(actual_dir), Path(expected_dir)
    actual = resolve_checkpoint(actual_dir)
    if actual is None:
        # actual_dir resolved to nothing: only an incomplete candidate could be there
        if not checkpoint_candidates(actual_dir) and not _anything_like_a_checkpoint(expected_dir):
            return StateComparison(False, "neither run left a checkpoint trainguard reads (the "
                                   f"{labels[0]} run's directory: {describe_candidates(actual_dir)})", absent=True)
        return StateComparison(False, f"the {labels[0]} run left no complete checkpoint to compare "
                               f"({describe_candidates(actual_dir)})")
    expected = _expected_checkpoint(actual, actual_dir, expected_dir)
    if expected is None:
        return StateComparison(False, f"the {labels[1]} run left no complete checkpoint to compare "
                               f"({describe_candidates(expected_dir)})")
    files = (str(actual), str(expected))
    roots = _roots(actual_dir, expected_dir)
    a_entries, a_contents = _entries(actual, roots)
    e_entries, e_contents = _entries(expected, roots)
    a_files, e_files = a_contents.files, e_contents.files
    skipped = {**e_contents.skipped, **a_contents.skipped}
    over_limit = sorted(set(a_contents.over_limit) | set(e_contents.over_limit))
    if not a_files or not e_files:
        which = labels[0] if not a_files else labels[1]
        return StateComparison(False, f"nothing in the {which} run's checkpoint could be read safely ("
                               + "; ".join(f"{k}: {v}" for k, v in skipped.items()) + ")",
                               files, skipped=skipped, over_limit=over_limit)
    result = StateComparison(True, "", files, skipped=skipped, over_limit=over_limit)
    differences = _Differences(result, labels)
    differences.add_files_in_one_run(a_files, e_files)
    differences.add_entries(a_entries, e_entries, a_files, e_files, rtol=rtol, atol=atol)
    return differences.result_described()


def _anything_like_a_checkpoint(directory: Path) -> bool:
    """Whether ``directory`` is a checkpoint or holds one, complete or not (a temporary, a torn
    file, one over a limit all count)."""
    return resolve_checkpoint(directory) is not None or bool(checkpoint_candidates(directory))


def _expected_checkpoint(actual: Path, actual_dir: Path, expected_dir: Path) -> Path | None:
    """The checkpoint under ``expected_dir`` named as ``actual`` is under ``actual_dir``
    (``checkpoint-40``), else the newest complete one there; None without one."""
    if actual.is_relative_to(actual_dir) and actual != actual_dir:
        same = expected_dir / actual.relative_to(actual_dir)
        if same.exists():
            return same
    return resolve_checkpoint(expected_dir)


class _Differences:
    """What differs between two checkpoints, recorded into ``result`` as it is found: each
    differing key under its component (paths and times apart, as metadata), with its entry
    kept to describe each component's keys in the summary."""

    def __init__(self, result: StateComparison, labels: tuple[str, str]) -> None:
        self.result = result
        self.labels = labels
        self.grouped: dict[str, list[tuple[Entry, int]]] = {}

    def add(self, entry: Entry, what: str) -> None:
        """Record that ``entry`` differs, and how."""
        if entry.metadata:
            self.result.metadata_differing.append(entry.key)
            return
        component, index = classify_path(entry.part, entry.segments)
        self.result.differing.append((entry.key, what))
        self.result.by_component.setdefault(component, []).append(entry.key)
        self.grouped.setdefault(component, []).append((entry, index))

    def add_files_in_one_run(self, a_files: list[str], e_files: list[str]) -> None:
        """The files one checkpoint holds and the other does not."""
        for part in sorted(set(a_files) ^ set(e_files)):
            if part in self.result.over_limit:
                continue  # not read in one run: over the limit, said apart (never equal, never a difference)
            only = self.labels[0] if part in a_files else self.labels[1]
            self.add(Entry(part, (), None), f"file only in the {only} run's checkpoint")

    def add_entries(self, a_entries: dict[str, Entry], e_entries: dict[str, Entry], a_files: list[str],
                    e_files: list[str], *, rtol: float, atol: float) -> None:
        """Every key of the expected checkpoint against the actual one's (metadata exactly, state
        within ``rtol``/``atol``), then the keys only the actual one holds. A key of a file the
        other checkpoint lacks (or did not read) is not reported again: the file is."""
        from trainguard.unit.equivalence import tree_differences

        labels = self.labels
        for key, e_entry in e_entries.items():
            a_entry = a_entries.get(key)
            if a_entry is None:
                if e_entry.part in a_files:
                    self.add(e_entry, f"missing in {labels[0]}")
                continue
            if a_entry.metadata or e_entry.metadata:
                if tree_differences(a_entry.value, e_entry.value, rtol=0.0, atol=0.0, labels=labels):
                    self.result.metadata_differing.append(key)
                continue
            self.result.compared_keys += 1
            for _, what in tree_differences(a_entry.value, e_entry.value, rtol=rtol, atol=atol, labels=labels):
                self.add(a_entry, what)
        for key, a_entry in a_entries.items():
            if key not in e_entries and a_entry.part in e_files:
                self.add(a_entry, f"only in {labels[0]}, not in {labels[1]}")

    def result_described(self) -> StateComparison:
        """The result, with each component's differing keys described for its summary."""
        self.result._described = {c: describe_keys(c, entries) for c, entries in self.grouped.items()}
        return self.result


# --------------------------------------------------------------------------------------------
# Layout: which keys a checkpoint holds and each tensor's shape, not the values
# --------------------------------------------------------------------------------------------

_INDEX = re.compile(r"(?<=[.:])\d+(?=\.|$)")


@dataclass
class LayoutDifference:
    """How two checkpoints' layouts differ: keys one holds and the other does not, tensors whose
    shape or dtype changed, and the renames that explain a pair of those (same shape, same last
    name). A tensor key is kept whole (``layers.3.weight``); any other key has its list
    positions folded (``log_history.*.loss``), so a longer history is no difference."""

    compared: bool
    reason: str = ""
    files: tuple[str, str] | None = None
    only_in_old: list[str] = field(default_factory=list)
    only_in_new: list[str] = field(default_factory=list)
    #: (key, old shape/dtype, new shape/dtype)
    changed: list[tuple[str, str, str]] = field(default_factory=list)
    #: (old prefix, new prefix): ``model.fc1`` -> ``model.encoder``
    renamed: list[tuple[str, str]] = field(default_factory=list)

    @property
    def same(self) -> bool:
        return not (self.only_in_old or self.only_in_new or self.changed)

    def summary(self, old: str = "base", new: str = "current") -> str:
        """``renamed model.fc1 -> model.encoder; only in base: ...; only in current: ...``."""
        words = [f"renamed {a} -> {b}" for a, b in self.renamed[:3]]
        renamed = {k for a, b in self.renamed for k in self.only_in_old + self.only_in_new
                   if _INDEX.sub("*", k).startswith((a + ".", b + "."))}
        for label, keys in ((f"only in {old}'s checkpoint", self.only_in_old),
                            (f"only in {new}'s", self.only_in_new)):
            rest = [k for k in keys if k not in renamed]
            if rest:
                words.append(f"{label}: {', '.join(rest[:4])}" + (f" (+{len(rest) - 4})" if len(rest) > 4 else ""))
        words += [f"{k} changed from {a} to {b}" for k, a, b in self.changed[:3]]
        return "; ".join(words)

    def as_evidence(self) -> LayoutEvidence:
        return LayoutEvidence(
            self.compared, self.reason, list(self.files) if self.files else None, self.only_in_old[:50],
            self.only_in_new[:50], [list(c) for c in self.changed[:50]], [list(r) for r in self.renamed[:20]],
            self.summary())


@dataclass
class LayoutEvidence(Evidence):
    """Two checkpoints' layouts compared, in the report (:meth:`LayoutDifference.as_evidence`)."""

    compared: bool
    reason: str
    files: list[str] | None
    only_in_old: list[str]
    only_in_new: list[str]
    #: [key, old, new] for the first 50 keys whose shape or dtype changed
    changed: list[list[str]]
    #: [old key, new key] for the first 20 renamed
    renamed: list[list[str]]
    summary: str


def _layout(entries: dict[str, Entry]) -> dict[str, str]:
    out: dict[str, str] = {}
    for key, entry in entries.items():
        if entry.metadata:
            continue
        shape = getattr(entry.value, "shape", None)
        if shape is not None and hasattr(entry.value, "dtype"):
            out[key] = f"{list(shape)} {str(entry.value.dtype).removeprefix('torch.')}"
        else:
            out.setdefault(_INDEX.sub("*", key), "")
    return out


def _shared_head(a: str, b: str) -> int:
    count = 0
    for x, y in zip(a.split("."), b.split("."), strict=False):
        if x != y:
            break
        count += 1
    return count


def _renames(old: list[str], new: list[str], old_layout: dict[str, str], new_layout: dict[str, str]) -> list[tuple[str, str]]:
    """Prefix pairs whose keys match by last name and shape (of several such keys, the one at the
    same place in the tree: ``h.0.mlp.c_fc`` pairs with ``h.0.mlp.fc_in``), layer numbers folded
    (``h.*.mlp.c_fc -> h.*.mlp.fc_in``)."""
    found: dict[tuple[str, str], int] = {}
    for key in old:
        head, _, last = key.rpartition(".")
        twins = [k for k in new if k.rpartition(".")[2] == last and new_layout[k] == old_layout[key] and old_layout[key]]
        if not head or not twins:
            continue
        best = max(_shared_head(key, t) for t in twins)
        nearest = [t for t in twins if _shared_head(key, t) == best]
        if len(nearest) == 1 and (other := nearest[0].rpartition(".")[0]) and other != head:
            pair = (_INDEX.sub("*", head), _INDEX.sub("*", other))
            found[pair] = found.get(pair, 0) + 1
    return sorted(found, key=lambda pair: -found[pair])


def compare_layouts(old_dir: Path, new_dir: Path) -> LayoutDifference:
    """The layout of the newest complete checkpoint under ``old_dir`` against the one under
    ``new_dir`` (names and shapes, not values): what a ``load_state_dict`` of the old one by
    the new code would call missing, unexpected or a size mismatch."""
    old, new = resolve_checkpoint(Path(old_dir)), resolve_checkpoint(Path(new_dir))
    if old is None or new is None:
        which = old_dir if old is None else new_dir
        return LayoutDifference(False, f"no complete checkpoint under {which}")
    roots = _roots(Path(old_dir), Path(new_dir))
    (old_entries, old_contents), (new_entries, new_contents) = _entries(old, roots), _entries(new, roots)
    result = LayoutDifference(True, files=(str(old), str(new)))
    if not old_contents.files or not new_contents.files:
        result.compared, result.reason = False, "nothing of one checkpoint could be read safely"
        return result
    a, b = _layout(old_entries), _layout(new_entries)
    result.only_in_old = sorted(k for k in a if k not in b)
    result.only_in_new = sorted(k for k in b if k not in a)
    result.changed = [(k, a[k], b[k]) for k in sorted(a) if k in b and a[k] != b[k]]
    result.renamed = _renames(result.only_in_old, result.only_in_new, a, b)
    return result
