"""The ``trainguard`` console script, run as a user runs it: in a subprocess.

Exit codes are the contract CI relies on: 0 every check passed, 1 a check failed, 2 a usage or
job-file error (a message naming the file and the key, never a traceback), 130 interrupted
(SIGINT), 143 terminated (SIGTERM) -- and an interrupted run leaves no process of the job behind.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from trainguard._internal.signals import restore_default_signals
from trainguard._version import __version__
from trainguard.config import load_config

JOBS = Path(__file__).resolve().parents[1] / "data" / "jobs"
_SCRIPT = Path(sys.executable).parent / "trainguard"
TRAINGUARD = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "trainguard.cli"]


def run_cli(
    *args: str | Path, cwd: Path | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_")}
    env["TRAINGUARD_TRACKING"] = "off"  # tracking has its own tests (tests/unit/test_tracking.py)
    return subprocess.run(
        [*TRAINGUARD, *map(str, args)],
        cwd=cwd,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


@pytest.fixture
def jobs(tmp_path: Path) -> Path:
    """A private copy of the toy jobs (runs write ``.trainguard/`` next to the job file)."""
    return Path(shutil.copytree(JOBS, tmp_path / "jobs"))


def assert_usage_error(done: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert "Traceback" not in done.stderr + done.stdout
    for needle in needles:
        assert needle in done.stderr


# --------------------------------------------------------------------------------------------
# trainguard check: exit codes
# --------------------------------------------------------------------------------------------


def test_check_exits_0_when_every_check_passes(jobs: Path) -> None:
    done = run_cli("check", "toy.trainguard.yaml", cwd=jobs)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    # smoke judged determinism's 8-step uninterrupted run (issue 29), and resumed from a copy of
    # its last checkpoint
    assert lines[0].startswith("PASSED  smoke: 8 steps in") and "the uninterrupted run the other checks share" in lines[0], lines[0]
    assert lines[1].startswith(
        "PASSED  determinism: two runs with seed 0 match on all 8 steps of loss"
    )
    assert lines[-1] == "PASSED: 2 check(s); report: .trainguard/report.json"
    assert (jobs / ".trainguard" / "report.json").is_file()


def test_check_exits_1_on_a_nondeterministic_job_and_says_how_to_reproduce(
    jobs: Path, tmp_path: Path
) -> None:
    report = tmp_path / "report.json"
    done = run_cli("check", jobs / "nondet.trainguard.yaml", "--seed", "5", "--report-json", report)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "FAILED  determinism: loss differs from step 1 on (" in done.stdout
    assert "with the same seed 5" in done.stdout
    assert "unseeded RNG" in done.stdout
    assert "reproduce: run twice and diff: " in done.stdout
    assert "toy_train.py --steps 6 --seed 5 " in done.stdout
    assert done.stdout.rstrip().splitlines()[-1].startswith("FAILED: 1 check(s); report: ")
    assert report.is_file()
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize(("flags", "code", "last"), [
    ("", 0, "passed"), pytest.param(" --nondet", 1, "failed", marks=pytest.mark.slow)],
                         ids=["clean", "nondeterministic"])
def test_a_stdout_closed_after_the_first_line_stops_nothing(jobs: Path, flags: str, code: int, last: str) -> None:
    """`trainguard check job | head -1`: the reader leaves after smoke's verdict line; determinism
    still runs, the report is written and the exit is the checks' own (issue 24: it was 2, the
    broken pipe blamed on the disk, with no report)."""
    job = jobs / "toy.trainguard.yaml"
    job.write_text(job.read_text().replace("--sleep 0.02", "--sleep 0.02" + flags))
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_")}
    env["TRAINGUARD_TRACKING"] = "off"
    cli = subprocess.Popen([*TRAINGUARD, "check", str(job)], env=env, stdin=subprocess.DEVNULL,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert cli.stdout is not None and cli.stderr is not None
        first = cli.stdout.readline()
        cli.stdout.close()  # `head -1` exits
        assert cli.wait(timeout=60) == code, cli.stderr.read()
        err = cli.stderr.read()
    finally:
        if cli.poll() is None:
            cli.kill()
            cli.wait()
    assert first.startswith("PASSED  smoke:"), first
    assert "Broken pipe" not in err and "Traceback" not in err, err
    report = json.loads((jobs / ".trainguard" / "report.json").read_text())
    assert [(c["name"], c["status"]) for c in report["checks"]] == [("smoke", "passed"), ("determinism", last)]


def test_check_accepts_a_directory_and_verbose_streams_rank_output(jobs: Path) -> None:
    (jobs / "die.trainguard.yaml").rename(jobs / "trainguard.yaml")
    done = run_cli("check", jobs, "-v")
    assert done.returncode == 1
    assert "FAILED  smoke: the job did not complete: rank 1 exited with code 3" in done.stdout
    assert "[rank0 stdout] step 1 loss " in done.stderr
    assert "[rank1 stderr] toy_train: rank 1: planted failure at step 3" in done.stderr


def test_quiet_prints_only_the_verdicts(jobs: Path) -> None:
    done = run_cli("check", jobs / "skip.trainguard.yaml", "-q")
    assert done.returncode == 1
    assert "FAILED  smoke: no `loss` line for step(s) [3]" in done.stdout
    assert "reproduce:" not in done.stdout and "run_dir:" not in done.stdout


def test_check_of_a_missing_file_exits_2_naming_it(tmp_path: Path) -> None:
    missing = tmp_path / "nope.trainguard.yaml"
    assert_usage_error(run_cli("check", missing), str(missing), "file not found")


def test_check_of_a_directory_without_a_job_file_exits_2(tmp_path: Path) -> None:
    assert_usage_error(
        run_cli("check", tmp_path), str(tmp_path), "no trainguard.yaml or trainguard.yml"
    )


def test_check_of_invalid_yaml_exits_2_naming_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "trainguard.yaml"
    path.write_text("job:\n  name: toy\n  command: [python\n")
    assert_usage_error(run_cli("check", path), f"trainguard: error: {path}: invalid YAML at line")


def test_check_of_an_invalid_value_exits_2_naming_the_key(jobs: Path) -> None:
    path = jobs / "toy.trainguard.yaml"
    path.write_text(path.read_text().replace("world_size: 2", "world_size: 0"))
    assert_usage_error(run_cli("check", path), str(path), "job.world_size", "expected a value >= 1")


def test_check_of_an_unknown_key_suggests_the_right_one(jobs: Path) -> None:
    path = jobs / "toy.trainguard.yaml"
    path.write_text(path.read_text().replace("world_size: 2", "world_sise: 2"))
    assert_usage_error(
        run_cli("check", path), str(path), "unknown key 'world_sise'", "did you mean 'world_size'"
    )


def test_check_with_an_unknown_only_name_exits_2(jobs: Path) -> None:
    done = run_cli("check", jobs / "toy.trainguard.yaml", "--only", "smoke", "--only", "bogus")
    assert_usage_error(done, "toy.trainguard.yaml", "unknown check name(s) bogus", "known: smoke")
    assert not (jobs / ".trainguard" / "report.json").exists()  # nothing ran
    # a comma-separated list is split: the unknown one is named alone
    done = run_cli("check", jobs / "toy.trainguard.yaml", "--only", "smoke,bogus")
    assert_usage_error(done, "unknown check name(s) bogus;", "known: smoke")


def test_bad_arguments_exit_2_with_usage() -> None:
    done = run_cli("check")
    assert_usage_error(
        done, "usage: trainguard check", "the following arguments are required: CONFIG"
    )
    assert_usage_error(run_cli("frobnicate"), "invalid choice: 'frobnicate'")
    assert_usage_error(run_cli("check", "x.yaml", "--seed", "abc"), "argument --seed: invalid seed 'abc'")


def test_an_invalid_setting_in_the_environment_exits_2(jobs: Path) -> None:
    env = {**os.environ, "TRAINGUARD_TIMEOUT_SCALE": "fast"}
    done = subprocess.run(
        [*TRAINGUARD, "check", str(jobs / "toy.trainguard.yaml")],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert_usage_error(done, "TRAINGUARD_TIMEOUT_SCALE", "'fast'")


# --------------------------------------------------------------------------------------------
# help, version
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("command", "options"),
    [
        ((), ("check", "init", "version", "--version")),
        (("check",), ("CONFIG", "--only", "--report-json", "--seed", "--verbose", "--quiet")),
        (
            ("init",),
            (
                "SCRIPT",
                "--dir",
                "--name",
                "--steps-flag",
                "--ckpt-flag",
                "--seed-flag",
                "--resume-flag",
                "--loss-regex",
                "--world-size",
                "--yes",
                "--force",
            ),
        ),
        (("version",), ("Print the trainguard version",)),
    ],
)
def test_help_lists_every_option(command: tuple[str, ...], options: tuple[str, ...]) -> None:
    done = run_cli(*command, "--help")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: trainguard")
    for option in options:
        assert option in done.stdout, option


def test_version() -> None:
    for args in (("version",), ("--version",)):
        done = run_cli(*args)
        assert done.returncode == 0
        assert done.stdout.strip() == f"trainguard {__version__}"


_ENTRY = """
import atexit, sys, threading, time
from concurrent.futures import ThreadPoolExecutor
from trainguard.cli import entry
atexit.register(lambda: print("exit handler ran", flush=True))
def late():
    time.sleep(0.5)
    print("thread finished", flush=True)
