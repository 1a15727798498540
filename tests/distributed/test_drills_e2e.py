"""Fault drills on real processes: real signals to real ranks under trainguard's launcher.

For each fault, the clean job passes its drill AND a planted defect is caught:

* kill_rank (recover): a job that only checkpoints at exit loses all progress on a restart;
* hang (fail_clean): a job whose ranks wait for a stuck peer without a timeout hangs instead of
  failing (its own collective timeout is what makes the clean job fail cleanly).

The job is tests/data/jobs/toy_train.py (no torch: a drill costs seconds); ``--sync-dir`` makes
every step a barrier of all ranks, like a collective. The 2-rank digits example runs the drills of
its own job file in the slow test at the end and in tests/benchmarks/bench_drills.py.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil
import pytest

from tests.helpers import report_evidence, signals_ignored
from trainguard.cli import main
from trainguard.config import load_config
from trainguard.drills import run_drill
from trainguard.report import CheckResult
from trainguard.run.runner import JobRunner
from trainguard.session import drill

if TYPE_CHECKING:
    from conftest import PatchedExample

pytestmark = pytest.mark.timeout(240)

JOBS = Path(__file__).resolve().parents[1] / "data" / "jobs"
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "digits"

JOB = """
job:
  name: toy-drills
  command: "python {script} --steps {{steps}} --seed {{seed}} --ckpt-dir {{checkpoint_dir}} --sleep 0.05 --sync-dir {{run_dir}}/sync --sync-timeout 2"
  resume_args: "--resume"
  world_size: 2
  env: {{OMP_NUM_THREADS: "1"}}
  metrics:
    loss: 'step (?P<step>\\d+) loss (?P<value>\\S+)'
  timeout: 60
  stall_timeout: 20
checks:
  drills:
