"""``slow_rank``: one rank throttled to a fraction of a CPU for ``duration`` seconds.

A slow rank is what a failing fan, a noisy neighbour or a thermally throttled GPU looks like from
the job: synchronous training runs at the slowest rank's pace, and a collective timeout shorter
than the slowed step turns the slowdown into a crash. The real thing here: the rank's processes
(the rank and its DataLoader workers, and whatever they fork later) are moved into a CPU cgroup
of their own whose CFS quota is ``fraction`` of one CPU per period (cgroup v1 ``cpu.cfs_quota_us``,
v2 ``cpu.max``); :meth:`clear` lifts the quota and moves them back. Needs root (or a delegated
cgroup subtree); without it the drill is skipped, saying why.

The default expectation is ``continue``: the job completes, its step rate during the throttle is
at least ``fraction`` x the rate before x a margin (``min_rate`` overrides), and no timeout of its
own fires. The evidence has the rate before/during/after of every rank that prints its steps and
the cgroup's throttling counters (``nr_throttled``, ``throttled_time``), proof the quota bit.
"""

from __future__ import annotations

import atexit
import contextlib
import math
import os
import re
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import psutil

from trainguard.config.fault_params import FaultParams
from trainguard.config.faults import Expectation
from trainguard.faults.base import Fault, FaultContext, FaultEvidence, FaultUnavailable
from trainguard.faults.cgroups import remove_stale
from trainguard.launch.metrics import step_rate
from trainguard.report import SkipReason

if TYPE_CHECKING:  # pragma: no cover
    from trainguard.launch import Launcher, RunResult
    from trainguard.launch.backend import JobBackend

__all__ = ["CpuCgroup", "SlowRankEvidence", "SlowRankFault"]

_PERIOD_US = 100_000
#: the rate during the throttle may fall to this share of fraction x the rate before
_MARGIN = 0.5
_TIMEOUT_WORDS = re.compile(r"time(d)? ?out|timeout", re.IGNORECASE)


class CpuCgroup:
    """One CPU cgroup (``trainguard-<pid>-<id>`` beside trainguard's own) with a CFS quota."""

    def __init__(self) -> None:
        self.version, self.base, self.home = _locate_cpu()
        self.path = self.base / f"trainguard-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.created = False

    def create(self) -> None:
        remove_stale(self.base)
        try:
            self.path.mkdir()
        except OSError as exc:
            raise FaultUnavailable(f"cannot create a CPU cgroup under {self.base}: {exc.strerror or exc}; "
                                   "run the drill as root (or with a delegated cgroup subtree)",
                                   needs=SkipReason.NEEDS_ROOT) from None
        self.created = True
        _live.add(self)

    def limit(self, fraction: float) -> None:
        quota = max(1000, int(_PERIOD_US * fraction))
        if self.version == 2:
            _write(self.path / "cpu.max", f"{quota} {_PERIOD_US}")
        else:
            _write(self.path / "cpu.cfs_period_us", str(_PERIOD_US))
            _write(self.path / "cpu.cfs_quota_us", str(quota))

    def unlimit(self) -> None:
        with contextlib.suppress(OSError):
            if self.version == 2:
                _write(self.path / "cpu.max", f"max {_PERIOD_US}")
            else:
                _write(self.path / "cpu.cfs_quota_us", "-1")

    def move(self, pid: int, *, home: bool = False) -> None:
        _write((self.home if home else self.path) / "cgroup.procs", str(pid))

    def pids(self) -> list[int]:
        try:
            return [int(p) for p in (self.path / "cgroup.procs").read_text().split()]
        except OSError:
            return []

    def stat(self) -> dict[str, int]:
        out: dict[str, int] = {}
        with contextlib.suppress(OSError):
            for line in (self.path / "cpu.stat").read_text().splitlines():
                key, _, value = line.partition(" ")
                if value.strip().isdigit():
                    out[key] = int(value)
        return out

    def teardown(self) -> list[str]:
        """Lift the quota, move everything back, remove the cgroup (never raises)."""
        if not self.created:
            return []
        self.unlimit()
        deadline = time.monotonic() + 5
        while True:
            for pid in self.pids():
                with contextlib.suppress(OSError):
                    self.move(pid, home=True)
            try:
                self.path.rmdir()
                break
            except FileNotFoundError:
                break
            except OSError as exc:
                if time.monotonic() > deadline:
                    return [f"{self.path}: {exc.strerror}"]
                time.sleep(0.05)
        self.created = False
        _live.discard(self)
        return []


