"""The batch-size / memory headroom search: the largest batch that fits a memory budget per rank.

Each probe is a real short run of the job (``steps`` steps, ``world_size`` ranks) with
``{batch_size}`` filled. The batch doubles from ``start`` until a probe runs out of memory (or
``max`` passes); then a binary search between the largest passing and the first failing batch
narrows the boundary to ``resolution``. A probe that fails for any other reason stops the search
and says why: a crash at a large batch is a finding, never taken for an out-of-memory.

How the budget is enforced:

* ``cgroup`` (CPU, root): every rank gets its own memory cgroup
  (:class:`trainguard.faults.cgroups.MemoryCgroups`) with ``memory.limit_in_bytes`` = the budget,
  joined after fork and before exec (usage starts near zero, so the limit can be set first).
  Over the budget the kernel's OOM killer SIGKILLs a process of the rank (counted in the cgroup's
  ``oom_kill``). The cgroup's ``max_usage_in_bytes`` is the probe's peak (exact, not sampled).
* ``rlimit`` (CPU, the named fallback without root or cgroups): RLIMIT_AS = the budget, set
  before exec. It limits *address space*, which exceeds resident memory (mapped libraries,
  allocator arenas): the job's allocator raises (torch: ``DefaultCPUAllocator: can't allocate
  memory``; Python: ``MemoryError``). Peaks are the launcher's RSS samples (every 0.5 s).
* ``gpu``: the device's memory is the limit (``CUDA out of memory``); peaks come from NVML. A
  configured budget below the device's memory is applied when judging the safe batch, not
  enforced.

From the passing probes a line peak = fixed + per-sample x batch is fitted (least squares); the
safe batch is the largest whose fitted peak keeps ``margin`` of the budget free, at most the
largest passing batch. See docs/profiling.md, "Memory headroom".
"""

from __future__ import annotations

import contextlib
import dataclasses
import resource
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import psutil

from trainguard.config import HeadroomSearch, ProfileCheck
from trainguard.faults.hook import rank_stderr
from trainguard.launch import Launcher, MetricPoint, RunResult
from trainguard.run.request import RunRequest
from trainguard.run.runner import JobRunner, LaunchOptions

__all__ = [
    "DEFAULT_BUDGET_SHARE",
    "Headroom",
    "MemoryFit",
    "Probe",
    "SearchOutcome",
    "classify_probe",
    "fit_memory",
    "run_headroom",
    "safe_batch",
    "search_batch",
]

#: CPU without ``memory_budget_mb``: this share of the host's available memory, split over ranks
DEFAULT_BUDGET_SHARE = 0.5

ProbeOutcome = Literal["pass", "oom", "error"]
Stopped = Literal["bracketed", "max_reached", "start_failed", "other_failure", "probe_limit"]

# text of an out-of-memory failure in a rank's stderr, and how to name it
_OOM_TEXT = (
    ("CUDA out of memory", "CUDA out of memory (torch.OutOfMemoryError)"),
    ("OutOfMemoryError", "torch.OutOfMemoryError"),
    ("DefaultCPUAllocator", "allocator error (DefaultCPUAllocator: can't allocate memory)"),
    ("can't allocate memory", "allocator error (can't allocate memory)"),
    ("std::bad_alloc", "C++ std::bad_alloc"),
    ("MemoryError", "Python MemoryError"),
)


@dataclass
class Probe:
    """One short run at one batch size and how it ended."""

    batch_size: int
    outcome: ProbeOutcome
    detail: str  # how it ended, in words
    peak_mb: float | None = None  # the largest rank's peak in the budget's terms (see below)
    peak_rss_mb: float | None = None  # resident memory of the rank's process tree
    peak_gpu_mb: float | None = None
    cgroup_peak_mb: float | None = None  # the cgroup's max_usage (page cache included)
    duration_s: float = 0.0
    steps: int = 0  # step lines rank 0 printed
    run_dir: str | None = None


@dataclass
class SearchOutcome:
    """What the search found, before any memory arithmetic."""

    probes: list[Probe]
    largest_pass: int | None
    first_fail: int | None  # the smallest out-of-memory batch above largest_pass
    stopped: Stopped
    reason: str


