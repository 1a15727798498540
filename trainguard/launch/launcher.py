"""trainguard's own torchrun-compatible launcher.

It starts ``world_size`` rank processes of a command with the torchrun environment contract,
each in its own process group, captures every rank's output to files under the run directory,
parses metric lines as they arrive, and watches the ranks:

* a rank that exits non-zero or dies by a signal stops the whole group at once (SIGTERM, then
  SIGKILL after ``grace_period``) -- the others would otherwise wait in a collective until their
  own timeouts (30 minutes by default in NCCL);
* no new metric line for ``stall_timeout`` seconds is a hang: each rank's CPU activity, state and
  stack (py-spy) are collected as evidence, then the group is torn down. CPU time is not taken
  as progress: NCCL busy-polls inside a stuck collective;
* ``timeout`` bounds the whole attempt;
* every rank's process tree is sampled every 0.5 s: its resident memory (and, with
  nvidia-ml-py and a GPU, its GPU memory) peaks are kept per rank, and ``max_rss_mb`` stops
  the run as soon as one rank's tree holds more.

Nothing outlives :meth:`Launcher.run`: Ctrl-C, an exception or a deadline all end in the same
teardown of every process group (DataLoader workers included). Each of these stop conditions
is a named object in :mod:`trainguard.launch.stops`, asked in turn once per monitor pass;
signalling the groups lives in :mod:`trainguard.launch.procs`, the hang evidence in
:mod:`trainguard.launch.hang_evidence`.
"""

from __future__ import annotations

import contextlib
import functools
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import psutil

from trainguard._internal import envvars
from trainguard._internal.signals import restore_default_signals, signals_deferred
from trainguard.errors import RankFailure
from trainguard.launch.hang_evidence import (
    RankActivity,
    distributed_env_hint,
    dump_stacks,
    rank_activity,
)
from trainguard.launch.hook import PACE_DIR, STALL_DIR
from trainguard.launch.metrics import JsonlTail, LineMetric, MetricParser, MetricPoint, trajectory
from trainguard.launch.pace import PaceReport, judged_pace
from trainguard.launch.ports import reserve_port
from trainguard.launch.procs import (
    GpuMemory,
    RankProcess,
    carrying,
    group_alive,
    live_processes,
    process_running,
    signal_all,
    signal_group,
    signal_name,
    wait_stopped,
)
from trainguard.launch.pump import LinePump
from trainguard.launch.ranklog import RankLog, log_evidence
from trainguard.launch.stall_attribution import (
    ANSWER_WINDOW_S,
    StallAttribution,
    ask_ranks,
    attribute,
    collect_signals,
)
from trainguard.launch.stops import (
    Outcome,
    Progress,
    Snapshot,
    Stop,
    StopCondition,
    first_stop,
    stop_conditions,
)

__all__ = ["LaunchSpec", "Launcher", "RankExit", "RunResult", "launch"]

_POLL_S = 0.05
_SCAN_S = 0.5  # how often the process tree of every rank is recorded
_TAIL_LINES = 30
#: the longest line handed to the parser at once (a longer one arrives in pieces): a rank that
#: prints without newlines must not fill the memory
_MAX_LINE = 64 * 1024
#: lines waiting for the monitor, at most: a rank that prints faster than they are parsed waits
#: on its pipe instead of filling the memory (no line is lost)
_MAX_QUEUED = 4096
#: the default cap of each rank's stdout and stderr log file (setting ``rank_log_mb``)
RANK_LOG_MB = 64.0