_live: set[CpuCgroup] = set()


@atexit.register
def _remove_leftovers() -> None:
    for group in list(_live):
        group.teardown()


def _write(path: Path, value: str) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)


def _locate_cpu() -> tuple[int, Path, Path]:
    """(version, where the cgroup goes, this process's own CPU cgroup) or FaultUnavailable."""
    if os.geteuid() != 0:
        raise FaultUnavailable("throttling a rank's CPU needs a cgroup: run the drill as root (or with a "
                               "delegated cgroup subtree)", needs=SkipReason.NEEDS_ROOT)
    own: dict[str, str] = {}
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            for name in controllers.split(",") if controllers else [""]:
                own[name] = path
    mounts: list[tuple[str, str, str, str]] = []
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/mountinfo").read_text().splitlines():
            left, _, right = line.partition(" - ")
            fields, tail = left.split(), right.split()
            if len(fields) >= 5 and len(tail) >= 3 and tail[0] in ("cgroup", "cgroup2"):
                mounts.append((fields[3], fields[4], tail[0], tail[2]))

    def inside(root: str, mine: str, point: str) -> Path:
        rel = os.path.relpath(mine, root) if mine.startswith(root) else "."
        return Path(point) / ("" if rel == "." else rel)

    for root, point, fstype, options in mounts:
        if fstype == "cgroup" and "cpu" in options.split(","):
            base = inside(root, own.get("cpu", "/"), point)
            if not (base / "cpu.cfs_quota_us").exists():
                base = Path(point)
            return 1, base, base
    for root, point, fstype, _ in mounts:
        if fstype == "cgroup2" and "cpu" in (Path(point) / "cgroup.controllers").read_text().split():
            mine = inside(root, own.get("", "/"), point)
            return 2, (mine.parent if mine != Path(point) else Path(point)), mine
    raise FaultUnavailable("no CPU cgroup controller is mounted (cgroup v1 'cpu' or cgroup2 with 'cpu')",
                           needs=SkipReason.NEEDS_ROOT)