@dataclass(frozen=True)
class MemoryFit:
    """peak_mb = fixed_mb + per_sample_mb x batch, fitted to the passing probes."""

    fixed_mb: float
    per_sample_mb: float
    points: int
    rms_mb: float

    def peak(self, batch: int) -> float:
        return self.fixed_mb + self.per_sample_mb * batch


def _round_down(value: float, step: int) -> int:
    return int(value // step) * step


def search_batch(
    probe: Callable[[int], Probe],
    *,
    start: int,
    max_batch: int,
    step: int = 1,
    resolution: float = 0.05,
    max_probes: int = 12,
) -> SearchOutcome:
    """Double from ``start`` until ``probe`` says oom (or ``max_batch`` passes), then bisect
    until first failing - largest passing <= max(step, resolution x largest passing). Every batch
    tried is a multiple of ``step``. A probe with outcome ``error`` stops the search."""
    top = max(_round_down(max_batch, step), step)
    probes: list[Probe] = []
    lo: int | None = None
    hi: int | None = None

    def stop(stopped: Stopped, reason: str) -> SearchOutcome:
        return SearchOutcome(probes, lo, hi, stopped, reason)

    def try_batch(batch: int, where: str) -> SearchOutcome | str:
        """Probe ``batch``: its outcome ("ok"/"oom"), or the outcome that ends the search."""
        if len(probes) >= max_probes:
            return stop("probe_limit", f"probe limit ({max_probes}) reached {where}")
        result = probe(batch)
        probes.append(result)
        if result.outcome == "error":
            return stop("other_failure", f"batch {batch} failed for a reason other than memory: "
                        f"{result.detail}")
        return result.outcome

    batch = max(_round_down(start, step), step)
    while True:
        outcome = try_batch(batch, "while growing the batch")
        if isinstance(outcome, SearchOutcome):
            return outcome
        if outcome == "oom":
            hi = batch
            break
        lo = batch
        if batch >= top:
            return stop("max_reached", f"every batch up to max ({top}) fits the budget")
        batch = min(batch * 2, top)
    if lo is None:
        return stop("start_failed", f"the first batch ({hi}) already runs out of memory: "
                    f"{probes[-1].detail}; lower `start`")
    while hi - lo > max(step, resolution * lo):
        mid = _round_down((lo + hi) / 2, step)
        if mid <= lo:
            break
        outcome = try_batch(mid, f"between {lo} and {hi}")
        if isinstance(outcome, SearchOutcome):
            return outcome
        if outcome == "oom":
            hi = mid
        else:
            lo = mid
    return stop("bracketed", f"batch {lo} fits, {hi} runs out of memory")


def fit_memory(probes: list[Probe]) -> MemoryFit | None:
    """The least-squares line of peak memory over batch size through the passing probes (None
    with fewer than two distinct batches)."""
    points = [(p.batch_size, p.peak_mb) for p in probes if p.outcome == "pass" and p.peak_mb]
    xs = [float(b) for b, _ in points]
    if len(set(xs)) < 2:
        return None
    ys = [float(m) for _, m in points if m is not None]
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    slope = max(0.0, slope)  # memory never shrinks with the batch; a negative slope is noise
    fixed = my - slope * mx
    rms = (sum((fixed + slope * x - y) ** 2 for x, y in zip(xs, ys)) / n) ** 0.5
    return MemoryFit(round(fixed, 2), round(slope, 4), n, round(rms, 2))


def safe_batch(
    largest_pass: int | None,
    fit: MemoryFit | None,
    budget_mb: float,
    margin: float,
    step: int = 1,
) -> tuple[int | None, str]:
    """(the largest batch that keeps ``margin`` of the budget free, how it was chosen)."""
    if largest_pass is None:
        return None, "no batch passed"
    allowed = (1 - margin) * budget_mb
    if fit is not None:
        if fit.per_sample_mb <= 0:
            if fit.fixed_mb <= allowed:
                return largest_pass, "memory does not grow with the batch: the largest passing batch"
            return None, f"the fixed memory ({fit.fixed_mb:.0f} MB) alone exceeds {allowed:.0f} MB"
        by_fit = _round_down((allowed - fit.fixed_mb) / fit.per_sample_mb, step)
        if by_fit < step:
            return None, (f"no batch keeps {margin:.0%} of {budget_mb:.0f} MB free (fixed "
                          f"{fit.fixed_mb:.0f} MB + {fit.per_sample_mb:.3g} MB/sample)")
        if by_fit >= largest_pass:
            return largest_pass, (f"the largest passing batch (its fitted peak keeps >= "
                                  f"{margin:.0%} of the budget free)")
        return by_fit, (f"largest batch with fitted peak <= (1 - {margin:g}) x {budget_mb:.0f} MB "
                        f"= {allowed:.0f} MB")
    scaled = _round_down(largest_pass * (1 - margin), step)
    if scaled < step:
        return None, "no memory fit and the largest passing batch scaled by (1 - margin) is < 1"
    return scaled, f"largest passing batch x (1 - {margin:g}) (no memory fit: fewer than 2 passing batches)"


# -------------------------------------------------------------------------------------------
# Probes: real runs with the budget enforced
# -------------------------------------------------------------------------------------------


def classify_probe(result: RunResult, oom_kills: dict[int, int] | None = None) -> tuple[ProbeOutcome, str]:
    """pass / oom / error for one probe run: a kernel OOM kill in a rank's cgroup, or the
    out-of-memory text of CUDA, torch's CPU allocator, C++ or Python in a rank's stderr, is oom;
    any other failure (a crash, a hang, a timeout) is error."""
    killed = {r: n for r, n in (oom_kills or {}).items() if n}
    if killed:
        ranks = ", ".join(f"rank {r}: oom_kill={n}" for r, n in sorted(killed.items()))
        return "oom", f"killed by the kernel OOM killer in its memory cgroup ({ranks})"
    if result.ok:
        return "pass", "ok"
    if result.outcome in ("hung", "timeout", "interrupted", "stopped"):
        return "error", f"{result.outcome}: {result.reason}"
    for rank in _rank_order(result):
        text = rank_stderr(result, rank)
        for needle, name in _OOM_TEXT:
            if needle in text:
                return "oom", f"rank {rank}: {name}"
    last = _last_line(rank_stderr(result, result.failed_rank or 0))
    detail = result.reason or result.outcome
    return "error", f"{detail}" + (f" ({last})" if last else "")


def _rank_order(result: RunResult) -> list[int]:
    ranks = [e.rank for e in result.exits]
    first = result.failed_rank
    return ([first] if first is not None else []) + [r for r in ranks if r != first]




def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1][:300] if lines else ""


