"""The launcher with real rank processes: the torchrun contract, failure, hang, timeout and stop
detection, teardown that leaves nothing behind, metric parsing and port reservations.

Every scenario runs ``tests/data/jobs/toy_train.py`` with a unique ``--tag`` marker in its argv
(and in its grandchild's), so the ``no_orphans`` fixture can prove by a process scan that
nothing the scenario started outlives it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

import trainguard.launch.hang_evidence as hang_evidence_module
from tests.helpers import report_evidence, signals_ignored
from trainguard.errors import RankFailure
from trainguard.launch import (
    Launcher,
    LaunchSpec,
    MetricParser,
    MetricPoint,
    RunResult,
    launch,
    ports,
)
from trainguard.launch.metrics import JsonlTail, trajectory

TOY = Path(__file__).resolve().parents[1] / "data" / "jobs" / "toy_train.py"
LOSS = r"step (?P<step>\d+) loss (?P<value>\S+)"


# --------------------------------------------------------------------------------------------
# Helpers: a unique marker per test and a process scan for it
# --------------------------------------------------------------------------------------------


def _alive_with(marker: str) -> list[psutil.Process]:
    """Live (non-zombie) processes whose command line contains ``marker``."""
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        try:
            if proc.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            if any(marker in part for part in proc.info["cmdline"] or ()):
                found.append(proc)
        except psutil.Error:
            continue
    return found


def _live_children() -> set[int]:
    """The test process's live (non-zombie) children. Direct ones only: a service another test
    of this worker started (a Ray head, an MLflow server) starts processes of its own at any
    time, and those are no rank of ours (a rank is a direct child; what it spawns is checked by
    the marker and by the grandchildren tests)."""
    out = set()
    for child in psutil.Process().children():
        try:
            if child.status() != psutil.STATUS_ZOMBIE:
                out.add(child.pid)
        except psutil.Error:
            continue
    return out


@pytest.fixture
def marker() -> str:
    return f"tg-launcher-test-{uuid.uuid4().hex}"


def spawned_grandchildren(run_dir: Path) -> list[int]:
    """Pids of the grandchildren the ranks reported starting (``--spawn-child``)."""
    pids = []
    for log in sorted(run_dir.glob("rank*.stdout.log")):
        pids += [int(m) for m in re.findall(r"spawned grandchild (\d+)", log.read_text())]
    return pids


def assert_gone(pids: list[int]) -> None:
    for pid in pids:
        try:
            status = psutil.Process(pid).status()
        except psutil.NoSuchProcess:
            continue
        assert status == psutil.STATUS_ZOMBIE, f"grandchild {pid} is still {status}"


@pytest.fixture
def no_orphans(marker: str) -> Iterator[None]:
    """Asserts after the test that no process of the scenario survives (and kills any that do,
    so one failing test does not leak into the next)."""
    before = _live_children()
    yield
    survivors = _alive_with(marker)
    new_children = _live_children() - before
    for proc in survivors:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    assert not survivors, (
        f"processes outlived the launcher: {[p.info['cmdline'] for p in survivors]}"
    )
    assert not new_children, f"child processes of the test outlived the launcher: {new_children}"


def spec_for(
    tmp_path: Path,
    marker: str,
    *flags: str,
    world_size: int = 2,
    **overrides: Any,
) -> LaunchSpec:
    options: dict[str, Any] = {
        "argv": ["python", str(TOY), "--tag", marker, *flags],
        "run_dir": tmp_path / "run",
        "world_size": world_size,
        "metric_regexes": {"loss": LOSS},
        "timeout": 60.0,
        "stall_timeout": 20.0,
        "grace_period": 2.0,
    }
    options.update(overrides)
    return LaunchSpec(**options)


# --------------------------------------------------------------------------------------------
# A clean run and the torchrun contract
# --------------------------------------------------------------------------------------------


def test_clean_two_rank_run_gets_torchrun_env_logs_and_metric_points(
    tmp_path: Path, marker: str, no_orphans: None
) -> None:
    echoed: list[tuple[int, str, str]] = []
    spec = spec_for(
        tmp_path,
        marker,
        "--steps",
        "5",
        "--print-env",
        restart_count=1,
        max_restarts=3,
        run_id="run-abc",
        env={"TOY_EXTRA": "from-spec"},
        echo=lambda rank, stream, line: echoed.append((rank, stream, line)),
    )
    result = launch(spec)

    assert result.outcome == "ok", result.reason
    assert result.ok
    assert [(e.rank, e.returncode, e.signal, e.killed_by_trainguard) for e in result.exits] == [
        (0, 0, None, False),
        (1, 0, None, False),
    ]
    envs = []
    for rank in range(2):
        stdout = result.log_path(rank, "stdout").read_text()
        assert result.log_path(rank, "stderr").exists()
        assert f"rank {rank}/2 starting" in stdout
        env_line = next(line for line in stdout.splitlines() if line.startswith("env "))
        envs.append(json.loads(env_line[4:]))
    for rank, env in enumerate(envs):
        assert env["RANK"] == env["LOCAL_RANK"] == str(rank)
        assert env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == "2"
        assert env["MASTER_ADDR"] == "127.0.0.1"
        assert env["MASTER_PORT"] == str(result.port)
        assert env["TORCHELASTIC_RESTART_COUNT"] == "1"
        assert env["TORCHELASTIC_MAX_RESTARTS"] == "3"
        assert env["TORCHELASTIC_RUN_ID"] == "run-abc"
        assert env["TRAINGUARD_RUN_DIR"] == str(tmp_path / "run")
        assert env["executable"] == sys.executable  # `python` in argv is this interpreter
    assert 0 < result.port < 65536

    # one point per step per rank, stamped with the time it arrived
    assert sorted((p.rank, p.step) for p in result.points) == [
        (r, s) for r in range(2) for s in range(1, 6)
    ]
    for rank in range(2):
        times = [p.t for p in result.points if p.rank == rank]
        assert times == sorted(times)
        assert all(0 < t <= result.duration_s for t in times)
    assert result.first_metric_s == min(p.t for p in result.points)
    assert sorted(result.trajectory()) == [1, 2, 3, 4, 5]
    assert result.last_step == 5
    assert result.argv[0] == sys.executable
    assert (1, "stdout", "step 5 loss " + _loss_text(result, 1, 5)) in echoed


def _loss_text(result: RunResult, rank: int, step: int) -> str:
    point = next(p for p in result.points if p.rank == rank and p.step == step)
    return f"{point.value:.6f}"


def test_python_at_the_front_of_argv_means_this_interpreter(tmp_path: Path) -> None:
    for word in ("python", "python3"):
        spec = LaunchSpec(
            argv=[word, "-c", "import sys; print('exe', sys.executable)"], run_dir=tmp_path / word
        )
        result = launch(spec)
        assert result.ok, result.reason
        assert result.argv[0] == sys.executable
        assert f"exe {sys.executable}" in result.log_path(0, "stdout").read_text()
    # only the bare words are rewritten: an explicit interpreter path is left alone
    spec = LaunchSpec(argv=[sys.executable, "-c", "pass"], run_dir=tmp_path / "explicit")
    assert launch(spec).argv == [sys.executable, "-c", "pass"]


def test_a_command_that_cannot_start_is_a_clear_error(tmp_path: Path) -> None:
    spec = LaunchSpec(
        argv=["trainguard-no-such-program-xyz", "--steps", "1"], run_dir=tmp_path / "r"
    )
    with pytest.raises(
        FileNotFoundError, match="cannot start the job command 'trainguard-no-such-program-xyz'"
    ):
        launch(spec)
    # a missing working directory is named as such, with the key to fix (not job.command)
    gone = LaunchSpec(argv=[sys.executable, "-c", "pass"], run_dir=tmp_path / "r2", cwd=tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match=r"working directory .*nope does not exist\. Fix job\.cwd"):
        launch(gone)


def test_world_size_below_one_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="world_size must be >= 1, got 0"):
        Launcher(LaunchSpec(argv=["python", "-c", "pass"], run_dir=tmp_path, world_size=0))


# --------------------------------------------------------------------------------------------
# Failures: a dying rank, a killed rank, a hang, a timeout
# --------------------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_dying_rank_fails_the_attempt_fast_and_tears_down_the_others(
    tmp_path: Path, marker: str, no_orphans: None
) -> None:
    # the healthy rank alone would run 3000 * 0.02 s = 60 s
    spec = spec_for(
        tmp_path,
        marker,
        "--steps",
        "3000",
        "--sleep",
        "0.02",
        "--die-rank",
        "1",
        "--die-step",
        "5",
        "--spawn-child",
    )
    started = time.monotonic()
    result = launch(spec)
    wall = time.monotonic() - started

    assert result.outcome == "failed"
    assert result.failed_rank == 1
    assert result.reason == "rank 1 exited with code 3"
    assert "planted failure at step 5" in result.stderr_tail
    assert result.exits[1].returncode == 3 and not result.exits[1].killed_by_trainguard
    assert result.exits[0].killed_by_trainguard
    assert result.exits[0].returncode != 0
    # rank 1 died after ~4 steps (~0.1 s plus start-up): the attempt ends soon after, not in 60 s
    rank1_last = max(p.t for p in result.points if p.rank == 1)
    assert result.duration_s - rank1_last < 5.0, result.duration_s
    assert wall < 10.0
    assert result.detected_after_s is None  # a death is timed by the benchmark, from the kill
    assert max(p.step for p in result.points if p.rank == 0) < 500
    grandchildren = spawned_grandchildren(spec.run_dir)
    assert 1 <= len(grandchildren) <= 2  # rank 1's for sure; rank 0's unless it started late
    assert_gone(grandchildren)


def test_a_sigkilled_rank_is_reported_by_signal_name(
    tmp_path: Path, marker: str, no_orphans: None
) -> None:
    spec = spec_for(tmp_path, marker, "--steps", "3000", "--sleep", "0.02")
    launcher = Launcher(spec)

    def kill_rank_1(point: MetricPoint, running: Launcher) -> None:
        if point.rank == 1 and point.step == 3:
            running.kill_rank(1)  # a fault, as an injector would do it

    launcher.on_metric.append(kill_rank_1)
    result = launcher.run()

    assert result.outcome == "failed"
    assert result.failed_rank == 1
    assert result.reason == "rank 1 killed by SIGKILL"
    killed = result.exits[1]
    assert killed.signal == "SIGKILL" and killed.returncode == -signal.SIGKILL
    assert not killed.killed_by_trainguard
    assert killed.describe == "killed by SIGKILL"
    assert result.exits[0].killed_by_trainguard
    assert "(sent by trainguard)" in result.exits[0].describe
    assert result.duration_s < 10.0


#: a rank that says how it started (SIGINT: Python's KeyboardInterrupt handler, which Python
#: installs only when SIGINT is at its default; SIGQUIT: the default) and trains 300 steps of 0.02 s
DISPOSITIONS = """\
import signal, time
print("sigint", signal.getsignal(signal.SIGINT) is signal.default_int_handler,
      "sigquit", signal.getsignal(signal.SIGQUIT) is signal.SIG_DFL, flush=True)