def _fraction(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    with contextlib.suppress(OverflowError):
        number = float(value)
        return number if math.isfinite(number) else None
    return None


@dataclass
class SlowRankEvidence(FaultEvidence):
    """How a ``slow_rank`` fault throttled its rank, what the kernel counted, and each rank's
    step rate before, during and after."""

    fraction: float
    mechanism: str
    cfs_period_us: int
    pids_throttled: list[int]
    #: the cgroup's cpu.stat counters at the clear
    throttling: dict[str, int]
    #: rank -> its step rate ``before``, ``during`` and ``after`` the throttle
    rank_step_rates: dict[int, dict[str, float | None]]
    #: the job's timeout line, when one fired
    collective_timeout: str | None


class SlowRankFault(Fault):
    """Throttle rank ``rank``'s processes to ``fraction`` of a CPU until :meth:`clear`."""

    kind: ClassVar[str] = "slow_rank"
    expectations: ClassVar[tuple[Expectation, ...]] = (Expectation.CONTINUE, Expectation.RECOVER, Expectation.FAIL_CLEAN)
    defaults: ClassVar[FaultParams] = FaultParams({"fraction": 0.25})

    def __init__(self, params: FaultParams | None = None, **kwargs: Any) -> None:
        super().__init__(params, **kwargs)
        self.group: CpuCgroup | None = None
        self.moved: list[int] = []
        self.throttling: dict[str, int] = {}
        self.rank_rates: dict[int, dict[str, float | None]] = {}
        self.timeout_line: str | None = None

    @classmethod
    def validate(cls, params: FaultParams) -> list[tuple[str, str]]:
        problems = super().validate(params)
        fraction = _fraction(params.raw("fraction", 0.25))
        if fraction is None or not 0.01 <= fraction < 1:
            problems.append(("fraction", "expected the share of one CPU the rank keeps, from 0.01 to below 1, "
                             "e.g. `fraction: 0.25`"))
        return problems

    @property
    def fraction(self) -> float:
        return float(self.params.number("fraction"))

    @property
    def min_rate_default(self) -> float:
        """``continue``: the rate during the throttle, as a share of the rate before, that passes
        when the drill sets no ``min_rate``."""
        return self.fraction * _MARGIN

    @classmethod
    def unavailable_for(cls, backend: JobBackend) -> str | None:
        return None if backend.ranks_are_children() else (
            "slow_rank throttles a rank's processes by pid, children of the launched command; a "
            "ray_train job's workers are Ray actors")

    def setup(self, ctx: FaultContext) -> None:
        self.require_job_kind(ctx)
        self.group = CpuCgroup()
        self.group.create()

    def inject(self, launcher: Launcher) -> None:
        assert self.group is not None, "setup() first"
        rank_pid = launcher.ranks[self.rank].pid
        try:
            tree = [psutil.Process(rank_pid), *psutil.Process(rank_pid).children(recursive=True)]
        except psutil.Error as exc:
            raise RuntimeError(f"rank {self.rank} (pid {rank_pid}) is gone: {exc}") from None
        self.group.limit(self.fraction)
        for proc in tree:
            with contextlib.suppress(OSError):
                self.group.move(proc.pid)
                self.moved.append(proc.pid)

    def clear(self) -> None:
        if self.group is not None and self.group.created:
            self.throttling = self.group.stat()
            self.group.teardown()

    def teardown(self) -> None:
        if self.group is not None:
            self.group.teardown()

    def evidence(self) -> SlowRankEvidence:
        return SlowRankEvidence(*self.struck(), fraction=self.fraction, mechanism="cgroup cpu quota",
                                cfs_period_us=_PERIOD_US, pids_throttled=self.moved,
                                throttling=self.throttling, rank_step_rates=self.rank_rates,
                                collective_timeout=self.timeout_line)

    def verify_continue(self, result: RunResult) -> list[str]:
        """Per-rank step rates before/during/after (the job runs at the slowest rank's pace)."""
        injected, cleared = self.injected_at, self.cleared_at
        for rank in sorted({p.rank for p in result.points}):
            lines = sorted((p.step, p.t) for p in result.points if p.rank == rank)

            def rate(lo: float | None, hi: float | None, lines: list[tuple[int, float]] = lines) -> float | None:
                found = step_rate((s, t) for s, t in lines if (lo is None or t > lo) and (hi is None or t <= hi))
                return None if found is None else round(found, 3)

            self.rank_rates[rank] = {"before": rate(None, injected), "during": rate(injected, cleared),
                                     "after": rate(cleared, None) if cleared is not None else None}
        return []

    def likely_causes(self, result: RunResult) -> list[str]:
        if not result.ok and (self.timeout_line or _TIMEOUT_WORDS.search(result.stderr_tail or "")):
            return ["a collective (or step) timeout shorter than a slowed step: set it from the slowest "
                    "step you expect (several times the p99 step time), not the typical one"]
        if not result.ok:
            return ["the job treats a slow peer as a failure (a watchdog or heartbeat deadline of its own)"]
        return ["work that waits on the slowest rank more than once per step (several collectives, or "
                "a rank-0-only stage the others wait for), so one slow rank costs more than its share"]

    def classify(self, result: RunResult) -> str:
        text = result.stderr_tail or ""
        hit = next((line for line in reversed(text.splitlines()) if _TIMEOUT_WORDS.search(line)), None)
        if hit is not None and not result.ok:
            self.timeout_line = hit.strip()[:300]
            return (f"a timeout of the job fired while rank {self.rank} ran at {self.fraction:g} of a CPU: "
                    f"{self.timeout_line} (rank {result.failed_rank} failed) -- the collective timeout is "
                    "shorter than a slowed step")
        return super().classify(result)