class _PeakSampler:
    """Samples every 0.05 s, per rank, the anonymous memory charged to its cgroup (what the
    kernel cannot reclaim; the cgroup's own max_usage also counts page cache, which depends on
    what earlier runs left cached) and the resident memory of its process tree (once the first
    metric line names the ranks' pids). After the run the cgroup's max_usage less its page cache
    is added, so a peak between two samples is not missed."""

    _EVERY_S = 0.05

    def __init__(self, cgroups: Any, world_size: int) -> None:
        self._cgroups = cgroups
        self._world_size = world_size
        self._launcher: Launcher | None = None
        self.anon: dict[int, int] = {}
        self.rss: dict[int, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="trainguard-headroom", daemon=True)

    def __enter__(self) -> _PeakSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def on_metric(self, point: MetricPoint, launcher: Launcher) -> None:
        self._launcher = launcher

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._sample()
            self._stop.wait(self._EVERY_S)

    def _sample(self) -> None:
        if self._cgroups is not None:
            for rank in range(self._world_size):
                stat = _read_stat(self._cgroups.path(rank) / "memory.stat")
                anon = stat.get("total_rss", stat.get("rss", stat.get("anon")))
                if anon is not None:
                    self.anon[rank] = max(self.anon.get(rank, 0), anon)
        launcher = self._launcher
        if launcher is not None:
            for rp in list(launcher.ranks):
                with contextlib.suppress(psutil.Error):
                    root = psutil.Process(rp.pid)
                    total = 0
                    for proc in [root, *root.children(recursive=True)]:
                        with contextlib.suppress(psutil.Error):
                            total += proc.memory_info().rss
                    self.rss[rp.rank] = max(self.rss.get(rp.rank, 0), total)