threading.Thread(target=late).start()
pool = ThreadPoolExecutor(1)
pool.submit(int).result()  # never shut down: its idle worker waits for the exit
sys.stdout.write("unflushed ")
sys.argv = ["trainguard", *sys.argv[1:]]
entry()
"""


@pytest.mark.parametrize(("args", "code"), [(("version",), 0), (("check", "missing.yaml"), 2)])
def test_the_console_script_exits_with_mains_code_after_the_exit_handlers(
    tmp_path: Path, args: tuple[str, ...], code: int
) -> None:
    """The console script ends with os._exit (no interpreter shutdown): the code is main's, the
    exit handlers ran, a thread still running was waited for, an executor never shut down did not
    hold it up, buffered output was written."""
    done = subprocess.run([sys.executable, "-c", _ENTRY, *args], cwd=tmp_path, capture_output=True,
                          text=True, timeout=60, check=False)
    assert done.returncode == code, (done.stdout, done.stderr)
    assert done.stdout.startswith("unflushed ")
    assert "thread finished" in done.stdout and done.stdout.rstrip().endswith("exit handler ran")
    assert ("trainguard " + __version__ in done.stdout) if code == 0 else ("missing.yaml" in done.stderr)


def test_no_command_prints_help_and_exits_2() -> None:
    done = run_cli()
    assert done.returncode == 2
    assert "usage: trainguard" in done.stdout


# --------------------------------------------------------------------------------------------
# trainguard init
# --------------------------------------------------------------------------------------------


@pytest.fixture
def project(tmp_path: Path) -> Path:
    directory = tmp_path / "project"
    directory.mkdir()
    shutil.copy(JOBS / "toy_train.py", directory / "toy_train.py")
    return directory


def test_init_writes_a_job_file_that_loads_and_runs(project: Path) -> None:
    done = run_cli(
        "init", "toy_train.py", "--dir", project, "--name", "toyjob", "--world-size", "2", "--yes"
    )
    assert done.returncode == 0, done.stderr
    yaml_path = project / "trainguard.yaml"
    test_path = project / "tests" / "test_trainguard_job.py"
    assert f"wrote {yaml_path} and {test_path}" in done.stdout

    job_file = load_config(yaml_path)
    assert job_file.job.name == "toyjob"
    assert job_file.job.world_size == 2
    assert job_file.job.command == [
        "python",
        "toy_train.py",
        "--steps",
        "{steps}",
        "--ckpt-dir",
        "{checkpoint_dir}",
        "--seed",
        "{seed}",
    ]
    assert job_file.job.resume_args == ["--resume"]
    assert [name for name, _ in job_file.enabled_checks()] == ["smoke", "canary", "determinism", "resume"]
    source = test_path.read_text()
    compile(source, str(test_path), "exec")
    assert "@pytest.mark.smoke" in source and "@pytest.mark.determinism" in source

    # what init wrote drives the real script end to end
    run = run_cli("check", yaml_path, "--only", "smoke")
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.startswith("PASSED  smoke: 5 steps in")


def test_init_takes_custom_flags_and_regex(project: Path) -> None:
    done = run_cli(
        "init",
        "toy_train.py",
        "--dir",
        project,
        "--yes",
        "--steps-flag",
        "--max-steps",
        "--ckpt-flag",
        "--out",
        "--seed-flag",
        "--rng",
        "--resume-flag",
        "--continue",
        "--loss-regex",
        r"it (?P<step>\d+): (?P<value>\S+) 'x'",
    )
    assert done.returncode == 0, done.stderr
    job = load_config(project / "trainguard.yaml").job
    assert job.name == "toy_train"
    assert job.command[2:] == [
        "--max-steps",
        "{steps}",
        "--out",
        "{checkpoint_dir}",
        "--rng",
        "{seed}",
    ]
    assert job.resume_args == ["--continue"]
    assert job.metrics["loss"] == r"it (?P<step>\d+): (?P<value>\S+) 'x'"


def test_init_refuses_to_overwrite_without_force(project: Path) -> None:
    assert run_cli("init", "toy_train.py", "--dir", project, "--yes").returncode == 0
    yaml_path = project / "trainguard.yaml"
    yaml_path.write_text(yaml_path.read_text().replace("name: toy_train", "name: edited"))

    again = run_cli("init", "toy_train.py", "--dir", project, "--yes", "--name", "other")
    assert_usage_error(again, str(yaml_path), "already exists; pass --force to overwrite it")
    assert load_config(yaml_path).job.name == "edited"

    forced = run_cli(
        "init", "toy_train.py", "--dir", project, "--yes", "--name", "other", "--force"
    )
    assert forced.returncode == 0, forced.stderr
    assert load_config(yaml_path).job.name == "other"


def test_init_with_a_missing_script_exits_2(project: Path) -> None:
    done = run_cli("init", "missing_train.py", "--dir", project, "--yes")
    assert_usage_error(done, "training script 'missing_train.py' not found")
    assert not (project / "trainguard.yaml").exists()


def test_init_with_a_regex_lacking_groups_writes_nothing(project: Path) -> None:
    done = run_cli("init", "toy_train.py", "--dir", project, "--yes", "--loss-regex", r"loss (\S+)")
    assert_usage_error(done, "job.metrics.loss", "lacks the named group(s) step, value")
    assert not (project / "trainguard.yaml").exists()
    assert not (project / "tests").exists()


# --------------------------------------------------------------------------------------------
# Interrupts: exit 130 (SIGINT) or 143 (SIGTERM) and nothing of the job survives
# --------------------------------------------------------------------------------------------


def _alive_with(marker: str, exclude: set[int]) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        try:
            if proc.pid in exclude or proc.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            if any(marker in part for part in proc.info["cmdline"] or ()):
                found.append(proc)
        except psutil.Error:
            continue
    return found


@pytest.mark.timeout(90)
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_interrupt_exits_130_or_143_and_leaves_no_process_of_the_job(
    jobs: Path, tmp_path: Path, sig: signal.Signals
) -> None:
    # long.trainguard.yaml runs 600 steps of 0.05 s per rank and starts a grandchild per rank;
    # every one of them has the job directory (a unique tmp path) in its argv.
    marker = str(jobs)
    stderr_path = tmp_path / "stderr.log"
    with open(stderr_path, "w") as stderr:
        cli = subprocess.Popen(
            [*TRAINGUARD, "check", str(jobs / "long.trainguard.yaml"), "-v"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            preexec_fn=restore_default_signals,  # Ctrl-C's own state, whatever pytest has
        )
    try:
        deadline = time.monotonic() + 30
        while "[rank1 stdout] step 2 loss" not in stderr_path.read_text():
            assert cli.poll() is None, stderr_path.read_text()
            assert time.monotonic() < deadline, "the job printed no metric line in 30 s"
            time.sleep(0.05)
        family = psutil.Process(cli.pid).children(recursive=True)
        job_procs = [p for p in family if any(marker in part for part in p.cmdline())]
        assert len(job_procs) >= 4, [p.cmdline() for p in job_procs]  # 2 ranks + 2 grandchildren

        sent = time.monotonic()
        cli.send_signal(sig)
        cli.communicate(timeout=30)
        took = time.monotonic() - sent
    finally:
        if cli.poll() is None:
            cli.kill()
            cli.wait()
    stderr_text = stderr_path.read_text()

    assert cli.returncode == {signal.SIGINT: 130, signal.SIGTERM: 143}[sig], stderr_text
    assert took < 10.0, took  # teardown is SIGTERM + a short wait, not the job's 30 s
    what = "interrupted" if sig == signal.SIGINT else "terminated (SIGTERM)"
    assert f"trainguard: {what}; every process it started has been stopped" in stderr_text
    assert "Traceback" not in stderr_text
    survivors = _alive_with(marker, exclude={os.getpid()})
    for proc in survivors:
        proc.kill()
    assert not survivors, [p.info["cmdline"] for p in survivors]
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in job_procs)
