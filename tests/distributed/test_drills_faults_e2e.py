"""Drills of the oom, disk_full and network faults on real processes, through ``run_drill``.

Each fault: the clean job passes its drill AND a planted defect is caught --

* oom (fail_clean): the kernel (cgroup) or the allocator ends the rank, the job fails cleanly and
  resumes from its checkpoint; a job that swallows the OOM and carries on is caught;
* disk_full (fail_clean; the FUSE layer and the hook mode, both deterministic): a job that
  writes checkpoints atomically keeps the previous one, at 4 KB to 50 MB; a job that overwrites
  in place leaves a torn checkpoint the resume trips over;
* network (continue, a ``timeout`` toxic that holds the job's requests on their way to the
  service): a job whose calls have a timeout keeps training; one without a timeout stalls for as
  long as the service does; a fast job that ends its steps inside the fault window has continued
  if it exits within the deadline of its last step.

The jobs are pure Python (tests/data/jobs/toy_train.py, tests/data/faults/http_job.py): a drill
costs seconds. The toy job's ranks end each step in a barrier (``--sync-dir``), as a DDP job's
all-reduce makes them: without it a loaded machine let rank 1 lag three steps behind, still
writing step 5's checkpoint when the disk filled after rank 0's step 7, and the resume rightly
began again. The fault-level behaviour (cgroup counters, the FUSE layer, every toxic) is tested in
tests/unit/test_faults_*.py, test_fault_hook.py and test_network_fault.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.helpers import report_evidence
from trainguard.config import load_config
from trainguard.drills import run_drill
from trainguard.faults.fusefs import fuse_unavailable
from trainguard.report import CheckResult
from trainguard.run.runner import JobRunner

pytestmark = pytest.mark.timeout(240)

DATA = Path(__file__).resolve().parents[1] / "data"

TOY = """
job:
  name: toy-faults
  command: "python {script} --steps {{steps}} --seed {{seed}} --ckpt-dir {{checkpoint_dir}} --sleep 0.1 --sync-dir {{run_dir}}/sync"
  resume_args: "--resume"
  world_size: 2
  metrics:
    loss: 'step (?P<step>\\d+) loss (?P<value>\\S+)'
  timeout: 60
  stall_timeout: 30
checks:
  drills:
"""

HTTP = """
job:
  name: http-faults
  command: "python {script} --steps {{steps}} --ckpt-dir {{checkpoint_dir}} --sleep 0.05"
  resume_args: "--resume"
  env: {{TRAINGUARD_PROXY_ADDR: "{service}"}}
  metrics:
    loss: 'step (?P<step>\\d+) loss (?P<value>\\S+)'
  timeout: 60
  stall_timeout: 30
checks:
  drills:
