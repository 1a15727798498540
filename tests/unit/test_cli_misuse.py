"""The ``trainguard`` command misused (issue 13, items 11, 13, 14 and 15): every bad argument,
report or file is a clean exit 2 naming it and saying what to do -- never a traceback -- and the
valid forms still work.

``main(argv)`` runs in-process here (argparse's own errors are ``SystemExit(2)``); nothing these
tests pass launches a run, except one promoted report submitted to a stand-in ``sbatch``.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from trainguard.cli import main
from trainguard.gate.provenance import provenance_for
from trainguard.tracking.store import ui_command

pytestmark = pytest.mark.timeout(60)

JOB = """\
job:
  name: toy
  command: "python -c pass"
  metrics:
    loss: 'step (?P<step>\\d+) loss (?P<value>\\S+)'
gate:
  queue: slurm
"""


def run_main(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """``main(argv)``'s exit code (argparse's ``SystemExit`` included), stdout and stderr."""
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 2
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return code, out, err


# --------------------------------------------------------------------------------------------
# trainguard submit REPORT (item 11)
# --------------------------------------------------------------------------------------------


@pytest.fixture
def promoted(tmp_path: Path) -> dict[str, Any]:
    """A promoted gate report of a real job file, as ``trainguard gate`` writes its keys."""
    job = tmp_path / "trainguard.yaml"
    job.write_text(JOB)
    return {
        "gate_report_version": 1, "job": "toy", "job_file": str(job), "verdict": "promote",
        "decision": {"verdict": "promote", "reasons": [], "notes": [], "fallbacks": [],
                     "recommended_world_size": None},
        "checks": [], "provenance": provenance_for(job).to_dict(),
        "capabilities": {"gpus": 0, "root": True, "ray": False}, "policy": {}, "sizing": None,
        "submission": None, "tracking_uri": None, "mlflow_session_run_id": None,
    }


def write_report(tmp_path: Path, data: Any) -> Path:
    path = tmp_path / "latest.json"
    path.write_text(json.dumps(data))
    return path


def test_a_valid_promoted_report_is_submitted(
    promoted: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # fake-sbatch: a stand-in for Slurm's sbatch (Slurm cannot run here) that prints a job id
    bin_dir = tmp_path / "fake-sbatch-bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text("#!/bin/sh\necho 4242\n")
    (bin_dir / "sbatch").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    code, out, _ = run_main(["submit", str(write_report(tmp_path, promoted)), "--wait", "0"], capsys)
    assert code == 0 and "job id: 4242" in out


@pytest.mark.parametrize(
    ("change", "needles"),
    [
        ({"decision": "promote"}, ["decision: is a JSON string ('promote')", "expected an object"]),
        ({"decision": {"reasons": "x"}}, ["decision.reasons: is 'x'", "list of strings"]),
        ({"verdict": "maybe"}, ["verdict: is 'maybe', expected promote or block"]),
        ({"verdict": None}, ["verdict: is a JSON null"]),
        ({"job_file": None}, ["job_file: missing"]),
        ({"provenance": None}, ["provenance: missing"]),
        ({"provenance": {"job_file": "x"}}, ["provenance: provenance record lacks job_file_sha256"]),
        ({"provenance": "NAN"}, ["provenance.created_at: is nan, expected a time in seconds"]),
        ({"job_file": ""}, ["job_file: is ''"]),
        ({"capabilities": {"gpus": "all"}}, ["capabilities.gpus: is 'all', expected a number"]),
        ({"sizing": {"recommended": 2}}, ["sizing: sizing.target: missing"]),
        ({"gate_report_version": 99}, ["gate_report_version: not a gate report of version 1 (found 99)"]),
        ({"job_file": "/nonexistent/trainguard.yaml"},
         ["job_file: the job file this report was made from cannot be loaded", "trainguard gate"]),
    ],
)
def test_a_mistyped_or_incomplete_report_exits_2_naming_the_key(
    promoted: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str],
    change: dict[str, Any], needles: list[str],
) -> None:
    data = {**promoted, **change}
    for key, value in change.items():
        if value is None and key in ("job_file", "provenance"):
            del data[key]
    if data.get("provenance") == "NAN":  # JSON's NaN, which json.loads reads: never stale
        data["provenance"] = {**promoted["provenance"], "created_at": float("nan")}
    report = write_report(tmp_path, data)
    code, _, err = run_main(["submit", str(report)], capsys)
    assert code == 2, err
    assert str(report) in err
    for needle in needles:
        assert needle in err


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        (None, "no such gate report; run `trainguard gate CONFIG` to write one"),
        ("DIR", "is a directory, not a gate report"),
        (b"not json at all", "not valid JSON"),
        (b'{"gate_report_version": 1, "verd', "not valid JSON"),  # truncated
        (b"[1, 2]", "holds a JSON list, not an object"),
        (b"\xff\xfe\x00garbage", "not UTF-8 text"),
        (b"[" * 100_000, "not valid JSON"),  # nested past the decoder's recursion limit
    ],
    ids=["missing", "directory", "not-json", "truncated", "list", "binary", "deep"],
)
def test_a_report_that_is_not_one_exits_2_naming_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: bytes | str | None, needle: str
) -> None:
    path = tmp_path / "latest.json"
    if content == "DIR":
        path.mkdir()
    elif isinstance(content, bytes):
        path.write_bytes(content)
    code, _, err = run_main(["submit", str(path)], capsys)
    assert code == 2 and str(path) in err and needle in err, err


def test_a_blocked_report_is_refused_with_exit_1(
    promoted: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = {**promoted, "verdict": "block",
            "decision": {**promoted["decision"], "verdict": "block", "reasons": ["smoke failed"]}}
    code, _, err = run_main(["submit", str(write_report(tmp_path, data))], capsys)
    assert code == 1 and "the gate blocked this job (smoke failed)" in err


def test_a_fifo_or_device_is_refused_without_reading_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    for path in (fifo, Path("/dev/zero")):  # a FIFO would block, /dev/zero never ends
        code, _, err = run_main(["submit", str(path)], capsys)
        assert code == 2 and "not a regular file" in err


# --------------------------------------------------------------------------------------------
# numbers and paths of the arguments (item 14)
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["check", "drill", "gate", "profile"])
@pytest.mark.parametrize("value", ["-1", str(2**70), "4294967296", "1.5", "abc", ""])
def test_a_seed_out_of_the_job_files_range_exits_2(
    command: str, value: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = run_main([command, str(tmp_path / "missing.yaml"), "--seed", value], capsys)
    assert code == 2
    assert "argument --seed" in err and "between 0 and 4294967295" in err, err


@pytest.mark.parametrize("value", ["0", "4294967295"])
def test_a_seed_in_range_is_accepted(value: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # accepted by argparse: the error is then the missing job file's
    code, _, err = run_main(["check", str(tmp_path / "missing.yaml"), "--seed", value], capsys)
    assert code == 2 and "--seed" not in err and "missing.yaml" in err


@pytest.mark.parametrize("command", ["check", "gate"])
def test_verbose_and_quiet_together_exit_2(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_main([command, "x.yaml", "-v", "-q"], capsys)
    assert code == 2 and "not allowed with argument -v/--verbose" in err


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["submit", "r.json", "--wait", "-5"], "argument --wait: invalid number of seconds '-5'"),
        (["submit", "r.json", "--wait", "nan"], "argument --wait: invalid number of seconds 'nan'"),
        (["submit", "r.json", "--wait", "inf"], "from 0 to 86400"),
        (["submit", ""], "argument REPORT: an empty path"),
        (["check", "x.yaml", "--report-json", ""], "argument --report-json: an empty path"),
        (["drill", "x.yaml", "--report-json="], "argument --report-json: an empty path"),
        (["check", ""], "argument CONFIG: an empty path"),
        (["check", "a\0b"], "argument CONFIG: invalid value 'a\\x00b': it holds a NUL byte"),
        (["profile", "x.yaml", "--world-sizes", "1,99999"], "expected integers from 1 to 1024"),
        (["profile", "x.yaml", "--world-sizes", "0"], "argument --world-sizes"),
        (["profile", "x.yaml", "--world-sizes", ","], "argument --world-sizes"),
        (["init", "x.py", "--world-size", "0"], "argument --world-size: invalid value '0'"),
        (["init", "x.py", "--world-size", str(10**20)], "at most 1024"),
        (["init", "x.py", "--name", "a\udcffb"], "argument --name: invalid value 'a\\udcffb': not UTF-8"),
    ],
)
def test_bad_numbers_and_paths_exit_2_naming_the_argument(
    argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = run_main(argv, capsys)
    assert code == 2 and needle in err, err


def test_the_seed_setting_follows_the_same_rule_in_a_real_pytest(tmp_path: Path) -> None:
    """TRAINGUARD_SEED and the trainguard_seed ini key (the plugin's own settings)."""
    (tmp_path / "test_x.py").write_text("def test_x():\n    pass\n")
    (tmp_path / "pytest.ini").write_text("[pytest]\ntrainguard_seed = 1180591620717411303424\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_")}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 4, done.stdout + done.stderr  # pytest's usage error
    assert "trainguard_seed" in done.stderr and "between 0 and 2**32-1" in done.stderr
    assert "Traceback" not in done.stderr
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
                          cwd=tmp_path, env={**env, "TRAINGUARD_SEED": "-1"}, capture_output=True,
                          text=True, timeout=60, check=False)
    assert done.returncode == 4 and "TRAINGUARD_SEED" in done.stderr, done.stderr
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
                          cwd=tmp_path, env={**env, "TRAINGUARD_SEED": "7"}, capture_output=True,
                          text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stdout + done.stderr  # the env wins over the bad ini value