for step in range(1, 300):
    print(f"step {step} loss 1.0", flush=True)
    time.sleep(0.02)
"""


def test_ranks_start_with_sigint_and_sigquit_at_their_defaults(
    tmp_path: Path, marker: str, no_orphans: None
) -> None:
    """A shell starts a background job with SIGINT and SIGQUIT ignored, and an ignored signal
    stays ignored across exec: a rank of such a launcher ignored a kill_rank drill's SIGINT and
    trained on. The ranks get their defaults back: the SIGINT ends the rank."""
    spec = LaunchSpec(argv=["python", "-c", DISPOSITIONS, marker], run_dir=tmp_path / "run",
                      metric_regexes={"loss": LOSS}, timeout=60.0, stall_timeout=20.0, grace_period=2.0)
    launcher = Launcher(spec)

    def interrupt(point: MetricPoint, running: Launcher) -> None:
        if point.step == 3:
            running.kill_rank(0, signal.SIGINT)  # a kill_rank drill with `signal: SIGINT`

    launcher.on_metric.append(interrupt)
    with signals_ignored():
        result = launcher.run()

    assert "sigint True sigquit True" in result.log_path(0, "stdout").read_text()
    assert result.outcome == "failed", result.reason
    assert "KeyboardInterrupt" in result.stderr_tail
    assert result.last_step is not None and result.last_step < 299


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("mode", "state"), [("stop", "stopped"), ("sleep", "sleeping")])
def test_a_hung_rank_is_detected_with_state_and_stack_evidence(
    tmp_path: Path, marker: str, no_orphans: None, mode: str, state: str
) -> None:
    spec = spec_for(
        tmp_path,
        marker,
        "--steps",
        "10",
        "--sleep",
        "0.02",
        "--hang-rank",
        "1",
        "--hang-step",
        "3",
        "--hang-mode",
        mode,
        "--spawn-child",
        stall_timeout=2.0,
    )
    result = launch(spec)

    assert result.outcome == "hung", result.reason
    assert result.reason.startswith("no new metric line for ")
    ranks = {entry["rank"]: entry for entry in report_evidence(result)["ranks"]}
    assert ranks[1]["state"] == state
    assert ranks[1]["pid"] == result.exits[1].pid
    stack = report_evidence(result)["stacks"]["1"]
    if hang_evidence_module.shutil.which("py-spy") or hang_evidence_module.sibling_script("py-spy"):
        assert "toy_train.py" in stack, stack  # py-spy read the stopped/sleeping rank's stack
    else:
        assert "py-spy not installed" in stack
    # rank 0 finished its 10 steps; rank 1 stopped after printing step 2
    assert max(p.step for p in result.points if p.rank == 1) == 2
    assert result.exits[0].returncode == 0
    assert result.exits[1].killed_by_trainguard
    assert result.detected_after_s is not None and result.detected_after_s < 3.0  # past the limit; polls every 50 ms
    # 2 s stall + 0.5 s activity sample + stack dump + teardown: far from a 60 s default
    assert result.duration_s < 20.0
    grandchildren = spawned_grandchildren(spec.run_dir)
    assert len(grandchildren) == 2
    assert_gone(grandchildren)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("faulthandler", [False, True])
def test_without_py_spy_only_a_rank_that_handles_sigusr1_gets_it(
    tmp_path: Path,
    marker: str,
    no_orphans: None,
    monkeypatch: pytest.MonkeyPatch,
    faulthandler: bool,
) -> None:
    # SIGUSR1's default action is to terminate: sent to a rank that did not register a handler
    # it would kill the rank (its exit then reads "killed by SIGUSR1", not by trainguard) and
    # fire whatever a job may have bound to SIGUSR1 (checkpoint-on-preemption handlers).
    monkeypatch.setattr(hang_evidence_module.shutil, "which", lambda name: None)
    monkeypatch.setattr(hang_evidence_module, "sibling_script", lambda name: None)
    flags = ["--steps", "10", "--sleep", "0.02", "--hang-rank", "1", "--hang-step", "3"]
    flags += ["--hang-mode", "sleep"] + (["--faulthandler"] if faulthandler else [])
    spec = spec_for(tmp_path, marker, *flags, stall_timeout=1.0)
    result = launch(spec)

    assert result.outcome == "hung", result.reason
    assert "py-spy not installed" in report_evidence(result)["stacks"]["1"]
    hung = result.exits[1]
    assert hung.killed_by_trainguard and hung.signal == "SIGTERM", hung
    stderr = result.log_path(1).read_text()
    if faulthandler:
        assert "SIGUSR1 sent: see its stderr log" in report_evidence(result)["stacks"]["1"]
        assert "toy_train.py" in stderr and "in main" in stderr  # the whole faulthandler dump
    else:
        assert "SIGUSR1" not in report_evidence(result)["stacks"]["1"]


@pytest.mark.timeout(60)
def test_an_attempt_past_its_timeout_is_ended(
    tmp_path: Path, marker: str, no_orphans: None
) -> None:
    spec = spec_for(
        tmp_path,
        marker,
        "--steps",
        "3000",
        "--sleep",
        "0.02",
        "--spawn-child",
        timeout=1.5,
        stall_timeout=None,
    )
    result = launch(spec)

    assert result.outcome == "timeout"
    assert result.reason == "the run exceeded its timeout of 1.5 s"
    assert {e["rank"] for e in report_evidence(result)["ranks"]} == {0, 1}
    assert all(e.killed_by_trainguard for e in result.exits)
    assert result.points, "the ranks made progress before the deadline"
    assert 1.5 <= result.duration_s < 10.0
    assert_gone(spawned_grandchildren(spec.run_dir))


def test_no_metric_line_since_launch_is_a_hang_too(
    tmp_path: Path, marker: str, no_orphans: None
) -> None:
    spec = spec_for(
        tmp_path,
        marker,
        world_size=1,
        stall_timeout=1.0,
        argv=["python", "-c", "import time; time.sleep(60)", marker],
    )
    result = launch(spec)
    assert result.outcome == "hung"
    assert "no new metric line since launch" in result.reason
    assert result.first_metric_s is None and result.points == []


# --------------------------------------------------------------------------------------------
# Stopping on purpose, and exceptions out of callbacks: nothing survives
# --------------------------------------------------------------------------------------------


def _printed_steps(run_dir: Path) -> int:
    """The newest step any rank has printed so far, from the logs (ahead of the monitor's queue)."""
    steps = [0]
    for log in run_dir.glob("rank*.stdout.log"):
        steps += [
            int(line.split()[1])
            for line in log.read_text().splitlines()
            if line.startswith("step ")
        ]
    return max(steps)


def test_stop_from_on_metric_after_step_k(tmp_path: Path, marker: str, no_orphans: None) -> None:
    after_step = 4
    spec = spec_for(tmp_path, marker, "--steps", "3000", "--sleep", "0.02", "--spawn-child")
    launcher = Launcher(spec)
    printed_at_stop: list[int] = []
    reporting: set[int] = set()

    def stop_after(point: MetricPoint, running: Launcher) -> None:
        reporting.add(point.rank)
        # both ranks up (and their grandchildren), as in a real job killed mid-training
        if point.step >= after_step and reporting == {0, 1} and not printed_at_stop:
            printed_at_stop.append(_printed_steps(spec.run_dir))
            running.stop(f"resume drill: killed after step {after_step}")

    launcher.on_metric.append(stop_after)
    result = launcher.run()

    assert result.outcome == "stopped"
    assert result.reason == "resume drill: killed after step 4"
    assert not result.ok
    assert result.failed_rank is None  # a deliberate stop blames no rank
    assert all(e.killed_by_trainguard and e.signal == "SIGKILL" for e in result.exits)
    # The ranks run ahead of the monitor by the lines still queued when it sees step 4 (a few
    # under load); once stop() is called they are killed: at most a step or two more.
    assert result.last_step is not None
    assert after_step <= printed_at_stop[0] <= result.last_step <= printed_at_stop[0] + 2
    assert result.duration_s < 15.0
    grandchildren = spawned_grandchildren(spec.run_dir)
    assert len(grandchildren) == 2
    assert_gone(grandchildren)


def test_the_first_stop_reason_stands(tmp_path: Path, marker: str, no_orphans: None) -> None:
    """A callback asks to stop for every line past its step (the canary's limit, the resume's
    kill): lines read after the stop must not rename why the run was stopped."""
    spec = spec_for(tmp_path, marker, "--steps", "3000", "--sleep", "0.02")
    launcher = Launcher(spec)

    def stop_after(point: MetricPoint, running: Launcher) -> None:
        if point.step >= 3:
            running.stop(f"stopped at step {point.step} of rank {point.rank}")
            running.stop("a later line")

    launcher.on_metric.append(stop_after)
    result = launcher.run()
    assert result.outcome == "stopped"
    assert result.reason is not None and result.reason.startswith("stopped at step 3 of rank "), result.reason


@pytest.mark.parametrize("error", [RuntimeError("callback bug"), KeyboardInterrupt()])
def test_an_exception_in_a_callback_propagates_after_teardown(
    tmp_path: Path, marker: str, no_orphans: None, error: BaseException
) -> None:
    spec = spec_for(tmp_path, marker, "--steps", "3000", "--sleep", "0.02", "--spawn-child")
    launcher = Launcher(spec)
    reporting: set[int] = set()

    def explode(point: MetricPoint, _running: Launcher) -> None:
        reporting.add(point.rank)
        if point.step >= 3 and reporting == {0, 1}:  # both ranks (and grandchildren) are up
            raise error

    launcher.on_metric.append(explode)
    started = time.monotonic()
    with pytest.raises(type(error)):
        launcher.run()
    assert time.monotonic() - started < 15.0
    grandchildren = spawned_grandchildren(spec.run_dir)
    assert len(grandchildren) == 2
    assert_gone(grandchildren)
    # the port reservation was released on the way out
    assert not (ports._DIR / str(launcher._port)).exists()


def test_grandchildren_of_a_clean_run_are_reaped(
    tmp_path: Path, marker: str, no_orphans: None
) -> None:
    # the ranks exit 0 while the grandchildren they started would sleep for 600 s
    spec = spec_for(tmp_path, marker, "--steps", "3", "--sleep", "0.02", "--spawn-child")
    result = launch(spec)
    assert result.outcome == "ok"
    assert [e.returncode for e in result.exits] == [0, 0]
    assert result.duration_s < 10.0  # the grandchildren hold the pipes; teardown closes them
    grandchildren = spawned_grandchildren(spec.run_dir)
    assert len(grandchildren) == 2
    assert_gone(grandchildren)


# a rank that leaves a process out of its tree (a double fork into a session of its own, as a
# daemon or `setsid cmd &` does) and exits at once, before any scan of its descendants
_DAEMONIZE = """
import os, sys
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(60)", sys.argv[1]])
    os._exit(0)
os.wait()
print("step 1 loss 1.0", flush=True)
"""


def test_a_process_that_left_the_rank_s_tree_does_not_outlive_the_run(
    tmp_path: Path, marker: str, no_orphans: None
) -> None:
    spec = LaunchSpec(argv=["python", "-c", _DAEMONIZE, marker], run_dir=tmp_path / "run", world_size=1,
                      metric_regexes={"loss": LOSS}, timeout=30.0, grace_period=2.0)
    result = launch(spec)
    assert result.outcome == "ok", result.reason
    assert _alive_with(marker) == []


# --------------------------------------------------------------------------------------------
# Metrics: regex lines, JSONL files, trajectories
# --------------------------------------------------------------------------------------------


def test_metric_parser_reads_named_groups_and_skips_what_is_not_a_number() -> None:
    parser = MetricParser({"loss": LOSS, "lr": r"step (?P<step>\d+) .*lr (?P<value>\S+)"})
    points = parser.parse("step 7 loss 0.25, lr 1e-3", rank=1, t=2.0)
    assert [(p.name, p.step, p.value, p.rank, p.t) for p in points] == [
        ("loss", 7, 0.25, 1, 2.0),
        ("lr", 7, 1e-3, 1, 2.0),
    ]
    nan = parser.parse("step 8 loss nan", rank=0, t=0.0)
    assert len(nan) == 1 and nan[0].value != nan[0].value
    assert parser.parse("step 9 loss oops", rank=0, t=0.0) == []
    assert parser.parse("epoch 1 done", rank=0, t=0.0) == []


def test_jsonl_tail_waits_for_the_newline_of_a_partial_line(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    tail = JsonlTail(path, ["loss"], rank=1)
    assert tail.poll(0.1) == []  # not written yet

    path.write_bytes(b'{"step": 1, "loss": 1.5}\n{"step": 2, "lo')
    first = tail.poll(1.0)
    assert [(p.step, p.value, p.rank, p.t) for p in first] == [(1, 1.5, 1, 1.0)]
    assert tail.poll(1.5) == []  # the half line is not parsed while it is incomplete

    with open(path, "ab") as handle:
        handle.write(b'ss": 1.25}\nnot json\n[1, 2]\n{"loss": 9.0}\n{"step": 3, "acc": 0.5}\n')
    second = tail.poll(2.0)
    assert [(p.name, p.step, p.value) for p in second] == [("loss", 2, 1.25)]

    with open(path, "ab") as handle:
        handle.write(b'{"step": 4, "loss": 0.75, "acc": 0.9}\n')
    both = JsonlTail(path, ["loss", "acc"], rank=0).poll(3.0)
    assert [(p.name, p.step) for p in both] == [
        ("loss", 1),
        ("loss", 2),
        ("acc", 3),
        ("loss", 4),
        ("acc", 4),
    ]


def test_jsonl_metric_files_are_followed_per_rank(
    tmp_path: Path, marker: str, no_orphans: None
) -> None:
    metrics_dir = tmp_path / "metrics"
    spec = spec_for(
        tmp_path,
        marker,
        "--steps",
        "6",
        "--sleep",
        "0.02",
        "--jsonl-dir",
        str(metrics_dir),
        metric_regexes={},
        metric_files={"loss": "metrics/metrics-rank{rank}.jsonl"},  # relative to cwd
        cwd=tmp_path,
    )
    result = launch(spec)
    assert result.outcome == "ok", result.reason
    assert sorted({(p.rank, p.step) for p in result.points}) == [
        (r, s) for r in range(2) for s in range(1, 7)
    ]
    assert sorted(result.trajectory("loss")) == list(range(1, 7))
    assert "step 1 loss" not in result.log_path(0, "stdout").read_text()


def test_trajectory_is_the_mean_over_ranks_and_the_latest_value_wins() -> None:
    points = [
        MetricPoint("loss", 1, 1.0, 0, 0.1),
        MetricPoint("loss", 1, 3.0, 1, 0.1),
        MetricPoint("loss", 2, 5.0, 0, 0.2),
        MetricPoint("loss", 2, 4.0, 0, 0.9),  # rank 0 printed step 2 again (a restart): latest wins
        MetricPoint("acc", 1, 0.5, 0, 0.1),
        MetricPoint("loss", 3, 2.0, 1, 0.3),  # only rank 1 printed step 3
    ]
    assert trajectory(points, "loss") == {1: 2.0, 2: 4.0, 3: 2.0}
    assert list(trajectory(reversed(points), "loss")) == [1, 2, 3]  # sorted by step
    assert trajectory(points, "acc") == {1: 0.5}
    assert trajectory(points, "missing") == {}


# --------------------------------------------------------------------------------------------
# Port reservations
# --------------------------------------------------------------------------------------------


@pytest.fixture
def port_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    directory = tmp_path / "ports"
    monkeypatch.setattr(ports, "_DIR", directory)
    return directory


def test_reserve_port_returns_a_bindable_port_and_release_frees_it(port_dir: Path) -> None:
    import socket

    with ports.reserve_port() as reservation:
        assert (port_dir / str(reservation.port)).read_text() == str(os.getpid())
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", reservation.port))
    assert not (port_dir / str(reservation.port)).exists()
    reservation.release()  # twice is fine


def test_concurrent_threads_never_share_a_port(
    port_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a pool much smaller than the demand forces collisions on every other probe
    pool = list(range(41000, 41040))
    rng_lock = threading.Lock()
    import random

    rng = random.Random(0)

    def probe(_host: str) -> int:
        with rng_lock:
            return rng.choice(pool)

    monkeypatch.setattr(ports, "_probe_free_port", probe)
    held: list[ports.PortReservation] = []
    errors: list[BaseException] = []
    barrier = threading.Barrier(8)
    lock = threading.Lock()

    def worker() -> None:
        try:
            barrier.wait()
            for _ in range(4):
                reservation = ports.reserve_port(attempts=500)
                with lock:
                    held.append(reservation)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    try:
        assert not errors
        got = [r.port for r in held]
        assert len(got) == 32
        assert len(set(got)) == 32, sorted(got)
    finally:
        for reservation in held:
            reservation.release()
    assert list(port_dir.iterdir()) == []


_RESERVER = textwrap.dedent(
    """
    import random, sys
    from pathlib import Path
    from trainguard.launch import ports

    ports._DIR = Path(sys.argv[1])
    pool = list(range(int(sys.argv[2]), int(sys.argv[2]) + int(sys.argv[3])))
    ports._probe_free_port = lambda host: random.choice(pool)
    held = [ports.reserve_port(attempts=2000) for _ in range(int(sys.argv[4]))]
    print(" ".join(str(r.port) for r in held), flush=True)
    sys.stdin.read()  # hold the reservations until the test closes our stdin
    """
)


@pytest.mark.timeout(60)
def test_concurrent_processes_never_share_a_port(port_dir: Path) -> None:
    port_dir.mkdir()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _RESERVER, str(port_dir), "42000", "30", "6"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(4)
    ]
    try:
        got: list[int] = []
        for proc in procs:
            assert proc.stdout is not None
            line = proc.stdout.readline()
            got += [int(p) for p in line.split()]
        assert len(got) == 24
        assert len(set(got)) == 24, sorted(got)
    finally:
        for proc in procs:
            assert proc.stdin is not None
            proc.stdin.close()
        for proc in procs:
            proc.wait(timeout=10)


def test_a_stale_reservation_of_a_dead_pid_is_taken_over(
    port_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    port_dir.mkdir()
    (port_dir / "43001").write_text(str(dead.pid))
    monkeypatch.setattr(ports, "_probe_free_port", lambda host: 43001)
    with ports.reserve_port(attempts=1) as reservation:
        assert reservation.port == 43001
        assert (port_dir / "43001").read_text() == str(os.getpid())


def test_a_reservation_of_a_live_process_is_respected(
    port_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    port_dir.mkdir()
    (port_dir / "43002").write_text(str(os.getppid()))  # alive: our parent
    probes = iter([43002, 43003])
    monkeypatch.setattr(ports, "_probe_free_port", lambda host: next(probes))
    with ports.reserve_port() as reservation:
        assert reservation.port == 43003
    assert (port_dir / "43002").read_text() == str(os.getppid())


def test_a_reservation_being_written_is_not_taken_over(
    port_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Between its O_EXCL create and writing its pid, another process's marker is empty. Taking
    # it over as "stale" would hand the same port to two launchers.
    port_dir.mkdir()
    (port_dir / "43004").write_text("")
    probes = iter([43004, 43005])
    monkeypatch.setattr(ports, "_probe_free_port", lambda host: next(probes))
    with ports.reserve_port() as reservation:
        assert reservation.port == 43005
    assert (port_dir / "43004").exists()


def test_reserve_port_gives_up_with_a_clear_error(
    port_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    port_dir.mkdir()
    (port_dir / "43006").write_text(str(os.getpid()))
    monkeypatch.setattr(ports, "_probe_free_port", lambda host: 43006)
    with pytest.raises(
        RuntimeError, match=r"could not reserve a free port on 127\.0\.0\.1 after 3 attempts"
    ):
        ports.reserve_port(attempts=3)


def test_raise_for_ranks_names_the_dead_rank_and_passes_a_clean_run(tmp_path: Path) -> None:
    dying = Launcher(LaunchSpec(
        argv=[sys.executable, "-c", "import os, sys; sys.exit(3 if os.environ['RANK'] == '1' else 0)"],
        run_dir=tmp_path / "dying", world_size=2, timeout=60,
    )).run()
    with pytest.raises(RankFailure, match=r"the toy run failed \(rank 1\)") as failure:
        dying.raise_for_ranks("the toy run")
    assert failure.value.result is dying and str(dying.run_dir) in str(failure.value)
    clean = Launcher(LaunchSpec(argv=[sys.executable, "-c", "pass"], run_dir=tmp_path / "clean",
                                timeout=60)).run()
    clean.raise_for_ranks()  # every rank exited 0: nothing raised


@pytest.mark.timeout(60)
@pytest.mark.parametrize("collective_timeout", [False, True])
def test_a_rank_that_exits_0_early_is_named_not_a_generic_hang(
    tmp_path: Path, marker: str, no_orphans: None, collective_timeout: bool
) -> None:
    """Rank 1 leaves the loop at step 3 with exit code 0 (a shorter data shard); rank 0 waits for
    it at its next barrier. Without a collective timeout the silence is a hang whose reason names
    the early exit first; with one, rank 0's failure says whom it waited for."""
    flags = ["--steps", "10", "--sleep", "0.02", "--sync-dir", str(tmp_path / "sync"),
             "--exit-early-rank", "1", "--exit-early-step", "3"]
    if collective_timeout:
        flags += ["--sync-timeout", "1"]
    result = launch(spec_for(tmp_path, marker, *flags, stall_timeout=2.0))
    early = report_evidence(result)["early_exit"]
    assert early["rank"] == 1 and early["last_step"] == 2 and early["waiting_ranks"] == [0], early
    if collective_timeout:
        assert result.outcome == "failed" and result.failed_rank == 0, result.reason
        assert "after rank 1 had exited 0 (after its step 2)" in result.reason
    else:
        assert result.outcome == "hung", result.reason
        assert result.reason.startswith("rank 1 exited 0 after its step 2"), result.reason
        assert "uneven data across ranks" in result.reason


@pytest.mark.timeout(60)
def test_ranks_that_all_finish_are_not_an_early_exit(tmp_path: Path, marker: str, no_orphans: None) -> None:
    result = launch(spec_for(tmp_path, marker, "--steps", "5", "--sync-dir", str(tmp_path / "sync")))
    assert result.ok and "early_exit" not in report_evidence(result)


# --------------------------------------------------------------------------------------------
# Frozen: every process stopped while a check copies a checkpoint (issue 29)
# --------------------------------------------------------------------------------------------


def test_frozen_stops_every_process_and_its_time_is_not_the_jobs(
    tmp_path: Path, marker: str, no_orphans: None
) -> None:
    seen: dict[str, Any] = {}

    def freeze_at_step_3(point: MetricPoint, launcher: Launcher) -> None:
        if point.step != 3 or "states" in seen:
            return
        with launcher.frozen():
            procs = [psutil.Process(rp.pid) for rp in launcher.ranks]
            procs += [c for p in procs for c in p.children(recursive=True)]
            seen["states"] = {p.pid: p.status() for p in procs}
            lines = len(launcher.points)
            time.sleep(2.5)  # longer than the stall limit: stopped time must not count as a stall
            seen["lines_while_stopped"] = len(launcher.points) - lines
        seen["after"] = [p.status() for p in procs if p.is_running()]

    # 40 steps: the job still runs when a loaded machine's launcher handles step 3's line late (with 12,
    # its rank had ended by then once, at load 2 in the full run: psutil.NoSuchProcess)
    spec = spec_for(tmp_path, marker, "--steps", "40", "--sleep", "0.05", "--workers", "1", "--spawn-child",
                    stall_timeout=1.5)
    launcher = Launcher(spec)
    launcher.on_metric.append(freeze_at_step_3)
    result = launcher.run()

    assert result.outcome == "ok", result.reason
    # the ranks, their worker and the grandchild (4+ processes) were all stopped, then went on
    assert len(seen["states"]) >= 4 and set(seen["states"].values()) == {psutil.STATUS_STOPPED}, seen
    assert seen["lines_while_stopped"] == 0
    assert psutil.STATUS_STOPPED not in seen["after"]
    (start, end), = result.pauses
    assert end - start >= 2.5
    # a metric time after the pause, less the pause: what the job itself spent
    last = max(p.t for p in result.points)
    assert launcher.unpaused(last) == pytest.approx(last - (end - start))
    assert launcher.unpaused(start) == start