"""


def drill_job(tmp_path: Path, template: str, drill: str, **fmt: Any) -> Path:
    """The job file of ``template`` with the one drill ``drill``, in ``tmp_path``."""
    path = tmp_path / "trainguard.yaml"
    path.write_text(template.format(**fmt) + f"    - {drill}\n")
    return path


def toy_drill_job(tmp_path: Path, drill: str) -> Path:
    return drill_job(tmp_path, TOY, drill, script=DATA / "jobs" / "toy_train.py")


def run(tmp_path: Path, template: str, drill: str, **fmt: Any) -> CheckResult:
    job = load_config(drill_job(tmp_path, template, drill, **fmt))
    runner = JobRunner(job)
    try:
        return run_drill(runner, job.checks.drills[0])
    finally:
        runner.close()


def toy(tmp_path: Path, drill: str) -> CheckResult:
    return run(tmp_path, TOY, drill, script=DATA / "jobs" / "toy_train.py")


#: the planted defect: the job catches the OOM error and trains on
OOM_SWALLOWED = ("{name: oom, fault: oom, rank: 1, steps: 14, after_step: 7, "
                 "expect: fail_clean, deadline: 6, params: {mode: raise}, args: --swallow-oom}")


@pytest.mark.parametrize("defect", [False, True], ids=["clean", "swallows-oom"])
def test_oom_fail_clean(tmp_path: Path, defect: bool) -> None:
    if defect:  # the job's own code sees the error: the start-up hook raises it at step 7
        result = toy(tmp_path, OOM_SWALLOWED)
        assert result.status == "failed", result.summary
        assert "exit" in result.summary or "hung" in result.summary
        return
    result = toy(tmp_path, "{name: oom, fault: oom, rank: 1, steps: 14, after_step: 7, "
                 "expect: fail_clean, deadline: 20}")
    assert result.status == "passed", result.summary
    fault = report_evidence(result)["fault_evidence"]
    assert fault["mode_ran"] in ("cgroup", "rlimit")
    assert report_evidence(result)["checkpoint"]["intact"] and report_evidence(result)["checkpoint"]["resumed_from_step"] == 5


_SIZES_KB = {"4KB": 4, "100KB": 100, "1MB": 1024, "50MB": 51200}


def disk_full_drill(writer: str, mode: str, args: str) -> str:
    """The drill after step 7 of 14: an atomic writer fails clean and resumes from step 5, an
    in-place writer (the defect) leaves a torn checkpoint the resume trips over."""
    args += " --ckpt-inplace" if writer == "in-place" else ""
    params = "" if mode == "auto" else f", params: {{mode: {mode}}}"
    return ("{name: disk, fault: disk_full, rank: 0, steps: 14, after_step: 7, "
            f"expect: fail_clean, deadline: 20, args: '{args}'{params}}}")


def _disk_full(tmp_path: Path, writer: str, mode: str, args: str) -> None:
    result = toy(tmp_path, disk_full_drill(writer, mode, args))
    ran = mode if mode != "auto" else ("fuse" if fuse_unavailable() is None else "hook")
    assert report_evidence(result)["fault_evidence"]["mode_ran"] == ran
    if writer == "in-place":
        assert result.status == "failed", result.summary
        assert report_evidence(result)["checkpoint"]["intact"] is False, report_evidence(result)["checkpoint"]
        # the cause the evidence shows comes first: the torn checkpoint, with the write it hit
        assert "in place" in report_evidence(result)["likely_causes"][0], report_evidence(result)["likely_causes"]
        assert "Most likely a checkpoint overwritten in place" in result.summary
        return
    assert result.status == "passed", result.summary
    assert "No space left on device" in report_evidence(result)["failed_rank_stderr_after_fault"]
    assert report_evidence(result)["checkpoint"] == {"intact": True, "resumed_from_step": 5}


@pytest.mark.parametrize("writer", ["atomic", "in-place"])
def test_disk_full_fail_clean_hook_mode(tmp_path: Path, writer: str) -> None:
    _disk_full(tmp_path, writer, "hook", "--sleep 0.1")


@pytest.mark.parametrize(("writer", "size"), [
    ("atomic", "4KB"), ("in-place", "4KB"), ("atomic", "50MB"),
    # the in-place writer's torn checkpoint is caught the same way at every size (4KB above)
    *[pytest.param("atomic", size, marks=pytest.mark.slow) for size in ("100KB", "1MB")],
    *[pytest.param("in-place", size, marks=pytest.mark.slow) for size in ("100KB", "1MB", "50MB")],
])
def test_disk_full_at_any_checkpoint_size(tmp_path: Path, writer: str, size: str) -> None:
    """The default mode on one checkpoint file replaced by every save (a rename over it frees
    its space, which a filler racing the job for a small disk gave back too often). The default
    run: the atomic writer at the smallest and the largest size, the in-place defect once."""
    _disk_full(tmp_path, writer, "auto", f"--ckpt-keep-one --ckpt-size-kb {_SIZES_KB[size]}")


@pytest.fixture
def service(http_service: str) -> str:
    """The job's upstream: a real HTTP service on loopback (tests/conftest.py)."""
    return http_service


@pytest.mark.parametrize("defect", [False, True], ids=["with-timeout", "no-timeout"])
def test_network_continue(tmp_path: Path, service: str, defect: bool) -> None:
    drill = ("{name: net, fault: network, steps: 40, after_step: 10, duration: 2, expect: continue, "
             "min_rate: 0.1, params: {toxic: timeout, stream: upstream, attributes: {timeout: 0}, upstream: '" + service
             + "'}, args: " + ("'--timeout 0'" if defect else "'--timeout 0.2'") + "}")
    result = run(tmp_path, HTTP, drill, script=DATA / "faults" / "http_job.py", service=service)
    rates = report_evidence(result)["step_rate"]
    if defect:
        assert result.status == "failed", result.summary
        assert "step rate during the fault fell" in result.summary
        return
    assert result.status == "passed", result.summary
    assert rates["during_over_before"] >= 0.1
    assert report_evidence(result)["fault_evidence"]["toxic"] == "timeout"


@pytest.mark.parametrize("defect", [False, True], ids=["bounded-flush", "unbounded-flush"])
def test_network_continue_when_the_steps_end_inside_the_fault(tmp_path: Path, service: str, defect: bool) -> None:
    """A fast job whose tracking calls run in the background finishes its steps early in the
    fault window: the rate counts only the time it still had steps to do, and it has continued
    if it exits within ``deadline`` of its last step; a shutdown that waits for the service
    does not."""
    flush = "--timeout 0 --flush-timeout 0" if defect else "--timeout 0.3 --flush-timeout 1"
    # a 16 s window: at load 5 the 30 steps after the fault once ended after an 8 s one
    drill = ("{name: net, fault: network, steps: 40, after_step: 10, duration: 16, expect: continue, "
             "deadline: 3, params: {toxic: timeout, stream: upstream, attributes: {timeout: 0}, upstream: '"
             + service + f"'}}, args: '--background --sleep 0.02 {flush}'}}")
    result = run(tmp_path, HTTP, drill, script=DATA / "faults" / "http_job.py", service=service)
    rates = report_evidence(result)["step_rate"]
    assert rates.get("during_until_last_step") is True, rates  # all 40 steps inside the window
    if defect:
        assert result.status == "failed", result.summary
        assert "after its last step" in result.summary, result.summary
        return
    assert result.status == "passed", result.summary
    assert rates["during_over_before"] >= 0.5, rates
    assert report_evidence(result)["exit_after_last_step_s"] < 3