"""


def job_file(tmp_path: Path, *drills: str) -> Path:
    path = tmp_path / "drills.trainguard.yaml"
    text = JOB.format(script=JOBS / "toy_train.py") + "".join(f"    - {d}\n" for d in drills)
    path.write_text(text)
    return path


def run(path: Path, name: str) -> CheckResult:
    job = load_config(path)
    spec = next(d for d in job.checks.drills if d.name == name)
    return run_drill(JobRunner(job), spec)


def no_stopped_leftovers(result: CheckResult) -> None:
    pid = report_evidence(result)["fault_evidence"].get("pid")
    if pid is None:
        return
    try:
        proc = psutil.Process(pid)
        assert proc.status() in (psutil.STATUS_ZOMBIE,) or "toy_train" not in " ".join(proc.cmdline())
    except psutil.NoSuchProcess:
        pass


#: the planted drill defects: a job that checkpoints only at exit, one whose peers wait forever
KILL_EXIT_ONLY_CHECKPOINT = ("{name: kill-exit-ckpt, fault: kill_rank, rank: 1, steps: 24, after_step: 6, "
                             "args: --ckpt-at-exit-only}")
HANG_WITHOUT_TIMEOUT = ("{name: no-timeout, fault: hang, rank: 1, steps: 24, after_step: 6, expect: fail_clean, "
                        "deadline: 4, args: --sync-timeout 0}")


def test_kill_rank_recover_passes_on_the_clean_job_and_catches_exit_only_checkpoints(tmp_path: Path) -> None:
    path = job_file(
        tmp_path,
        "{name: kill, fault: kill_rank, rank: 1, steps: 24, after_step: 6, max_lost_steps: 5}",
        KILL_EXIT_ONLY_CHECKPOINT,
    )
    clean = run(path, "kill")
    assert clean.status == "passed", clean.summary
    ev: dict[str, Any] = report_evidence(clean)
    assert ev["restarts"] == 1 and ev["lost_steps"] <= 5
    assert ev["first_exit"] == {"rank": 1, "returncode": -9}
    assert ev["attempts"][0]["outcome"] == "failed" and ev["attempts"][0]["failed_rank"] == 1
    assert 0 <= ev["detected_after_s"] < 2.0  # the watchdog polls every 50 ms; wide margin
    assert ev["trajectory"]["compared_steps"] == 24 and ev["trajectory"]["first_divergent_step"] is None
    assert ev["step_rate"]["before"] > 0 and ev["step_rate"]["after_restart"] > 0
    assert "recovered with 1 restart(s)" in clean.summary

    defect = run(path, "kill-exit-ckpt")
    assert defect.status == "failed", defect.summary
    assert "began again at step 1: no usable checkpoint, all progress lost" in defect.summary
    assert report_evidence(defect)["lost_steps"] >= 6
    assert report_evidence(defect)["likely_causes"]


def test_hang_recover_detects_the_stall_dumps_stacks_and_restarts(tmp_path: Path) -> None:
    # --sync-timeout 0: the peer waits without a timeout; trainguard's stall detection must act
    path = job_file(
        tmp_path,
        "{name: hang, fault: hang, rank: 1, steps: 24, after_step: 6, stall_timeout: 2, args: --sync-timeout 0}",
    )
    result = run(path, "hang")
    assert result.status == "passed", result.summary
    first = report_evidence(result)["attempts"][0]
    assert first["outcome"] == "hung"
    assert "no new metric line" in first["reason"]
    assert set(first["stacks"]) == {"0", "1"}
    if shutil.which("py-spy") or (Path(psutil.Process().exe()).parent / "py-spy").exists():
        # py-spy --nonblocking reads the SIGSTOPped rank too
        assert 1 in first["stacks_dumped"], first["stacks"]
    assert 1.5 < report_evidence(result)["detected_after_s"] < 6.0
    assert report_evidence(result)["restarts"] == 1
    assert report_evidence(result)["fault_evidence"]["state_after_stop"] == "stopped"
    no_stopped_leftovers(result)


def test_hang_fail_clean_passes_with_a_collective_timeout_and_catches_a_job_without_one(tmp_path: Path) -> None:
    path = job_file(
        tmp_path,
        "{name: timeout, fault: hang, rank: 1, steps: 24, after_step: 6, expect: fail_clean, deadline: 8}",
        HANG_WITHOUT_TIMEOUT,
    )
    clean = run(path, "timeout")
    assert clean.status == "passed", clean.summary
    assert report_evidence(clean)["first_exit"] == {"rank": 0, "returncode": 1}
    assert 1.5 < report_evidence(clean)["exit_after_s"] < 8
    assert "collective timed out" in report_evidence(clean)["failed_rank_stderr_after_fault"]
    assert report_evidence(clean)["checkpoint"] == {"intact": True, "resumed_from_step": 5}
    assert report_evidence(clean)["verification"]["outcome"] == "ok"

    defect = run(path, "no-timeout")
    assert defect.status == "failed", defect.summary
    assert "the job hung: no rank exited within 4 s of the fault" in defect.summary
    assert report_evidence(defect)["checkpoint"]["intact"]  # the checkpoint itself was fine
    no_stopped_leftovers(defect)


def test_fail_clean_takes_the_jobs_own_words_and_not_a_progress_bar(tmp_path: Path) -> None:
    """The timed-out rank says why in French, with none of the words an error report was once
    looked for in (issue 24): reported. One that writes only a tqdm bar and a warning: not."""
    path = job_file(
        tmp_path,
        "{name: say, fault: hang, rank: 1, steps: 12, after_step: 6, expect: fail_clean, deadline: 8, "
        "args: --on-sync-timeout say}",
        "{name: bar, fault: hang, rank: 1, steps: 12, after_step: 6, expect: fail_clean, deadline: 8, "
        "args: --on-sync-timeout progress}",
    )
    runner = JobRunner(load_config(path))  # one reference run for both drills
    job = load_config(path)
    said = run_drill(runner, next(d for d in job.checks.drills if d.name == "say"))
    assert said.status == "passed", said.summary
    assert report_evidence(said)["error_line"].startswith("toy_train : rang 0 : aucun pair n'a répondu")
    assert 'error reported ("toy_train : rang 0 : aucun pair' in said.summary
    bar = run_drill(runner, next(d for d in job.checks.drills if d.name == "bar"))
    assert bar.status == "failed", bar.summary
    assert "rank 0 exited with code 1 but wrote no error to stderr after the fault" in bar.summary
    assert "4.97it/s" in report_evidence(bar)["failed_rank_stderr_after_fault"]


def test_a_run_whose_only_drill_was_skipped_does_not_say_passed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fault cannot be injected on this machine (as disk_full without FUSE): the drill is
    skipped, and the run says SKIPPED, not PASSED: nothing was tested (issue 24)."""
    from trainguard.faults.base import FaultUnavailable
    from trainguard.faults.kill import KillRankFault
    from trainguard.report import SkipReason

    def unavailable(self: KillRankFault, ctx: object) -> None:
        raise FaultUnavailable("no way to kill here", needs=SkipReason.NEEDS_GPU)

    monkeypatch.setattr(KillRankFault, "setup", unavailable)
    path = job_file(tmp_path, "{name: kill, fault: kill_rank, rank: 1, steps: 8, after_step: 4}")
    assert main(["drill", str(path)]) == 0  # a skip fails nothing
    out = capsys.readouterr().out
    assert "SKIPPED drill:kill: kill_rank cannot be injected on this machine: no way to kill here" in out
    assert "SKIPPED: 1 drill(s)" in out and "PASSED" not in out
    saved = json.loads((tmp_path / ".trainguard" / "drills-report.json").read_text())
    assert saved["status"] == "skipped" and saved["checks"][0]["skip_reason"] == "needs_gpu"