#: what torchrun sets for each rank (and a launch with ``distributed_env=False`` leaves unset)
TORCHRUN_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                "ROLE_NAME", "ROLE_WORLD_SIZE", "GROUP_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID")
@dataclass
class LaunchSpec:
    """What to launch and how to watch it."""

    argv: Sequence[str]
    run_dir: Path
    world_size: int = 1
    cwd: Path | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    #: name -> a regex with ``step`` and ``value`` groups, or a LineMetric (implicit steps)
    metric_regexes: Mapping[str, str | LineMetric] = field(default_factory=dict)
    metric_files: Mapping[str, str] = field(default_factory=dict)  # name -> path ({rank} ok)
    timeout: float = 600.0
    stall_timeout: float | None = 60.0
    #: the stall limit before the first metric line (imports, rendezvous); None: stall_timeout
    startup_timeout: float | None = None
    #: the stall limit once a rank printed ``final_step`` (flushing, saving at exit); None:
    #: stall_timeout
    shutdown_timeout: float | None = None
    final_step: int | None = None
    #: end the run after ``final_step`` itself, its lines past it dropped (:class:`~.stops.StepsDone`)
    end_after_final_step: bool = False
    grace_period: float = 5.0
    restart_count: int = 0
    max_restarts: int = 0
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    echo: Callable[[int, str, str], None] | None = None  # (rank, stream, line) live
    label: str = "attempt-0"
    #: stop the run ("failed") once one rank's process tree (the rank and every descendant)
    #: holds more resident memory than this, in MB; sampled every ``_SCAN_S`` seconds
    max_rss_mb: float | None = None
    #: set the torchrun environment (RANK, WORLD_SIZE, MASTER_ADDR, ...) for every rank; False:
    #: one process started as a plain script, with none of it (inherited values removed too)
    distributed_env: bool = True
    #: at teardown, also end every process whose environment carries this run's directory (one
    #: that left the ranks' tree: a double fork, a session of its own). False where processes of
    #: a shared service carry it and are not the run's to end (a Ray cluster's pooled workers)
    end_by_environment: bool = True
    #: run in each rank's child process after fork, before exec, with the rank (e.g. a fault
    #: drill joins the rank to its own memory cgroup here, so all its memory is charged there)
    preexec: Callable[[int], None] | None = None
    #: the most each rank's stdout and stderr log file keeps, in MB: the first and the last
    #: half, the bytes between dropped behind a marker (None or 0: no cap). Parsing sees every
    #: line either way.
    log_limit_mb: float | None = RANK_LOG_MB


@dataclass(frozen=True)
class RankExit:
    """How one rank ended."""

    rank: int
    pid: int
    returncode: int | None  # None: still running when torn down (then killed)
    signal: str | None = None  # e.g. "SIGKILL" when killed by a signal
    killed_by_trainguard: bool = False

    @property
    def describe(self) -> str:
        if self.signal:
            who = " (sent by trainguard)" if self.killed_by_trainguard else ""
            return f"killed by {self.signal}{who}"
        return f"exit code {self.returncode}"


@dataclass
class RunResult:
    """Everything one attempt produced; ``outcome`` says how it ended."""

    outcome: Outcome
    argv: list[str]
    run_dir: Path
    world_size: int
    port: int
    exits: list[RankExit]
    points: list[MetricPoint]
    duration_s: float
    first_metric_s: float | None
    reason: str = ""
    failed_rank: int | None = None
    stderr_tail: str = ""
    evidence: dict[str, Any] = field(default_factory=dict)
    detected_after_s: float | None = None  # death/hang -> detection latency
    #: peak resident memory per rank of the rank's process tree (DataLoader workers included;
    #: pages shared between them are counted once per process), sampled every 0.5 s
    peak_rss_mb: dict[int, float] = field(default_factory=dict)
    #: peak GPU memory per rank (its tree's processes on every GPU); only with nvidia-ml-py
    #: installed and a GPU present
    peak_gpu_mb: dict[int, float] = field(default_factory=dict)
    #: where the run's checkpoints went (set by :class:`trainguard.run.runner.JobRunner`, which
    #: fills ``{checkpoint_dir}``; also ``evidence["checkpoint_dir"]`` in the report); None for a
    #: run launched directly
    checkpoint_dir: Path | None = None
    #: (start, end) of each span its processes were stopped (:meth:`Launcher.frozen`)
    pauses: list[tuple[float, float]] = field(default_factory=list)
    #: each rank's pace judged from the run agent's step clocks (multi-rank runs with the agent on)
    pace: PaceReport | None = None

    @property
    def checkpoints(self) -> Path:
        """:attr:`checkpoint_dir`, for a run whose runner filled it (raises otherwise)."""
        if self.checkpoint_dir is None:
            raise ValueError(f"the run in {self.run_dir} was not launched by a JobRunner: no checkpoint dir")
        return self.checkpoint_dir

    @property
    def ok(self) -> bool:
        """True when every rank exited 0 in time."""
        return self.outcome == "ok"

    def raise_for_ranks(self, what: str = "the run") -> None:
        """Raise :class:`~trainguard.errors.RankFailure` unless every rank exited 0 in time:
        how the attempt ended, the first failed rank, its stderr tail and where the logs are."""
        if self.ok:
            return
        rank = f" (rank {self.failed_rank})" if self.failed_rank is not None else ""
        tail = f"\nits stderr:\n{self.stderr_tail}" if self.stderr_tail else ""
        raise RankFailure(
            f"{what} {self.outcome}{rank}: {self.reason or 'no reason recorded'}; "
            f"logs: {self.run_dir}{tail}",
            result=self,
        )

    def trajectory(self, name: str = "loss") -> dict[int, float]:
        return trajectory(self.points, name)

    def log_path(self, rank: int, stream: str = "stderr") -> Path:
        return self.run_dir / f"rank{rank}.{stream}.log"

    @property
    def last_step(self) -> int | None:
        steps = [p.step for p in self.points]
        return max(steps) if steps else None


