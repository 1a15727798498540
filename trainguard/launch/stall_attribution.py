"""Which rank hung, doing what: the attribution of a stall, from evidence.

When the launcher calls a run hung (no metric line for the stall limit), it asks every rank's
agent for its answer (``_trainguard_stall_agent``: the Flight Recorder's collectives per process
group, the main thread's stack) by creating a trigger file, samples each rank's state and CPU,
dumps each rank's stack with py-spy, then reads the answers that came within
:data:`ANSWER_WINDOW_S` of the ask. From them:

* each rank is **in a collective** (its Flight Recorder has a collective enqueued and not
  completed; or, without an answer, a ``torch.distributed`` collective on its stack) or **not**
  (its Flight Recorder's collectives all completed; or its stack shows none);
* a **collective mismatch**: ranks that wait at the same sequence number of one process group in
  different collectives (another op, or other sizes). The rank whose call breaks the order every
  rank followed before (the shared history says which call comes after the last common one) is
  the culprit; a call the history places one later is "one collective fewer" (it skipped one);
* a rank that **did not answer** is named from its silence and its stack: stopped (SIGSTOP,
  its process state) or holding the GIL (py-spy sees it active with the GIL, the agent's thread
  never ran).

The culprits: the mismatch's odd rank, else the ranks not in a collective (or stopped) while
others wait in one. No rank in a collective, none stopped: no culprit (a stall every rank shares
is not one rank's). Inputs are text and JSON the ranks wrote: nothing here runs their code.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import sys
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from trainguard._internal.readers import OverLimit, ReadLimits, open_regular, read_json
from trainguard.launch.hang_evidence import RankActivity

__all__ = [
    "ANSWER_WINDOW_S",
    "Collective",
    "Frame",
    "LoaderWait",
    "Mismatch",
    "RankAnswer",
    "RankFinding",
    "RankSignals",
    "StallAttribution",
    "ask_ranks",
    "attribute",
    "attribution_words",
    "collect_signals",
    "parse_flight_recorder",
    "parse_py_spy",
    "signals_from",
]

#: how long after the ask the launcher waits for the ranks' answers, at most (a stopped or a
#: GIL-holding rank never answers; a rank known stopped or gone is not waited for)
ANSWER_WINDOW_S = 0.8
#: an answer file bigger than this is not read (a Flight Recorder of 2,000 entries is ~2 MB)
_MAX_ANSWER_BYTES = 16 * 2**20
#: torch.distributed functions that block in a collective (a rank's stack inside one waits)
_COLLECTIVE_FUNCS = frozenset({
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "all_to_all",
    "all_to_all_single", "barrier", "monitored_barrier", "broadcast", "broadcast_object_list",
    "reduce", "reduce_scatter", "reduce_scatter_tensor", "gather", "gather_object", "scatter",
    "scatter_object_list", "send", "recv", "wait",
})
#: installed packages a job's stack passes through (a py-spy path that starts with one is no job code)
_PACKAGES = frozenset({"torch", "numpy", "transformers", "accelerate", "datasets", "lightning",
                       "pytorch_lightning", "deepspeed", "ray", "torchdata", "safetensors"})
#: where DDP's gradient all-reduce is waited for, seen from Python
_BACKWARD_FUNCS = frozenset({"_engine_run_backward", "run_backward"})
_THREAD = re.compile(r"^Thread (\S+) \(([^)]*)\)(?::\s*\"(.*)\")?")
_FRAME = re.compile(r"^\s{4}(\S.*?) \((.*):(\d+)\)\s*$")


@dataclass(frozen=True)
class Frame:
    """One Python frame: function, file, line."""

    function: str
    file: str
    line: int

    @property
    def where(self) -> str:
        return f"`{self.function}` of {os.path.basename(self.file)}:{self.line}"

    @property
    def library(self) -> bool:
        """In the standard library or an installed package (not the job's own code); a path
        py-spy shortened is judged by its top-level name."""
        if os.path.isabs(self.file):
            return any(part in self.file for part in ("site-packages", "dist-packages", "/lib/python3"))
        top = self.file.replace(os.sep, "/").split("/")[0].removesuffix(".py")
        return self.file.startswith("<frozen") or top in sys.stdlib_module_names or top in _PACKAGES


@dataclass(frozen=True)
class Collective:
    """One collective of a rank's Flight Recorder."""

    group: str
    seq: int
    op: str
    sizes: str
    completed: bool
    #: when the rank enqueued it (ns; orders the calls of different groups)
    created_ns: int = 0

    @property
    def signature(self) -> tuple[str, str, str]:
        return self.group, self.op, self.sizes

    def describe(self) -> str:
        return f"{self.op} #{self.seq} of {self.group}"

    def short(self) -> str:
        group = "" if self.group == "the default group" else f" of {self.group}"
        return f"{self.op} #{self.seq}{group} {self.sizes}{'' if self.completed else ' (waiting)'}"


@dataclass(frozen=True)
class LoaderWait:
    """A DataLoader iterator on the main thread waiting for one worker's batch."""

    worker: int
    pid: int | None
    batch: int


@dataclass(frozen=True)
class RankSignals:
    """What was observed of one rank at the stall."""

    rank: int
    #: its process state (psutil: "stopped", "sleeping", "running", "gone")
    state: str | None = None
    cpu_percent: float | None = None
    #: the main thread's frames, outermost first (py-spy's, else the agent's)
    stack: tuple[Frame, ...] = ()
    #: py-spy saw the main thread active and holding the GIL
    holds_gil: bool = False
    #: the agent answered the ask within the window
    answered: bool = False
    #: the Flight Recorder's collectives (empty with ``fr_error`` or without an answer)
    calls: tuple[Collective, ...] = ()
    fr_error: str = ""
    last_step: int | None = None
    loader: LoaderWait | None = None


@dataclass(frozen=True)
class RankFinding:
    """What one rank was doing at the stall, and what says so."""

    rank: int
    #: True: waits in a collective; False: not in one; None: not known
    in_collective: bool | None
    doing: str
    evidence: tuple[str, ...]
    waits_in: Collective | None = None
    last_step: int | None = None


@dataclass(frozen=True)
class Mismatch:
    """Ranks that wait at the same place of one process group in different collectives."""

    group: str
    seq: int
    #: "fewer" (the odd rank skipped one) or "different" (it called another collective)
    kind: str
    culprits: tuple[int, ...]
    #: each rank's last calls in the group, ending with the one it waits in
    sequences: tuple[tuple[int, tuple[str, ...]], ...]
    text: str


@dataclass(frozen=True)
class StallAttribution:
    """The culprit rank(s) of a stall and what each rank was doing."""

    culprits: tuple[int, ...]
    summary: str
    ranks: tuple[RankFinding, ...]
    mismatch: Mismatch | None = None
    #: seconds the attribution added after the stall's detection (the wait for answers beyond
    #: the stack dump, and the reading)
    took_s: float = 0.0
    answered: tuple[int, ...] = ()
    #: seconds from the ask (right after the stall's detection) to the attribution's end: the
    #: rank state sample (0.5 s) and the stack dump, which ran before, included
    since_ask_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (lists, not tuples), for a run's evidence (``attribution``)."""
        evidence: dict[str, Any] = json.loads(json.dumps(asdict(self)))
        return evidence


@dataclass(frozen=True)
class RankAnswer:
    """What a rank's agent wrote when asked (``_trainguard_stall_agent``)."""

    calls: tuple[Collective, ...] = ()
    #: why there are no calls (no Flight Recorder, unreadable); "" when read
    fr_error: str = ""
    #: the main thread's frames, outermost first, full paths
    stack: tuple[Frame, ...] = ()
    loader: LoaderWait | None = None

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RankAnswer:
        """Read an answer's JSON (any shape: what does not fit is left out or named)."""
        calls: tuple[Collective, ...] = ()
        fr, fr_error = data.get("fr"), ""
        if isinstance(fr, dict):
            try:
                calls = parse_flight_recorder(fr)
            except (TypeError, ValueError, AttributeError, IndexError) as exc:
                fr_error = f"unreadable Flight Recorder dump ({type(exc).__name__}: {exc})"
        else:
            fr_error = str(data.get("fr_error") or "no Flight Recorder dump")
        stack = tuple(Frame(str(f[0]), str(f[1]), int(f[2])) for f in data.get("main_stack") or []
                      if isinstance(f, list) and len(f) == 3)
        wait, loader = data.get("dataloader"), None
        if isinstance(wait, dict) and isinstance(wait.get("worker"), int):
            pid = wait.get("pid")
            loader = LoaderWait(wait["worker"], pid if isinstance(pid, int) else None, int(wait.get("batch", -1)))
        return cls(calls, fr_error, stack, loader)


def attribution_words(found: object, form: str = "{}") -> str:
    """The summary of an attribution (a run's ``evidence["attribution"]``) put in ``form``; ""
    without one."""
    summary = found.get("summary") if isinstance(found, dict) else None
    return form.format(summary) if isinstance(summary, str) and summary else ""


# -- parsing -----------------------------------------------------------------------------------


def parse_py_spy(text: str) -> tuple[tuple[Frame, ...], bool]:
    """The main thread's frames (outermost first) of a ``py-spy dump``, and whether it held the
    GIL. The main thread is the one named "MainThread", else the first."""
    blocks: list[tuple[str, str, list[Frame]]] = []
    for line in text.splitlines():
        head = _THREAD.match(line)
        if head is not None:
            blocks.append((head.group(3) or "", head.group(2), []))
            continue
        frame = _FRAME.match(line)
        if frame is not None and blocks:
            blocks[-1][2].append(Frame(frame.group(1), frame.group(2), int(frame.group(3))))
    if not blocks:
        return (), False
    _name, status, frames = next((b for b in blocks if b[0] == "MainThread"), blocks[0])
    return tuple(reversed(frames)), "gil" in status


def parse_flight_recorder(fr: Any) -> tuple[Collective, ...]:
    """The collectives of one ``_dump_fr_trace_json`` dump, in the order the rank enqueued them. A
    collective is completed when the recorder retired it or its group's ``last_completed``
    reached it."""
    status = fr.get("pg_status") or {}
    calls = []
    for entry in fr.get("entries") or []:
        if not isinstance(entry, dict):
            continue
        pg_id = str(entry.get("pg_id", ""))
        names = entry.get("process_group") or ["", ""]
        desc = str(names[1]) if len(names) > 1 and names[1] not in ("", "undefined") else ""
        name = str(names[0]) if names else pg_id
        group = "the default group" if desc == "default_pg" or (not desc and name in ("0", "")) else f"group {desc or name}"
        p2p = bool(entry.get("is_p2p"))
        seq = int(entry.get("p2p_seq_id" if p2p else "collective_seq_id") or 0)
        op = str(entry.get("profiling_name") or "?").split(":")[-1]
        try:
            last_done = int((status.get(pg_id) or {}).get("last_completed_collective", -1))
        except (TypeError, ValueError):
            last_done = -1
        done = bool(entry.get("retired")) or (not p2p and seq <= last_done)
        sizes = json.dumps(entry.get("input_sizes"), separators=(",", ":"))
        calls.append(Collective(group, seq, op, sizes, done, int(entry.get("time_created_ns") or 0)))
    return tuple(sorted(calls, key=lambda c: c.created_ns))


# -- asking and gathering ----------------------------------------------------------------------


def ask_ranks(stall_dir: Path) -> float:
    """Create the trigger file the ranks' agents wait for; the time of the ask (monotonic)."""
    with contextlib.suppress(OSError):
        stall_dir.mkdir(parents=True, exist_ok=True)
        (stall_dir / "trigger").touch()
    return time.monotonic()


def _read_answer(path: Path) -> RankAnswer | None:
    """A rank's answer: a regular file within the limit, never a FIFO or a link out of its folder."""
    try:
        data = read_json(path, ReadLimits(max_bytes=_MAX_ANSWER_BYTES), root=path.parent)
    except OverLimit:
        return RankAnswer(fr_error=f"its answer {path} is over {_MAX_ANSWER_BYTES >> 20} MB: not read")
    except (OSError, ValueError):
        return None
    return RankAnswer.from_dict(data) if isinstance(data, dict) else None


def collect_signals(stall_dir: Path, asked_at: float, activity: Sequence[RankActivity],
                    stacks: Mapping[str, str], last_steps: Mapping[int, int],
                    window_s: float = ANSWER_WINDOW_S) -> list[RankSignals]:
    """Each rank's signals: its answer (waited for until ``asked_at + window_s``, except from a
    rank that is stopped or gone, or whose agent never said it is there: a process that did not
    import ``torch.distributed``), its state and CPU (``activity``), its py-spy stack."""
    states = {int(a["rank"]): a for a in activity}
    pending = {r for r, a in states.items() if a.get("state") not in ("stopped", "gone", "zombie")
               and (stall_dir / f"rank{r}.ready").exists()}  # its agent waits for the ask
    answers: dict[int, RankAnswer] = {}
    while True:
        for rank in sorted(pending):
            found = _read_answer(stall_dir / f"rank{rank}.json")
            if found is not None:
                answers[rank] = found
                pending.discard(rank)
        if not pending or time.monotonic() - asked_at >= window_s:
            break
        time.sleep(0.02)
    for rank in states.keys() - answers.keys():  # a stopped rank answered before it stopped?
        found = _read_answer(stall_dir / f"rank{rank}.json")
        if found is not None:
            answers[rank] = found
    return signals_from(activity, answers, stacks, last_steps)


def signals_from(activity: Sequence[RankActivity], answers: Mapping[int, RankAnswer],
                 stacks: Mapping[str, str], last_steps: Mapping[int, int]) -> list[RankSignals]:
    """Each rank's signals from what was gathered: ``activity`` (the launcher's ``ranks``
    evidence), the answers that came, by rank, the py-spy stacks by rank (text)."""
    found = [_signals(int(a["rank"]), a, answers.get(int(a["rank"])), stacks.get(str(a["rank"]), ""),
                      last_steps.get(int(a["rank"]))) for a in sorted(activity, key=lambda a: int(a["rank"]))]
    return _full_paths(found)


def _full_paths(signals: list[RankSignals]) -> list[RankSignals]:
    """py-spy's frames with the full path of the same file in another rank's answer (py-spy
    shortens paths to their ``sys.path`` entry; every rank runs the same code)."""
    known = {f.file for s in signals if s.answered for f in s.stack if os.path.isabs(f.file)}

    def full(frame: Frame) -> Frame:
        if os.path.isabs(frame.file):
            return frame
        match = next((k for k in known if k.endswith(os.sep + frame.file)), None)
        return Frame(frame.function, match, frame.line) if match else frame

    return [s if s.answered else replace(s, stack=tuple(full(f) for f in s.stack)) for s in signals]


def _signals(rank: int, activity: RankActivity, answer: RankAnswer | None, stack_text: str,
             last_step: int | None) -> RankSignals:
    frames, gil = parse_py_spy(stack_text)
    cpu = activity.get("cpu_percent")
    return RankSignals(rank=rank, state=activity.get("state"), cpu_percent=cpu,
                       # the agent's frames carry full paths (py-spy's are shortened)
                       stack=(answer.stack if answer is not None else ()) or frames, holds_gil=gil,
                       answered=answer is not None, calls=answer.calls if answer is not None else (),
                       fr_error=answer.fr_error if answer is not None else "", last_step=last_step,
                       loader=answer.loader if answer is not None else None)


# -- the analysis ------------------------------------------------------------------------------


def _source_line(frame: Frame) -> str:
    """The line ``frame`` is at, from its file (bounded read), or ""."""
    try:  # a regular file within 4 MiB (a stack may name anything: a FIFO is not waited on)
        with open_regular(Path(frame.file), ReadLimits(max_bytes=4 * 2**20)) as handle:
            for number, raw in enumerate(handle, start=1):
                if number == frame.line:
                    return raw.decode("utf-8", errors="replace").strip()[:120]
    except (OSError, ValueError):
        pass
    return ""


def _where(stack: Sequence[Frame]) -> str:
    """Where the main thread is: its innermost frame, and the job's own innermost frame with its
    source line when the innermost is in a library."""
    if not stack:
        return "(no stack)"
    inner = stack[-1]
    own = next((f for f in reversed(stack) if not f.library), None)
    text = inner.where
    if own is not None and own is not inner:
        text += f", called from {own.where}"
    anchor = own or inner
    line = _source_line(anchor)
    return f"{text} (`{line}`)" if line else text


def _stack_collective(stack: Sequence[Frame], cpu_percent: float | None = None) -> Frame | None:
    """The frame of a collective the stack waits in: a ``torch.distributed`` collective, or an
    idle backward (DDP's gradient all-reduce is waited for inside ``backward``, in C++: a rank
    there with little CPU at a stall waits for it)."""
    for frame in reversed(stack):
        path = frame.file.replace(os.sep, "/")
        if frame.function in _COLLECTIVE_FUNCS and "torch/distributed" in path:
            return frame
        if (frame.function in _BACKWARD_FUNCS and "torch/autograd" in path and cpu_percent is not None
                and cpu_percent < 50):
            return frame
    return None


def _waits_in(signals: RankSignals) -> Collective | None:
    """The first collective the rank enqueued and did not complete."""
    return next((c for c in signals.calls if not c.completed), None)


def _finding(s: RankSignals) -> RankFinding:
    evidence: list[str] = []
    waits = _waits_in(s)
    in_coll: bool | None
    if s.answered and not s.fr_error:
        in_coll = waits is not None
        last = s.calls[-1].short() if s.calls else "none"
        evidence.append(f"Flight Recorder: {len(s.calls)} collective(s), last {last}")
    else:
        on_stack = _stack_collective(s.stack, s.cpu_percent)
        in_coll = True if on_stack is not None else (False if s.stack else None)
        if s.fr_error:
            evidence.append(f"Flight Recorder: {s.fr_error}")
    if s.stack:
        evidence.append(f"stack: {_where(s.stack)}")
    state = f"state {s.state}" + (f", {s.cpu_percent:g} % CPU" if s.cpu_percent is not None else "")
    evidence.append(state)
    if s.last_step is not None:
        evidence.append(f"its last step line: step {s.last_step}")
    if not s.answered:
        evidence.append(f"did not answer within {ANSWER_WINDOW_S:g} s")
    if s.state == "stopped":
        doing = f"is stopped (SIGSTOP), in {_where(s.stack)}"
    elif s.state == "gone":
        doing = "had exited"
    elif in_coll and waits is not None:
        doing = f"waits in {waits.describe()}"
    elif in_coll:
        frame = _stack_collective(s.stack, s.cpu_percent)
        doing = f"waits in a collective: in {_where(s.stack)}" if frame else "waits in a collective"
    elif s.loader is not None:
        pid = f", pid {s.loader.pid}" if s.loader.pid else ""
        doing = (f"is not in a collective: in `__next__` of its DataLoader, waiting on worker "
                 f"{s.loader.worker}{pid} for batch {s.loader.batch}")
    elif not s.answered and s.holds_gil:
        doing = f"is not in a collective: holds the GIL in a C call, in {_where(s.stack)} (it did not answer)"
    elif in_coll is False:
        doing = f"is not in a collective: in {_where(s.stack)}"
    else:
        doing = "did not answer and left no stack"
    return RankFinding(s.rank, in_coll, doing, tuple(evidence), waits, s.last_step)


Signature = tuple[str, str, str]


def _successors(timelines: Sequence[Sequence[Collective]]) -> dict[Signature, set[Signature]]:
    """Which call followed which, over the completed calls of every rank (the order the job kept
    until the stall)."""
    after: dict[Signature, set[Signature]] = {}
    for calls in timelines:
        done = [c for c in calls if c.completed]
        for a, b in itertools.pairwise(done):
            after.setdefault(a.signature, set()).add(b.signature)
    return after


def _mismatch(signals: Sequence[RankSignals]) -> Mismatch | None:
    """Ranks that wait in different collectives (another op or sizes at one place of a group, or
    in different groups): the rank whose call breaks the order every rank kept is the odd one."""
    timelines = {s.rank: s.calls for s in signals if s.answered and not s.fr_error}
    waiting = {r: w for r, calls in timelines.items() if (w := next((c for c in calls if not c.completed), None))}
    if len({(c.group, c.seq, c.signature) for c in waiting.values()}) < 2:
        return None
    after = _successors(list(timelines.values()))

    def previous(rank: int) -> Collective | None:
        done = [c for c in timelines[rank] if c.completed]
        return done[-1] if done else None

    def expected(rank: int) -> set[Signature]:
        prev = previous(rank)
        return after.get(prev.signature, set()) if prev is not None else set()

    odd = [r for r, c in waiting.items() if expected(r) and c.signature not in expected(r)]
    if not odd or len(odd) == len(waiting):
        kinds = Counter(c.signature for c in waiting.values())
        top, count = kinds.most_common(1)[0]
        odd = [r for r, c in waiting.items() if c.signature != top] if count * 2 > len(waiting) else sorted(waiting)
    odd = sorted(odd)
    normal = [c for r, c in sorted(waiting.items()) if r not in odd]
    ref = normal[0] if normal else None
    fewer = ref is not None and all(waiting[r].signature in after.get(ref.signature, set()) for r in odd)
    sequences = tuple((r, tuple(c.short() for c in [*[c for c in timelines[r] if c.completed][-3:], waiting[r]]))
                      for r in sorted(waiting))
    mine = waiting[odd[0]]
    odd_text = ", ".join(map(str, odd))
    if ref is not None and fewer:
        text = (f"collective mismatch: rank(s) {odd_text} called one {ref.op} fewer than the others: "
                f"they wait in {ref.describe()} {ref.sizes}, which rank(s) {odd_text} skipped to wait in "
                f"{mine.describe()} {mine.sizes}")
    elif ref is not None:
        text = (f"collective mismatch: rank(s) {odd_text} called another collective: {mine.describe()} "
                f"{mine.sizes} where the others wait in {ref.describe()} {ref.sizes}")
    else:
        text = "collective mismatch: " + "; ".join(f"rank {r} waits in {c.describe()} {c.sizes}"
                                                   for r, c in sorted(waiting.items()))
    seqs = "; ".join(f"rank {r}: {', '.join(items)}" for r, items in sequences)
    return Mismatch(mine.group, mine.seq, "fewer" if fewer else "different", tuple(odd), sequences,
                    f"{text}. Sequences: {seqs}")


def _ranks(ranks: Sequence[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def attribute(signals: Sequence[RankSignals], took_s: float = 0.0, since_ask_s: float = 0.0) -> StallAttribution:
    """The culprits of a stall and what every rank was doing, from ``signals``."""
    findings = tuple(_finding(s) for s in signals)
    mismatch = _mismatch(signals)
    stopped = [s.rank for s in signals if s.state == "stopped"]
    waiting = [f for f in findings if f.in_collective]
    if mismatch is not None:
        culprits = sorted({*mismatch.culprits, *stopped})
    elif waiting:
        culprits = sorted({f.rank for f in findings if not f.in_collective or f.rank in stopped})
    else:
        culprits = sorted(stopped)
    parts = [] if mismatch is None else [mismatch.text]
    for f in findings:
        if f.rank in culprits and (mismatch is None or f.rank not in mismatch.culprits):
            parts.append(f"rank {f.rank} {f.doing}")
    groups: dict[str, list[int]] = {}
    for f in waiting:
        if f.rank not in culprits:
            groups.setdefault(f.doing, []).append(f.rank)
    parts.extend(f"{_ranks(rs)} {doing.replace('waits', 'wait') if len(rs) > 1 else doing}"
                 for doing, rs in groups.items())
    if not culprits:
        parts.insert(0, "no culprit: no rank is stopped and "
                     + ("every rank waits in a collective" if waiting else "no rank waits in a collective"))
    return StallAttribution(tuple(culprits), "; ".join(parts), findings, mismatch, round(took_s, 3),
                            tuple(s.rank for s in signals if s.answered), round(since_ask_s, 3))