def _read_stat(path: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        with open(path) as f:
            for line in f:
                key, _, value = line.partition(" ")
                with contextlib.suppress(ValueError):
                    out[key] = int(value)
    except OSError:
        pass
    return out


def _mb(values: list[float]) -> float | None:
    return round(max(values) / 2**20, 1) if values else None


@dataclass
class _Enforcement:
    """How the budget is held: the mode, why a fallback ran, the budget in bytes."""

    mode: Literal["cgroup", "rlimit", "gpu"]
    budget_bytes: int
    fallback: str | None = None


def _choose_enforcement(search: HeadroomSearch, device: str, budget_mb: float) -> _Enforcement:
    budget = int(budget_mb * 2**20)
    if device == "gpu":
        return _Enforcement("gpu", budget)
    if search.enforce == "rlimit":
        return _Enforcement("rlimit", budget)
    from trainguard.faults.base import FaultUnavailable
    from trainguard.faults.cgroups import MemoryCgroups

    try:
        probe = MemoryCgroups(search.world_size)
        probe.create()
    except FaultUnavailable as exc:
        if search.enforce == "cgroup":
            raise
        return _Enforcement("rlimit", budget, fallback=f"memory cgroups unavailable ({exc}); "
                            "RLIMIT_AS (address space) enforces the budget instead")
    probe.teardown()
    return _Enforcement("cgroup", budget)


def _probe_once(
    runner: JobRunner,
    spec: ProfileCheck,
    search: HeadroomSearch,
    enforcement: _Enforcement,
    batch: int,
    seed: int,
    step_metric: str,
) -> Probe:
    """One real run at ``batch`` under the budget; torn down (processes, cgroups) before return."""
    job_file = runner.job_file
    job = job_file.job.model_copy(update={"batch_size": batch})
    sized = runner.sibling(dataclasses.replace(job_file, job=job))
    request = RunRequest.make(
        steps=search.steps, seed=seed, world_size=search.world_size, args=spec.args,
        env=spec.env, timeout=search.timeout or spec.timeout,
    )
    preexec: Callable[[int], None] | None = None
    cgroups = None
    if enforcement.mode == "cgroup":
        from trainguard.faults.cgroups import MemoryCgroups

        cgroups = MemoryCgroups(search.world_size)
        cgroups.create()
    try:
        if cgroups is not None:
            groups = cgroups
            for rank in range(search.world_size):
                # the cgroup is empty (usage 0): the limit is exactly the budget
                groups.set_limit_above_usage(rank, enforcement.budget_bytes)

            def join(rank: int) -> None:
                # nothing can be reported from a forked child: a rank outside its cgroup leaves
                # it uncharged, which is checked after the run
                with contextlib.suppress(OSError):
                    groups.join(rank)

            preexec = join
        elif enforcement.mode == "rlimit":
            limit = enforcement.budget_bytes

            def cap(rank: int) -> None:
                resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

            preexec = cap

        started = time.monotonic()
        with _PeakSampler(cgroups, search.world_size) as sampler:
            run = sized.supervise(request, label=f"headroom-b{batch}",
                                  options=LaunchOptions(max_restarts=0, preexec=preexec), on_metric=sampler.on_metric)
        duration = time.monotonic() - started
        result = run.final
        kills: dict[int, int] = {}
        cgroup_peak: float | None = None
        uncharged: list[int] = []
        if cgroups is not None:
            counters = {r: cgroups.counters(r) for r in range(search.world_size)}
            kills = {r: c.oom_kill or 0 for r, c in counters.items()}
            cgroup_peak = _mb([c.peak_bytes for c in counters.values() if c.peak_bytes])
            uncharged = [r for r, c in counters.items() if not c.peak_bytes]
            for rank, c in counters.items():
                # the cgroup's max_usage less the page cache still charged after the run: an
                # anonymous peak between two samples shows here (an over-estimate only when
                # the cache was reclaimed, near the limit)
                stat = _read_stat(cgroups.path(rank) / "memory.stat")
                cache = stat.get("total_cache", stat.get("cache", stat.get("file")))
                if c.peak_bytes and cache is not None:
                    sampler.anon[rank] = max(sampler.anon.get(rank, 0), c.peak_bytes - cache)
    finally:
        sized.close()  # a ray_train job's embedded head
        if cgroups is not None:
            cgroups.teardown()
    outcome, detail = classify_probe(result, kills)
    rss = _mb([v * 2**20 for v in result.peak_rss_mb.values()] + list(sampler.rss.values()))
    gpu = max(result.peak_gpu_mb.values()) if result.peak_gpu_mb else None
    if uncharged and outcome == "pass":
        outcome, detail = "error", (f"rank(s) {', '.join(map(str, uncharged))} never joined their "
                                    "memory cgroup: the budget was not enforced")
    anon = _mb(list(sampler.anon.values())) or cgroup_peak
    peak = {"cgroup": anon, "rlimit": rss, "gpu": gpu}[enforcement.mode]
    steps = len({p.step for p in result.points if p.rank == 0 and p.name == step_metric})
    if outcome == "pass" and steps < search.steps:
        outcome, detail = "error", (f"exited 0 after {steps} of {search.steps} step line(s) of "
                                    f"{step_metric!r}: did it train at this batch?")
    return Probe(
        batch_size=batch, outcome=outcome, detail=detail, peak_mb=peak, peak_rss_mb=rss,
        peak_gpu_mb=gpu, cgroup_peak_mb=cgroup_peak, duration_s=round(duration, 2), steps=steps,
        run_dir=str(run.run_dir),
    )


# -------------------------------------------------------------------------------------------
# The whole search
# -------------------------------------------------------------------------------------------


@dataclass
class Headroom:
    """The search's result, with the memory arithmetic; ``to_dict`` goes into the profile JSON."""

    device: str
    enforcement: str
    fallback: str | None
    budget_mb: float
    budget_source: str
    margin: float
    world_size: int
    start: int
    max_batch: int
    probes: list[Probe]
    largest_pass: int | None
    first_fail: int | None
    stopped: str
    reason: str
    safe_batch: int | None
    safe_rule: str
    fit: MemoryFit | None
    profile_batch: int | None
    peak_at_profile_batch_mb: float | None
    peak_source: str | None  # "measured" (a probe at that batch) or "fitted"
    headroom_mb: float | None  # budget - peak at the profile's batch, per rank
    duration_s: float
    notes: list[str] = field(default_factory=list)

    @property
    def failed(self) -> bool:
        """The search found a problem: a non-memory failure, or not even ``start`` fits."""
        return self.stopped in ("other_failure", "start_failed")

    def summary(self) -> str:
        """One line for the check summary and the CLI."""
        if self.stopped == "other_failure":
            return f"headroom: {self.reason}"
        if self.largest_pass is None:
            return f"headroom: {self.reason}"
        top = (f"largest batch {self.largest_pass}"
               + (f" (OOM at {self.first_fail})" if self.first_fail else " (max reached, no OOM)"))
        safe = f"safe batch {self.safe_batch}" if self.safe_batch else "no safe batch"
        line = f"headroom: {top}, {safe} with {self.margin:.0%} margin of {self.budget_mb:.0f} MB/rank"
        if self.headroom_mb is not None and self.profile_batch is not None:
            line += f"; {self.headroom_mb:.0f} MB free per rank at batch {self.profile_batch}"
        return line

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["summary"] = self.summary()
        data["failed"] = self.failed
        return data


def _budget(search: HeadroomSearch, device: str, gpu_total_mb: float | None) -> tuple[float, str]:
    if search.memory_budget_mb is not None:
        return search.memory_budget_mb, "checks.profile.headroom.memory_budget_mb"
    if device == "gpu" and gpu_total_mb:
        return gpu_total_mb, "the GPU's memory"
    available = psutil.virtual_memory().available / 2**20
    per_rank = DEFAULT_BUDGET_SHARE * available / search.world_size
    return per_rank, (f"{DEFAULT_BUDGET_SHARE:.0%} of the available host memory "
                      f"({available:.0f} MB) / {search.world_size} rank(s) (default)")


def run_headroom(
    runner: JobRunner,
    spec: ProfileCheck,
    *,
    device: str = "cpu",
    gpu_total_mb: float | None = None,
    probe: Callable[[int], Probe] | None = None,
) -> Headroom:
    """Search the largest batch that fits ``spec.headroom``'s budget per rank (see the module
    docstring); ``device`` ("cpu"/"gpu") is what the profile's runs used. ``probe`` replaces the
    real runs (for tests of the arithmetic only)."""
    from trainguard.profiling.measure import batch_size_for, step_metric_of

    search = spec.headroom
    if search is None:
        raise ValueError("checks.profile.headroom is not set")
    job_file = runner.job_file
    budget_mb, source = _budget(search, device, gpu_total_mb)
    enforcement = _choose_enforcement(search, device, budget_mb)
    seed = spec.seed if spec.seed is not None else runner.settings.seed
    metric = step_metric_of(job_file, spec)
    if probe is None:
        def probe(batch: int) -> Probe:
            return _probe_once(runner, spec, search, enforcement, batch, seed, metric)

    started = time.monotonic()
    outcome = search_batch(
        probe, start=search.start, max_batch=search.max, step=search.step,
        resolution=search.resolution, max_probes=search.max_probes,
    )
    fit = fit_memory(outcome.probes)
    safe, rule = safe_batch(outcome.largest_pass, fit, budget_mb, search.margin, search.step)
    notes: list[str] = []
    if enforcement.fallback:
        notes.append(f"fallback: {enforcement.fallback}")
    if enforcement.mode == "gpu" and gpu_total_mb and budget_mb < gpu_total_mb:
        notes.append(f"GPU: the budget of {budget_mb:.0f} MB is applied when choosing the safe "
                     f"batch; what the probes ran under is the device's {gpu_total_mb:.0f} MB")
    if enforcement.mode == "cgroup":
        notes.append("peak = the most anonymous memory charged to a rank's cgroup (sampled every "
                     "0.05 s, and its max_usage less the page cache charged after the run); "
                     "cgroup_peak_mb in the JSON is max_usage itself, page cache included")
    elif enforcement.mode == "rlimit":
        notes.append("RLIMIT_AS limits address space, which exceeds resident memory (mapped "
                     "libraries, allocator arenas): the batch found is a lower bound")
    profile_batch = batch_size_for(job_file, spec, search.world_size)
    peak_at: float | None = None
    peak_source: str | None = None
    if profile_batch is not None:
        measured = [p.peak_mb for p in outcome.probes
                    if p.batch_size == profile_batch and p.outcome == "pass" and p.peak_mb]
        if measured:
            peak_at, peak_source = max(m for m in measured if m is not None), "measured"
        elif fit is not None:
            peak_at, peak_source = round(fit.peak(profile_batch), 1), "fitted"
        if safe is not None and profile_batch > safe:
            notes.append(f"the profile's batch ({profile_batch}) is above the safe batch ({safe})")
    headroom = round(budget_mb - peak_at, 1) if peak_at is not None else None
    return Headroom(
        device=device, enforcement=enforcement.mode, fallback=enforcement.fallback,
        budget_mb=round(budget_mb, 1), budget_source=source, margin=search.margin,
        world_size=search.world_size, start=search.start, max_batch=search.max,
        probes=outcome.probes, largest_pass=outcome.largest_pass, first_fail=outcome.first_fail,
        stopped=outcome.stopped, reason=outcome.reason, safe_batch=safe, safe_rule=rule, fit=fit,
        profile_batch=profile_batch, peak_at_profile_batch_mb=peak_at, peak_source=peak_source,
        headroom_mb=headroom, duration_s=round(time.monotonic() - started, 2), notes=notes,
    )