def test_the_drill_command_and_library(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = job_file(tmp_path, "{name: kill, fault: kill_rank, rank: 0, steps: 24, after_step: 6, params: {signal: SIGTERM}}")
    assert main(["drill", str(path), "--only", "kill"]) == 0
    out = capsys.readouterr().out
    assert "PASSED  drill:kill: kill_rank on rank 0 after step 6" in out
    assert (tmp_path / ".trainguard" / "drills-report.json").is_file()
    assert main(["drill", str(path), "--only", "nope"]) == 2
    assert "drill(s) nope requested but not in checks.drills" in capsys.readouterr().err
    report = drill(path, report_json=str(tmp_path / "r.json"))
    assert [c.name for c in report.checks] == ["drill:kill"] and report.status == "passed"
    assert report_evidence(report.checks[0])["fault_evidence"]["signal"] == "SIGTERM"


def test_drills_from_pytest_items_and_the_fault_marker(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTEST_ADDOPTS", raising=False)
    job_file(pytester.path, "{name: kill, fault: kill_rank, rank: 1, steps: 24, after_step: 6}")
    shutil.move(pytester.path / "drills.trainguard.yaml", pytester.path / "trainguard.yaml")
    pytester.makeini("[pytest]\naddopts = -p no:hypothesispytest\n")
    pytester.makepyfile(
        test_user="""
        import pytest

        @pytest.mark.fault("kill_rank", rank=1, steps=24, after_step=6, signal="SIGINT")
        def test_survives_ctrl_c(tg_drill):
            result = tg_drill("trainguard.yaml", max_lost_steps=4)
            assert result.evidence.found.restarts == 1
            assert result.evidence.found.fault_evidence["signal"] == "SIGINT"

        @pytest.mark.fault("kill_rank", rank=1, steps=24, after_step=6)
        def test_catches_exit_only_checkpoints(tg_drill):
            result = tg_drill("trainguard.yaml", args=["--ckpt-at-exit-only"], must_pass=False)
            assert result.status == "failed" and "all progress lost" in result.summary

        def test_configured_drill_by_name(tg_drill):
            assert tg_drill("trainguard.yaml", "kill").status == "passed"

        def test_unrelated():
            pass
        """
    )
    # started as a shell's background job starts it (SIGINT and SIGQUIT ignored): the ranks get
    # them back at their defaults, so the SIGINT drill's signal lands
    with signals_ignored():
        result = pytester.runpytest_subprocess("-m", "fault", "-v", "-p", "no:randomly")
    result.stdout.fnmatch_lines(["*test_survives_ctrl_c PASSED*", "*test_catches_exit_only_checkpoints PASSED*",
                                 "*trainguard.yaml::drill:kill PASSED*", "*= trainguard =*",
                                 "FAILED  drill:test_catches_exit_only_checkpoints: *all progress lost*",
                                 "        reproduce: pytest test_user.py::test_catches_exit_only_checkpoints",
                                 "PASSED  drill:kill: kill_rank on rank 1 after step 6*"])
    result.assert_outcomes(passed=3, deselected=2)
    # without the marker, tg_drill runs a drill of the job file by name
    result = pytester.runpytest_subprocess("-k", "configured or unrelated", "-p", "no:randomly")
    result.assert_outcomes(passed=2, deselected=3)


@pytest.mark.slow
def test_the_digits_example_drills(tmp_path: Path) -> None:
    """The kill_rank and hang drills of examples/digits/trainguard.yaml on its 2-rank job."""
    root = Path(shutil.copytree(EXAMPLE, tmp_path / "digits",
                                ignore=shutil.ignore_patterns(".trainguard", "__pycache__")))
    report = drill(root / "trainguard.yaml", report_json=str(tmp_path / "r.json"))
    assert report.checks, "the example has no drills"
    for result in report.checks:
        assert result.status == "passed", f"{result.name}: {result.summary}"


DIGITS_JOB = r"""
job:
  name: digits-drills
  command: "python train.py --steps {steps} --ckpt-dir {checkpoint_dir} --seed {seed}"
  resume_args: "--resume"
  world_size: 2
  env: {OMP_NUM_THREADS: "1"}
  metrics: {loss: 'step (?P<step>\d+) loss (?P<value>\S+)'}
  timeout: 180
  stall_timeout: 60
checks:
  drills:
    - {name: kill, fault: kill_rank, rank: 1, steps: 60, after_step: 22}
    - {name: hang, fault: hang, rank: 1, steps: 60, after_step: 22, expect: fail_clean, deadline: 30}
"""

_EVERY_5 = "if args.ckpt_dir and (step % args.ckpt_every == 0 or step == args.steps):"
_INIT = 'dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")'


@pytest.mark.slow
@pytest.mark.parametrize(
    ("patches", "name", "status", "expected"),
    [
        # checkpoints only at exit: kill_rank recover loses all progress
        ({"train.py": (_EVERY_5, "if args.ckpt_dir and step == args.steps:")}, "kill", "failed", "all progress lost"),
        ({}, "kill", "passed", "all 60 steps match the uninterrupted run, final checkpoints equal"),
        # the shipped script has no collective timeout: gloo waits 30 min for the stopped peer
        ({}, "hang", "failed", "the job hung"),
        ({"train.py": (_INIT, _INIT[:-1] + ", timeout=__import__('datetime').timedelta(seconds=10))")},
         "hang", "passed", "error reported; resumed from checkpoint step"),
    ],
    ids=["kill-exit-only-ckpt", "kill-clean", "hang-no-timeout", "hang-with-timeout"],
)
def test_digits_drills_on_the_real_torch_job(
    patched_example: PatchedExample, patches: dict[str, tuple[str, str]], name: str, status: str, expected: str
) -> None:
    root = patched_example(patches, DIGITS_JOB)
    result = run(root / "trainguard.yaml", name)
    assert result.status == status and expected in result.summary, result.summary


@pytest.mark.parametrize("on_notice", ["ignore", "die"])
def test_a_kill_whose_signal_the_rank_ignores_tested_nothing(tmp_path: Path, on_notice: str) -> None:
    """A rank that ignores the drill's SIGTERM runs on to its last step and exits 0: before issue
    42 the recover drill PASSED ("the job completed without needing a restart"); the fault had no
    effect, so the drill is an error saying so. The same job dying of the signal recovers."""
    path = tmp_path / "ignore.trainguard.yaml"
    path.write_text(
        "job:\n  name: ignores-sigterm\n"
        f'  command: "python {JOBS / "toy_train.py"} --steps {{steps}} --seed {{seed}} --ckpt-dir '
        f'{{checkpoint_dir}} --sleep 0.05 --on-notice {on_notice}"\n'
        '  resume_args: "--resume"\n'
        "  metrics:\n    loss: 'step (?P<step>\\d+) loss (?P<value>\\S+)'\n"
        "  timeout: 60\n  stall_timeout: 20\n"
        "checks:\n  drills:\n"
        "    - {name: term, fault: kill_rank, rank: 0, steps: 30, after_step: 7, params: {signal: SIGTERM}}\n")
    result = run(path, "term")
    if on_notice == "ignore":
        assert result.status == "error", result.summary
        assert "the fault had no effect: rank 0 was sent SIGTERM after step 7" in result.summary
    else:
        assert result.status == "passed", result.summary