def _prepare_rank(preexec: Callable[[int], None] | None, rank: int) -> None:
    """In the rank's process, after fork, before exec: the default signal actions, then the
    spec's own ``preexec`` (a fault's)."""
    restore_default_signals()
    if preexec is not None:
        preexec(rank)


def _python_argv(argv: Sequence[str]) -> list[str]:
    """``python``/``python3`` at the front means this interpreter (the user's venv)."""
    out = list(argv)
    if out and out[0] in ("python", "python3"):
        out[0] = sys.executable
    return out


class Launcher:
    """Runs one attempt of a multi-rank job. Use :meth:`run` (blocking) or ``with`` + start/wait.

    ``on_metric`` callbacks run on the monitor thread for every parsed metric point; they may
    call :meth:`kill_rank` or :meth:`stop` (the resume check kills the job right after a step).
    """

    def __init__(self, spec: LaunchSpec) -> None:
        if spec.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {spec.world_size}")
        self.spec = spec
        self.ranks: list[RankProcess] = []
        self.points: list[MetricPoint] = []
        self.on_metric: list[Callable[[MetricPoint, Launcher], None]] = []
        self._events: queue.Queue[tuple[str, int, str, float]] = queue.Queue(_MAX_QUEUED)
        self._logs: list[RankLog] = []
        self._threads: list[threading.Thread] = []
        self._pumps: list[LinePump] = []
        self._pump_ranks: list[int] = []
        #: (rank, text) of each stream's unterminated last line when the ranks were last stopped
        #: (:meth:`frozen`): printed before the stop, its line end not yet
        self.partial_at_stop: list[tuple[int, str]] = []
        self._tails: list[JsonlTail] = []
        self._read_stopped: list[MetricPoint] = []  # metric-file points read in frozen()
        self._t0 = 0.0
        self._killed: set[int] = set()
        #: launcher-elapsed seconds at which the monitor first saw each rank's exit
        self.exit_seen_at: dict[int, float] = {}
        # every descendant seen so far: a launcher such as torchrun puts its workers in their
        # own sessions, out of reach of the rank's process group
        self._descendants: dict[int, psutil.Process] = {}
        self._last_scan = -_SCAN_S  # the first scan (and memory sample) right after the start
        self._stop_reason: str | None = None
        self._progress = Progress(spec.final_step)  # what the stall clock reads
        self._peak_rss_mb: dict[int, float] = {}
        self._peak_gpu_mb: dict[int, float] = {}
        self._gpu: GpuMemory | None = None
        #: (start, end) of each :meth:`frozen` span, launch clock
        self.pauses: list[tuple[float, float]] = []

    # -- control from callbacks / injectors ------------------------------------------------

    def elapsed(self) -> float:
        return time.monotonic() - self._t0

    def kill_rank(self, rank: int, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to one rank's process (not its group: a fault, not a teardown)."""
        proc = self.ranks[rank].popen
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, sig)

    @contextlib.contextmanager
    def frozen(self) -> Iterator[None]:
        """Every process of every rank stopped (SIGSTOP, waited for) while the body runs, then
        continued: the files are what a SIGKILL now would leave (a check keeps a checkpoint so),
        and each line printed before the stop is read, with its time, before they go on (a loaded
        machine's late reader thread would stamp it later). Stopped time is not the job's: the
        stall and timeout clocks skip it, :meth:`unpaused` too."""
        started = self.elapsed()
        for rp in self.ranks:  # at once: each rank's group (its workers too), then what left the group
            signal_group(rp.popen, signal.SIGSTOP)
        self._scan_descendants()
        procs = [*self._live_descendants(), *live_processes([rp.pid for rp in self.ranks if rp.popen.poll() is None])]
        signal_all(procs, signal.SIGSTOP)
        try:
            wait_stopped(procs)
            for pump in list(self._pumps):  # False after 2 s: a full queue of lines, judged as before
                pump.caught_up(timeout=2.0)
            self.partial_at_stop = [(rank, text) for rank, pump in zip(self._pump_ranks, self._pumps, strict=True)
                                    if (text := pump.partial())]
            self._read_stopped.extend(p for tail in self._tails for p in tail.poll(self.elapsed()))
            yield
        finally:
            for rp in self.ranks:
                signal_group(rp.popen, signal.SIGCONT)
            signal_all(procs, signal.SIGCONT)
            self.pauses.append((started, self.elapsed()))

    def unpaused(self, t: float) -> float:
        """Launch-clock time ``t`` less the :meth:`frozen` time before it."""
        return t - sum(end - start for start, end in self.pauses if end <= t)

    def stop(self, reason: str, sig: int = signal.SIGKILL) -> None:
        """End the attempt now on purpose (e.g. the resume check's kill after a step). The first
        reason stands: a callback that asks again for each later line (read after the stop, late
        on a loaded machine) must not rename it."""
        if self._stop_reason is None:
            self._stop_reason = reason
        for rp in self.ranks:
            self._killed.add(rp.rank)
            signal_group(rp.popen, sig)

    # -- running ---------------------------------------------------------------------------

    def run(self) -> RunResult:
        """Start the ranks, watch them until they end, tear everything down, return the result."""
        spec = self.spec
        spec.run_dir.mkdir(parents=True, exist_ok=True)
        reservation = reserve_port()
        self._port = reservation.port
        self._t0 = time.monotonic()
        self._gpu = GpuMemory.open()
        try:
            self._start(reservation.port)
            return self._monitor(reservation.port)
        finally:  # Ctrl-C and exceptions included: nothing outlives run()
            self._teardown()
            reservation.release()
            if self._gpu is not None:
                self._gpu.close()

    def _env_for(self, rank: int, port: int) -> dict[str, str]:
        spec = self.spec
        env = dict(os.environ)
        env.update(spec.env)
        if not spec.distributed_env:
            for name in TORCHRUN_ENV:
                env.pop(name, None)
            env.update({envvars.RUN_DIR: str(spec.run_dir), "PYTHONUNBUFFERED": "1"})
            return env
        env.update(
            {
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": str(spec.world_size),
                "LOCAL_WORLD_SIZE": str(spec.world_size),
                "GROUP_RANK": "0",
                "ROLE_RANK": str(rank),
                "ROLE_NAME": "default",
                "ROLE_WORLD_SIZE": str(spec.world_size),
                "GROUP_WORLD_SIZE": "1",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "TORCHELASTIC_RESTART_COUNT": str(spec.restart_count),
                "TORCHELASTIC_MAX_RESTARTS": str(spec.max_restarts),
                "TORCHELASTIC_RUN_ID": spec.run_id,
                envvars.RUN_DIR: str(spec.run_dir),
                "PYTHONUNBUFFERED": "1",  # metric lines must arrive as they are printed
            }
        )
        return env

    def _start(self, port: int) -> None:
        spec = self.spec
        argv = _python_argv(spec.argv)
        for rank in range(spec.world_size):
            out_log = spec.run_dir / f"rank{rank}.stdout.log"
            err_log = spec.run_dir / f"rank{rank}.stderr.log"
            try:
                # a Ctrl-C inside Popen (after the fork) or before the append would leave a rank
                # no teardown knows of: the signal waits until the rank is recorded
                with signals_deferred():
                    popen = subprocess.Popen(
                        argv,
                        cwd=spec.cwd,
                        env=self._env_for(rank, port),
                        stdin=subprocess.DEVNULL,
                        stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE,
                        start_new_session=True,  # own process group: teardown reaches its children
                        # SIGINT and SIGQUIT at their defaults, whatever this process has
                        preexec_fn=functools.partial(_prepare_rank, spec.preexec, rank),
                    )
                    self.ranks.append(RankProcess(rank, popen, out_log, err_log))
            except OSError as exc:
                self._teardown()
                if spec.cwd is not None and not Path(spec.cwd).is_dir():
                    raise FileNotFoundError(
                        f"cannot start the job: its working directory {spec.cwd} "
                        f"{'is not a directory' if Path(spec.cwd).exists() else 'does not exist'}. "
                        "Fix job.cwd (relative to the job file's directory)"
                    ) from None
                raise FileNotFoundError(
                    f"cannot start the job command {argv[0]!r} in {spec.cwd}: {exc.strerror}. "
                    "Fix job.command (is the program installed and on PATH?)"
                ) from None
            rp = self.ranks[-1]
            for stream_name, pipe, log in (("stdout", popen.stdout, out_log), ("stderr", popen.stderr, err_log)):
                assert pipe is not None
                pump = self._pump(rp, stream_name, pipe, log)
                thread = threading.Thread(target=pump.run, name=f"trainguard-rank{rank}-{stream_name}", daemon=True)
                thread.start()
                self._threads.append(thread)

    def _pump(self, rp: RankProcess, stream: str, pipe: IO[bytes], log: Path) -> LinePump:
        """What copies one stream to its (capped: ``log_limit_mb``) log and hands each line to the
        monitor; a failing write (a full disk) stops the log, never the pump (see ``ranklog``)."""
        limit = self.spec.log_limit_mb
        sink = RankLog(log, int(limit * 2**20) if limit else None)
        self._logs.append(sink)

        def line(text: str) -> None:
            if stream == "stderr":
                rp.stderr_tail.append(text[:2000])
                del rp.stderr_tail[:-_TAIL_LINES]
            self._events.put((stream, rp.rank, text, self.elapsed()))

        self._pumps.append(LinePump(pipe, sink, line, _MAX_LINE))
        self._pump_ranks.append(rp.rank)
        return self._pumps[-1]

    def _monitor(self, port: int) -> RunResult:
        """Watch the ranks until a stop condition fires, tear them down, read what they printed
        last, and return the result."""
        spec = self.spec
        parser = MetricParser(spec.metric_regexes)
        self._tails = [
            JsonlTail(self._metric_path(path, rank), [name], rank=rank)
            for name, path in spec.metric_files.items()
            for rank in range(spec.world_size)
        ]
        self.exit_seen_at.clear()
        conditions = stop_conditions(
            timeout=spec.timeout, stall_timeout=spec.stall_timeout, startup_timeout=spec.startup_timeout,
            shutdown_timeout=spec.shutdown_timeout, max_rss_mb=spec.max_rss_mb,
            end_after_step=spec.final_step if spec.end_after_final_step else None)
        stop: Stop | None = None
        while stop is None:
            stop = self._watch_once(parser, conditions)
        self._teardown()
        self._read_last_lines(parser)
        return self._result(port, stop)

    def _watch_once(self, parser: MetricParser, conditions: Sequence[StopCondition]) -> Stop | None:
        """One pass of the monitor: gather what happened, ask each stop condition in turn, act
        on the first that fires (a timeout or a hang first records each rank's activity and
        stacks, while the ranks still run)."""
        stop = first_stop(conditions, self._observe(parser))
        if stop is not None and stop.dump_ranks:
            # a hang: the ranks' agents are asked first, and answer while the stacks are dumped
            answers = self.spec.run_dir / STALL_DIR if stop.outcome == "hung" and self._agents_answer() else None
            asked_at = ask_ranks(answers) if answers is not None else time.monotonic()
            stop.evidence["ranks"] = rank_activity(self.ranks)
            stop.evidence["stacks"] = dump_stacks(self.ranks)
            if stop.outcome == "hung":
                found = self._attribute(answers, asked_at, stop.evidence["ranks"], stop.evidence["stacks"])
                stop.evidence["attribution"] = found.to_dict()
        return stop

    def _agents_answer(self) -> bool:
        """Whether the ranks run the agent that answers a stall (``stall_dir`` in its spec)."""
        return STALL_DIR in self.spec.env.get(envvars.RUN_HOOK, "")

    def _attribute(self, answers: Path | None, asked_at: float, activity: list[RankActivity],
                   stacks: dict[str, str]) -> StallAttribution:
        """The stall's culprit rank(s) (:mod:`trainguard.launch.stall_attribution`), with the
        seconds it added after the stack dump and since the ask."""
        started = time.monotonic()
        last: dict[int, int] = {}
        for point in self.points:
            last[point.rank] = max(last.get(point.rank, point.step), point.step)
        window = ANSWER_WINDOW_S if answers is not None else 0.0
        signals = collect_signals(answers or self.spec.run_dir / STALL_DIR, asked_at, activity, stacks, last, window)
        now = time.monotonic()
        return attribute(signals, took_s=now - started, since_ask_s=now - asked_at)

    def _observe(self, parser: MetricParser) -> Snapshot:
        """Read the lines and metric-file points that arrived (the ``on_metric`` callbacks run
        here), sample every rank's memory every ``_SCAN_S``, note each rank's exit."""
        self._drain_lines(parser)
        now = self.elapsed()
        self._handle(self._read_stopped)
        self._read_stopped = []
        for tail in self._tails:
            self._handle(tail.poll(now))
        memory_mb: dict[int, float] = {}
        if now - self._last_scan > _SCAN_S:
            memory_mb = self._sample_memory(self._scan_descendants())
            self._last_scan = now
        codes = {rp.rank: rp.popen.poll() for rp in self.ranks}
        for rank, code in codes.items():
            if code is not None and rank not in self.exit_seen_at:
                self.exit_seen_at[rank] = now
        progress = self._progress
        return Snapshot(
            now=now, exit_codes=codes, exit_seen_at=dict(self.exit_seen_at), stop_requested=self._stop_reason,
            memory_mb=memory_mb, killed=frozenset(self._killed), job_time=self.unpaused(now),
            resumed_at=self.pauses[-1][1] if self.pauses else 0.0, first_metric=progress.first_metric,
            last_progress=progress.last_progress, finished=progress.finished, points=self.points,
            last_step=dict(progress.last_step))

    def _drain_lines(self, parser: MetricParser) -> None:
        # drain output lines for at most one poll interval: a job printing more often than
        # that must not keep the monitor from checking exits, deadlines and stalls
        drain_until = time.monotonic() + _POLL_S
        try:
            while (wait := drain_until - time.monotonic()) > 0:
                self._take_line(parser, *self._events.get(timeout=wait))
        except queue.Empty:
            pass

    def _take_line(self, parser: MetricParser, stream: str, rank: int, line: str, t: float) -> None:
        if self.spec.echo is not None:
            self.spec.echo(rank, stream, line)
        self._handle(parser.parse(line, rank=rank, t=t))

    def _handle(self, points: list[MetricPoint]) -> None:
        final = self.spec.final_step if self.spec.end_after_final_step else None
        for point in points:
            self._progress.record(point)
            if final is not None and point.step > final:
                continue  # a run trainguard ends after final_step is steps 1..final_step, exactly
            self.points.append(point)
            for callback in list(self.on_metric):
                callback(point, self)

    def _read_last_lines(self, parser: MetricParser) -> None:
        """After the teardown: the pipes close once the processes (and their children holding
        them) are gone; the lines printed just before the end are parsed meanwhile (a full
        queue holds the pumps)."""
        join_until = time.monotonic() + 5
        while True:
            now = time.monotonic()
            waiting = now < join_until and any(thread.is_alive() for thread in self._threads)
            try:  # past the wait, what is queued is still parsed (a bounded while more)
                stream, rank, line, t = self._events.get(timeout=_POLL_S if waiting else 0)
            except queue.Empty:
                if waiting:
                    continue
                break
            if now > join_until + 5:
                break  # a pipe something outside the ranks keeps writing to
            self._take_line(parser, stream, rank, line, t)
        self._handle(self._read_stopped)
        for tail in self._tails:
            self._handle(tail.poll(self.elapsed()))

    def _result(self, port: int, stop: Stop) -> RunResult:
        spec = self.spec
        exits = []
        for rp in self.ranks:
            code = rp.popen.returncode
            exits.append(RankExit(rank=rp.rank, pid=rp.pid, returncode=code, signal=signal_name(code),
                                  killed_by_trainguard=rp.rank in self._killed))
        evidence = stop.evidence
        reason = log_evidence(self._logs, spec.run_dir, stop.outcome, stop.reason, evidence)
        tail_rank = stop.failed_rank if stop.failed_rank is not None else 0
        stderr_tail = "\n".join(self.ranks[tail_rank].stderr_tail) if self.ranks else ""
        first_metric = self._progress.first_metric
        if (stop.outcome == "failed" and spec.world_size == 1 and spec.distributed_env
                and first_metric is None):
            hint = distributed_env_hint(stderr_tail)
            if hint:
                reason = f"{reason}; {hint}"
                evidence["hint"] = hint
        pace = None  # stragglers named (docs/drills.md); the ranks may be a driver's (Ray Train's workers)
        if PACE_DIR in spec.env.get(envvars.RUN_HOOK, "") + spec.env.get(envvars.WORKER_RUN_HOOK, ""):
            pace = judged_pace(spec.run_dir / PACE_DIR)
            if pace is not None and pace.notable:
                evidence["pace"] = pace.to_dict()
        return RunResult(
            outcome=stop.outcome,
            argv=_python_argv(spec.argv),
            run_dir=spec.run_dir,
            world_size=spec.world_size,
            port=port,
            exits=exits,
            points=list(self.points),
            duration_s=self.elapsed(),
            first_metric_s=first_metric,
            reason=reason,
            failed_rank=stop.failed_rank,
            stderr_tail=stderr_tail,
            evidence=evidence,
            detected_after_s=stop.detected_after_s,
            peak_rss_mb=dict(self._peak_rss_mb),
            peak_gpu_mb=dict(self._peak_gpu_mb),
            pauses=list(self.pauses),
            pace=pace,
        )

    def _metric_path(self, template: str, rank: int) -> Path:
        path = Path(template.replace("{rank}", str(rank)))
        return path if path.is_absolute() else (self.spec.cwd or Path.cwd()) / path

    def _scan_descendants(self) -> dict[int, list[psutil.Process]]:
        """Record every rank's descendants; return each live rank's tree (rank first)."""
        trees: dict[int, list[psutil.Process]] = {}
        for rp in self.ranks:
            with contextlib.suppress(psutil.Error):
                root = psutil.Process(rp.pid)
                children = root.children(recursive=True)
                for child in children:
                    self._descendants.setdefault(child.pid, child)
                trees[rp.rank] = [root, *children]
        return trees

    def _sample_memory(self, trees: dict[int, list[psutil.Process]]) -> dict[int, float]:
        """Update the per-rank peaks; each rank's tree's resident memory now, in MB."""
        rss_by_rank: dict[int, float] = {}
        gpu_by_pid = self._gpu.used_mb_by_pid() if self._gpu is not None else {}
        for rank, procs in trees.items():
            rss = 0
            for proc in procs:
                with contextlib.suppress(psutil.Error):  # exited between the scan and now
                    rss += proc.memory_info().rss
            rss_mb = rss_by_rank[rank] = rss / 2**20
            self._peak_rss_mb[rank] = round(max(self._peak_rss_mb.get(rank, 0.0), rss_mb), 1)
            if gpu_by_pid:
                gpu_mb = sum(gpu_by_pid.get(p.pid, 0.0) for p in procs)
                self._peak_gpu_mb[rank] = round(max(self._peak_gpu_mb.get(rank, 0.0), gpu_mb), 1)
        return rss_by_rank

    def _live_descendants(self) -> list[psutil.Process]:
        # psutil.Process remembers its create time: a recycled pid is not mistaken for ours
        return [p for p in self._descendants.values() if process_running(p)]

    def _teardown(self) -> None:
        """SIGTERM every rank's process group, every descendant seen and every process that
        carries this run's environment (one that left the tree: a double fork, a new session),
        SIGKILL what is left after the grace period."""
        self._scan_descendants()
        for proc in carrying(envvars.RUN_DIR, str(self.spec.run_dir)) if self.spec.end_by_environment else ():
            self._descendants.setdefault(proc.pid, proc)
        alive = [rp for rp in self.ranks if rp.popen.poll() is None or group_alive(rp.popen.pid)]
        strays = self._live_descendants()
        if not alive and not strays:
            return
        for rp in alive:
            if rp.popen.poll() is None:
                self._killed.add(rp.rank)
            signal_group(rp.popen, signal.SIGTERM)
        signal_all(strays, signal.SIGTERM)
        deadline = time.monotonic() + self.spec.grace_period
        while time.monotonic() < deadline:
            if all(
                rp.popen.poll() is not None and not group_alive(rp.popen.pid) for rp in alive
            ) and not self._live_descendants():
                break
            time.sleep(_POLL_S)
        for rp in alive:
            signal_group(rp.popen, signal.SIGKILL)
        signal_all(self._live_descendants(), signal.SIGKILL)
        for rp in alive:
            with contextlib.suppress(subprocess.TimeoutExpired):
                rp.popen.wait(timeout=5)


def launch(spec: LaunchSpec) -> RunResult:
    """Run one attempt of ``spec`` to the end (see :class:`Launcher`)."""
    return Launcher(spec).run()
