"""Profile a training loop that runs in this process, with ``torch.profiler``.

A launched job tells trainguard its step times by printing them; a loop called from a test does
not print anything. ``profile_loop(train_one_epoch, model, loader, opt)`` runs the user's own
function unchanged under ``torch.profiler`` and reads the events every ``DataLoader`` iterator
records for each ``__next__`` call (``enumerate(DataLoader)#...__next__``):

* a step is the time from one batch request to the next, so step times need no hook in the loop;
* the time inside ``__next__`` is the time the loop waited for its input: the input-pipeline
  stall share is that time over the step time.

The function must draw its batches from a ``torch.utils.data.DataLoader`` (any iterator of
batches works if it is wrapped in one). See docs/profiling.md, "In-process loops".
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import psutil

from trainguard.profiling.stats import StepStats, step_stats

__all__ = ["InputStalled", "LoopProfile", "profile_loop"]

#: the prefix torch.utils.data.DataLoader gives its per-batch profiler ranges
DATALOADER_EVENT = "enumerate(DataLoader)#"


class InputStalled(AssertionError):
    """The loop waited for its input longer than allowed."""


@dataclass
class LoopProfile:
    """What :func:`profile_loop` measured. Times in seconds."""

    batches: int
    step: StepStats | None
    data_wait_share: float | None
    data_wait_p50_s: float | None
    wall_s: float
    peak_rss_mb: float
    peak_gpu_mb: float | None = None
    samples_per_step: int | None = None
    source: str = "torch.profiler"
    notes: list[str] = field(default_factory=list)

    @property
    def throughput_sps(self) -> float | None:
        if self.step is None or not self.samples_per_step or self.step.mean_s <= 0:
            return None
        return self.samples_per_step / self.step.mean_s

    def to_dict(self) -> dict[str, Any]:
        return {
            "batches": self.batches, "step": self.step.to_dict() if self.step else None,
            "data_wait_share": self.data_wait_share, "data_wait_p50_s": self.data_wait_p50_s,
            "wall_s": self.wall_s, "peak_rss_mb": self.peak_rss_mb, "peak_gpu_mb": self.peak_gpu_mb,
            "samples_per_step": self.samples_per_step, "throughput_sps": self.throughput_sps,
            "source": self.source, "notes": list(self.notes),
        }

    def describe(self) -> str:
        """One line: step time, throughput, input stall share."""
        if self.step is None:
            return f"{self.batches} batch(es): too few to time (need warm-up + 2)"
        parts = [f"{self.step.count} steps timed, p50 {self.step.p50_s * 1000:.1f} ms "
                 f"(p90 {self.step.p90_s * 1000:.1f}, p99 {self.step.p99_s * 1000:.1f})"]
        if self.throughput_sps is not None:
            parts.append(f"{self.throughput_sps:.0f} samples/s")
        if self.data_wait_share is not None:
            parts.append(f"waiting for input {self.data_wait_share:.0%} of the step time")
        return ", ".join(parts)

    def assert_input_not_stalled(self, max_share: float = 0.2) -> None:
        """Fail when the loop spent more than ``max_share`` of its step time waiting for batches."""
        if self.data_wait_share is None:
            raise AssertionError(f"no input wait measured: {self.describe()}")
        if self.data_wait_share > max_share:
            raise InputStalled(
                f"input pipeline stall: the loop waited for its batches {self.data_wait_share:.0%} of "
                f"the step time (limit {max_share:.0%}; p50 wait {self.data_wait_p50_s * 1000:.1f} ms "  # type: ignore[operator]
                f"per step of p50 {self.step.p50_s * 1000:.1f} ms). Likely causes: too few DataLoader "  # type: ignore[union-attr]
                "workers, slow decoding/augmentation in __getitem__ or collate_fn, no pin_memory/prefetch")

    def assert_throughput(self, min_samples_per_s: float) -> None:
        """Fail when the measured throughput is below ``min_samples_per_s``."""
        if self.throughput_sps is None:
            raise AssertionError("no throughput: pass samples_per_step= to profile_loop")
        if self.throughput_sps < min_samples_per_s:
            raise AssertionError(f"throughput {self.throughput_sps:.1f} samples/s < {min_samples_per_s:g}: "
                                 f"{self.describe()}")


def _rss_mb() -> float:
    try:
        proc = psutil.Process(os.getpid())
        total = proc.memory_info().rss
        for child in proc.children(recursive=True):  # DataLoader workers
            with contextlib.suppress(psutil.Error):
                total += child.memory_info().rss
        return total / 2**20
    except psutil.Error:
        return 0.0


def profile_loop(
    fn: Callable[..., Any],
    *args: Any,
    samples_per_step: int | None = None,
    warmup_steps: int = 2,
    **kwargs: Any,
) -> tuple[Any, LoopProfile]:
    """Run ``fn(*args, **kwargs)`` under ``torch.profiler`` and return ``(its result, LoopProfile)``.

    Steps are delimited by the DataLoader's batch requests; the first ``warmup_steps`` steps are
    left out of the step statistics (and the stall share), and so is the step after the last
    request (it ends in whatever ``fn`` does after its loop). ``samples_per_step`` (the batch
    size) turns step times into throughput. Profiling every op costs time: the figures are for
    comparing loops and finding stalls, not for absolute speed.
    """
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    cuda = torch.cuda.is_available()
    if cuda:  # pragma: no cover - no GPU on CI
        activities.append(ProfilerActivity.CUDA)
        torch.cuda.reset_peak_memory_stats()
    rss_before = _rss_mb()
    start = time.perf_counter()
    with profile(activities=activities, record_shapes=False, with_stack=False) as prof:
        result = fn(*args, **kwargs)
    wall = time.perf_counter() - start
    peak_rss = max(rss_before, _rss_mb())
    with contextlib.suppress(psutil.Error):
        peak_rss = max(peak_rss, psutil.Process(os.getpid()).memory_full_info().rss / 2**20)
    peak_gpu = torch.cuda.max_memory_allocated() / 2**20 if cuda else None

    nexts = sorted(
        (ev.time_range.start, ev.time_range.end)
        for ev in prof.events()
        if ev.name.startswith(DATALOADER_EVENT) and ev.name.endswith("__next__")
    )
    notes: list[str] = []
    if not nexts:
        notes.append("no DataLoader batch requests were recorded: does fn iterate a torch DataLoader?")
    # step k (1-based) runs from the start of batch request k to the start of request k+1
    arrivals = {k: (nexts[k][0] - nexts[0][0]) / 1e6 for k in range(1, len(nexts))}
    stats: StepStats | None
    try:
        stats = step_stats({0: 0.0, **arrivals}, warmup_steps) if len(arrivals) >= 2 else None
    except ValueError:
        stats = None
    share = p50 = None
    if stats is not None:
        waits = {k: (nexts[k - 1][1] - nexts[k - 1][0]) / 1e6 for k in stats.durations}
        total = sum(stats.durations.values())
        share = sum(waits.values()) / total if total > 0 else None
        p50 = statistics.median(waits.values())
    else:
        notes.append(f"{len(nexts)} batch request(s): too few steps to time after {warmup_steps} warm-up step(s)")
    return result, LoopProfile(
        batches=len(nexts), step=stats, data_wait_share=share, data_wait_p50_s=p50, wall_s=wall,
        peak_rss_mb=round(peak_rss, 1), peak_gpu_mb=peak_gpu, samples_per_step=samples_per_step, notes=notes,
    )