def test_an_unwritable_report_path_from_the_ini_file_names_the_ini_key(tmp_path: Path) -> None:
    (tmp_path / "test_x.py").write_text("def test_x():\n    pass\n")
    (tmp_path / "pytest.ini").write_text("[pytest]\ntrainguard_report_json = /proc/x.json\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_")}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 4 and "Traceback" not in done.stderr, done.stdout + done.stderr
    assert "trainguard_report_json: cannot write the report to /proc/x.json (from the ini file)" in done.stderr


@pytest.mark.parametrize("argv", [["check", "x.yaml", "--only=--"], ["check", "x.yaml", "--report-json=--"],
                                  ["submit", "r.json", "--wait=--"], ["init", "x.py", "--name=--"]])
def test_an_option_given_a_lone_dashdash_exits_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """argparse hands ``--only=--`` an empty list (not a string); it crashed the check."""
    code, _, err = run_main(argv, capsys)
    option = argv[2].partition("=")[0]
    assert code == 2 and f"argument {option}: expected one argument" in err, err


def test_dashdash_after_the_options_still_ends_them(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_main(["check", "--", str(tmp_path / "missing.yaml")], capsys)
    assert code == 2 and "missing.yaml: file not found" in err, err


# --------------------------------------------------------------------------------------------
# the printed `mlflow ui` line (item 15)
# --------------------------------------------------------------------------------------------


def test_the_mlflow_ui_line_is_shell_quoted() -> None:
    uri = "sqlite:////tmp/my dir's/.trainguard/mlflow.db"
    line = ui_command(uri)
    assert shlex.split(line) == ["mlflow", "ui", "--backend-store-uri", uri]
    assert ui_command("sqlite:////tmp/plain/mlflow.db").endswith(" sqlite:////tmp/plain/mlflow.db")


def test_a_path_that_is_not_utf8_is_printed_escaped_under_a_strict_locale(tmp_path: Path) -> None:
    """A directory named with a byte that is not UTF-8 (a lone surrogate in Python) and a strict
    stdout (en_US.UTF-8): the report path is printed escaped, not a UnicodeEncodeError."""
    job_dir = Path(os.fsdecode(bytes(tmp_path) + b"/job\xffdir"))
    job_dir.mkdir()
    (job_dir / "trainguard.yaml").write_text(JOB)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_")}
    env.update(TRAINGUARD_TRACKING="off", PYTHONIOENCODING="utf-8:strict")
    done = subprocess.run([sys.executable, "-m", "trainguard.cli", "check", job_dir.name], cwd=tmp_path,
                          env=env, capture_output=True, text=True, errors="replace", timeout=60, check=False)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stdout + done.stderr
    assert "report: job\\udcffdir/.trainguard/report.json" in done.stdout


@pytest.mark.slow  # MLflow's import and store creation: several seconds
def test_check_prints_an_mlflow_ui_line_that_a_shell_reads_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    job_dir = tmp_path / "my dir's"
    job_dir.mkdir()
    (job_dir / "trainguard.yaml").write_text(JOB)
    monkeypatch.setenv("TRAINGUARD_TRACKING", "on")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    code, out, _ = run_main(["check", str(job_dir)], capsys)
    assert code == 0, out
    (line,) = [x for x in out.splitlines() if x.startswith("MLflow runs: ")]
    uri = f"sqlite:///{job_dir / '.trainguard' / 'mlflow.db'}"
    assert shlex.split(line.removeprefix("MLflow runs: ")) == ["mlflow", "ui", "--backend-store-uri", uri]


@pytest.mark.parametrize("bad", [-1, 2**70, True, 1.5])
def test_the_library_refuses_a_seed_out_of_range(bad: Any, tmp_path: Path) -> None:
    """``trainguard.session.check(..., seed=...)``, the library form of ``--seed``: same rule."""
    from trainguard.errors import ConfigError
    from trainguard.session import check, session_settings

    (tmp_path / "trainguard.yaml").write_text(JOB)
    with pytest.raises(ConfigError, match=r"seed: invalid seed .*between 0 and 2\*\*32-1"):
        check(tmp_path, seed=bad)
    assert not (tmp_path / ".trainguard" / "report.json").exists()
    assert session_settings(seed=4294967295, environ={}).seed == 4294967295
