"""A tracked run and what it records: :class:`RunHandle`, the live metric stream of a running
attempt (:class:`LiveMetrics`), metric rows and the loss-curve plot of a launch run.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:  # pragma: no cover
    from trainguard.launch import MetricPoint

__all__ = ["LIVE_INTERVAL_S", "LiveMetrics", "MetricSink", "RunHandle", "metric_rows", "plot_metrics"]

#: seconds between two live snapshots of a running launch (:class:`LiveMetrics`) and between two
#: system-metric samples. MLflow's sqlite store costs ~1 ms of CPU per metric row and ~10 ms per
#: request: streaming every row of every step live would take 10-20% of a core from the ranks
#: of a fast job (measured: 2 ms of writer CPU per 10 ms step), so the live view is thinned and
#: the rest is written after the attempt; at 2 s the writer still took ~0.9% of a core
LIVE_INTERVAL_S = 5.0


@dataclass
class RunHandle:
    """An MLflow run as the writer will create it; ``run_id`` is set once it exists."""

    name: str
    parent: RunHandle | None = None
    run_id: str | None = None
    failed: str | None = None
    #: set while a run's processes are alive: the writer samples system metrics into it
    sampling_since: float | None = None
    created: threading.Event = field(default_factory=threading.Event, repr=False)
    #: a session run shared by several processes (pytest-xdist workers): the JSON registry file
    #: mapping tracking URI -> run id; the first process creates the run, the others join it
    shared: str | None = None
    #: True when this process joined a shared run another process created
    joined: bool = False
    #: files the writer writes the run id into once the run exists (ranks launched before that
    #: read it from there); a handle made for a rank resolves its run id from ``id_file``
    id_files: list[Path] = field(default_factory=list, repr=False)
    id_file: Path | None = None
    #: per attempt: (attempt, metric points), for the loss-curve plot of a launch run
    history: list[tuple[int, list[MetricPoint]]] = field(default_factory=list, repr=False)
    #: the live metric stream of the attempt running now (see :class:`LiveMetrics`)
    live: LiveMetrics | None = field(default=None, repr=False)



class MetricSink(Protocol):
    """Where :class:`LiveMetrics` sends its rows (a :class:`~trainguard.tracking.Tracker`)."""

    def log_metrics(self, handle: RunHandle, metrics: Sequence[tuple[str, float, int, int]]) -> None:
        """Enqueue ``(key, value, step, timestamp_ms)`` rows for ``handle``'s run."""


class LiveMetrics:
    """Streams a running attempt's metrics into its launch run (an ``on_metric`` callback of the
    launcher): every ``interval`` seconds, for each metric, the mean over the ranks of the
    latest step every rank has printed. MLflow's store costs about 1 ms of CPU per row, so the
    live view is thinned to keep the writer's CPU well under 1% of a core; after the attempt
    :func:`~trainguard.tracking.log_attempt` logs every row not streamed (the other steps, the per-rank rows), so the
    record is complete and no row is logged twice."""

    def __init__(self, tracker: MetricSink, handle: RunHandle, world_size: int,
                 interval: float | None = None) -> None:
        self.tracker = tracker
        self.handle = handle
        self.world_size = world_size
        self.interval = LIVE_INTERVAL_S if interval is None else interval
        self.sent: set[tuple[str, int]] = set()
        self._pending: dict[tuple[str, int], dict[int, float]] = {}
        self._latest: dict[str, tuple[float, int]] = {}  # name -> (mean, step) not sent yet
        self._next = time.monotonic() + self.interval

    def on_metric(self, point: MetricPoint, launcher: Any) -> None:
        key = (point.name, point.step)
        if key in self.sent:
            return
        ranks = self._pending.setdefault(key, {})
        ranks.setdefault(point.rank, point.value)
        if len(ranks) >= self.world_size:
            del self._pending[key]
            latest = self._latest.get(point.name)
            if latest is None or point.step >= latest[1]:
                self._latest[point.name] = (sum(ranks.values()) / len(ranks), point.step)
        now = time.monotonic()
        if now >= self._next and self._latest:
            self._next = now + self.interval
            now_ms = int(time.time() * 1000)
            rows = [(name, mean, step, now_ms) for name, (mean, step) in self._latest.items()]
            self.sent.update((name, step) for name, _, step, _ in rows)
            self._latest.clear()
            self.tracker.log_metrics(self.handle, rows)



def plot_metrics(
    history: Sequence[tuple[int, Sequence[MetricPoint]]], world_size: int, target: Path, *, title: str = ""
) -> Path | None:
    """Draw the loss curve(s) of a launch run into ``target`` (PNG): one panel per metric whose
    name contains ``loss`` (else the first metric), one line per attempt (and per rank when
    several). Returns None when there is nothing to draw. matplotlib is imported here (the
    writer thread calls it), through its object API: no pyplot, no global backend switch."""
    names = sorted({p.name for _, points in history for p in points})
    if not names:
        return None
    shown = [n for n in names if "loss" in n.lower()][:4] or names[:1]
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(7, 3.2 * len(shown)), dpi=100)
    FigureCanvasAgg(fig)
    for i, name in enumerate(shown):
        ax = fig.add_subplot(len(shown), 1, i + 1)
        for n, (attempt, points) in enumerate(history):
            by_rank: dict[int, dict[int, float]] = {}
            for p in points:
                if p.name == name:
                    by_rank.setdefault(p.rank, {})[p.step] = p.value
            for rank, values in sorted(by_rank.items()):
                steps = sorted(values)
                label = f"attempt {attempt}" + (f" rank {rank}" if world_size > 1 else "")
                # a colour per rank, a line style per attempt: a restarted attempt that re-runs
                # steps stays visible next to the one before it
                ax.plot(steps, [values[s] for s in steps], color=f"C{rank % 10}",
                        linestyle=("-", "--", ":", "-.")[(len(history) - 1 - n) % 4],
                        marker="." if len(steps) < 50 else None, linewidth=1.2, alpha=0.9, label=label)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("step")
        ax.set_ylabel(name)
        ax.grid(True, alpha=0.3)
        if len(history) > 1 or world_size > 1:
            ax.legend(fontsize="small")
    if title:
        fig.suptitle(title)
    # fixed margins, not tight_layout (which draws the figure once more to measure it: a third of
    # the plot's time, in the writer thread of every launch)
    height = 3.2 * len(shown)
    fig.subplots_adjust(left=0.11, right=0.97, bottom=0.55 / height, top=1 - (0.5 if title else 0.25) / height,
                        hspace=0.35)
    target.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(target)
    return target


def metric_rows(points: Sequence[MetricPoint], world_size: int, started_ms: int) -> list[tuple[str, float, int, int]]:
    """``(key, value, step, timestamp_ms)`` rows: ``name`` is the mean over the ranks that
    reported the step; with several ranks also ``name/rank{r}``."""
    per: dict[tuple[str, int], dict[int, MetricPoint]] = {}
    for p in points:
        per.setdefault((p.name, p.step), {})[p.rank] = p  # a re-run step's latest value wins
    rows: list[tuple[str, float, int, int]] = []
    for (name, step), ranks in per.items():
        latest = max(p.t for p in ranks.values())
        rows.append((name, sum(p.value for p in ranks.values()) / len(ranks), step, started_ms + int(latest * 1000)))
        if world_size > 1:
            rows.extend((f"{name}/rank{r}", p.value, step, started_ms + int(p.t * 1000)) for r, p in sorted(ranks.items()))
    return rows
