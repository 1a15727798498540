"""The memory headroom search on real processes with a known answer: memory_train.py holds
batch x 1 MB of written bytes, so under a budget of B MB per rank the largest batch that fits is
(B - the interpreter's few MB) / 1. A real cgroup limit OOM-kills the rank above it; a job that
fails for another reason at large batches is reported as that, not as OOM; a job that never runs
out reaches max; the RLIMIT_AS fallback finds the boundary too and says it is a fallback."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest

from trainguard.config import load_config
from trainguard.config.settings import Settings
from trainguard.faults.base import FaultUnavailable
from trainguard.faults.cgroups import MemoryCgroups
from trainguard.profiling.check import profile_job, summarise
from trainguard.profiling.headroom import run_headroom
from trainguard.run.runner import JobRunner

JOBS = Path(__file__).resolve().parent.parent / "data" / "jobs"

JOB_FILE = """\
job:
  name: memory
  command: "python memory_train.py --steps {steps} --batch-size {batch_size} --sleep 0.05"
  batch_size: 16
  env: {OMP_NUM_THREADS: "1"}
  metrics:
    loss: 'step (?P<step>\\d+) loss (?P<value>\\S+)'
  timeout: 60
  stall_timeout: 20
checks:
  profile:
    steps: 4
    warmup_steps: 1
    world_sizes: [1]
    args: %(args)s
    headroom: %(headroom)s
%(extra)s"""


def _cgroups_usable() -> bool:
    try:
        MemoryCgroups(1)
    except FaultUnavailable:
        return False
    return True


needs_cgroups = pytest.mark.skipif(not _cgroups_usable(), reason="needs root and a memory cgroup")


def _job(tmp_path: Path, headroom: str, args: str = "[]", extra: str = "") -> Path:
    shutil.copy(JOBS / "memory_train.py", tmp_path / "memory_train.py")
    path = tmp_path / "memory.trainguard.yaml"
    path.write_text(JOB_FILE % {"headroom": headroom, "args": args, "extra": extra})
    return path


def _own_cgroups_left() -> list[str]:
    base = MemoryCgroups(1).base
    return [p.name for p in base.glob(f"trainguard-{os.getpid()}-*")]


@needs_cgroups
def test_search_under_a_real_cgroup_budget_finds_the_known_boundary(tmp_path: Path) -> None:
    path = _job(tmp_path, "{start: 16, max: 1024, memory_budget_mb: 200, steps: 3}",
                extra="target: {steps: 10000, max_gpus: 2}\n")
    job_file = load_config(path)
    assert job_file.checks.profile is not None
    started = time.monotonic()
    profile, paths = profile_job(JobRunner(job_file, Settings()), job_file.checks.profile)
    took = time.monotonic() - started
    hr = profile.headroom
    assert hr is not None and hr.enforcement == "cgroup" and hr.fallback is None
    assert hr.stopped == "bracketed", hr.reason
    assert hr.fit is not None
    # the job holds exactly 1 MB per sample plus an interpreter of a few MB
    peaks = [(p.batch_size, p.outcome, p.peak_mb, p.cgroup_peak_mb) for p in hr.probes]
    assert hr.fit.per_sample_mb == pytest.approx(1.0, rel=0.05), peaks
    assert 2 < hr.fit.fixed_mb < 40, peaks
    known = (200 - hr.fit.fixed_mb) / hr.fit.per_sample_mb
    assert hr.largest_pass is not None and hr.first_fail is not None
    assert hr.largest_pass <= known + 2 and hr.first_fail >= known - 2
    assert hr.first_fail - hr.largest_pass <= max(1, 0.05 * hr.largest_pass)
    for p in hr.probes:
        assert p.outcome in ("pass", "oom")
        if p.outcome == "oom":
            assert "kernel OOM killer" in p.detail and p.batch_size > known - 2
        else:
            assert p.steps == 3 and p.peak_mb is not None and p.peak_mb < 200
    # safe: fitted peak <= 80 % of 200 MB
    assert hr.safe_batch is not None
    assert hr.fit.peak(hr.safe_batch) <= 160 < hr.fit.peak(hr.safe_batch + 2)
    assert hr.profile_batch == 16 and hr.headroom_mb is not None and 150 < hr.headroom_mb < 195
    assert _own_cgroups_left() == []

    status, summary = summarise(profile)
    assert status == "passed" and f"largest batch {hr.largest_pass} (OOM at {hr.first_fail})" in summary
    data = json.loads(Path(paths["json"]).read_text())
    assert data["headroom"]["largest_pass"] == hr.largest_pass
    assert data["sizing"]["batch_headroom"]["headroom_mb"] == hr.headroom_mb
    assert data["sizing"]["memory_budget_source"] == "checks.profile.headroom.memory_budget_mb"
    assert "### Memory headroom" in Path(paths["markdown"]).read_text()
    assert (Path(paths["html"]).parent / "headroom.png").is_file()
    print(f"headroom search: {len(hr.probes)} probes, {hr.duration_s:.1f} s (profile {took:.1f} s)")


@needs_cgroups
def test_a_non_memory_failure_at_a_large_batch_stops_the_search_and_fails_the_profile(tmp_path: Path) -> None:
    path = _job(tmp_path, "{start: 16, max: 1024, memory_budget_mb: 400, steps: 2}",
                args='"--fail-above 64"')
    job_file = load_config(path)
    assert job_file.checks.profile is not None
    profile, _ = profile_job(JobRunner(job_file, Settings()), job_file.checks.profile)
    hr = profile.headroom
    assert hr is not None
    assert [(p.batch_size, p.outcome) for p in hr.probes] == [(16, "pass"), (32, "pass"), (64, "pass"), (128, "error")]
    assert hr.stopped == "other_failure" and hr.failed
    assert "batch 128 failed for a reason other than memory" in hr.reason
    assert "ValueError: batch 128 is larger than the dataset" in hr.reason
    status, summary = summarise(profile)
    assert status == "failed" and "other than memory" in summary


@needs_cgroups
def test_a_job_that_never_runs_out_reports_max_reached(tmp_path: Path) -> None:
    path = _job(tmp_path, "{start: 16, max: 64, memory_budget_mb: 400, steps: 2}",
                args='"--mb-per-sample 0.5"')
    job_file = load_config(path)
    assert job_file.checks.profile is not None
    hr = run_headroom(JobRunner(job_file, Settings()), job_file.checks.profile)
    assert [(p.batch_size, p.outcome) for p in hr.probes] == [(16, "pass"), (32, "pass"), (64, "pass")]
    assert hr.stopped == "max_reached" and hr.largest_pass == 64 and hr.first_fail is None
    assert hr.safe_batch == 64 and "max reached, no OOM" in hr.summary()
    assert hr.fit is not None and hr.fit.per_sample_mb == pytest.approx(0.5, rel=0.1)


def test_the_rlimit_fallback_finds_the_boundary_and_is_named(tmp_path: Path) -> None:
    path = _job(tmp_path, "{start: 32, max: 1024, memory_budget_mb: 240, steps: 3, enforce: rlimit}")
    job_file = load_config(path)
    assert job_file.checks.profile is not None
    hr = run_headroom(JobRunner(job_file, Settings()), job_file.checks.profile)
    assert hr.enforcement == "rlimit" and hr.stopped == "bracketed", hr.reason
    assert any("RLIMIT_AS" in n for n in hr.notes)
    ooms = [p for p in hr.probes if p.outcome == "oom"]
    assert ooms and all("MemoryError" in p.detail for p in ooms)
    # address space = the interpreter's mappings (tens of MB) + 1 MB per sample
    assert hr.largest_pass is not None and 120 <= hr.largest_pass < 240
    assert hr.first_fail is not None and hr.first_fail - hr.largest_pass <= max(1, 0.05 * hr.largest_pass)


def test_no_headroom_flag_skips_the_search(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from trainguard.cli import main

    path = _job(tmp_path, "{start: 16, max: 64, memory_budget_mb: 400, steps: 2}")
    assert main(["profile", str(path), "--no-headroom"]) == 0
    assert "headroom:" not in capsys.readouterr().out
    data = json.loads((tmp_path / ".trainguard" / "profile" / "latest.json").read_text())
    assert data["headroom"] is None and not list((tmp_path / ".trainguard" / "runs").glob("*headroom*"))


@pytest.mark.slow
@needs_cgroups
def test_the_digits_example_search_brackets_a_real_torch_oom(tmp_path: Path) -> None:
    """examples/digits/headroom.trainguard.yaml as shipped (7 probes, ~80-140 s here)."""
    example = Path(__file__).resolve().parents[2] / "examples" / "digits"
    root = Path(shutil.copytree(example, tmp_path / "digits",
                                ignore=shutil.ignore_patterns(".trainguard", "__pycache__")))
    job_file = load_config(root / "headroom.trainguard.yaml")
    assert job_file.checks.profile is not None
    hr = run_headroom(JobRunner(job_file, Settings()), job_file.checks.profile)
    assert hr.enforcement == "cgroup" and hr.stopped == "bracketed", hr.reason
    assert all(p.outcome in ("pass", "oom") for p in hr.probes), [p.detail for p in hr.probes]
    assert hr.largest_pass is not None and hr.first_fail is not None
    assert 128 <= hr.largest_pass < hr.first_fail <= 1024
    assert hr.fit is not None and hr.fit.per_sample_mb > 0.1  # activations grow with the batch
    assert hr.safe_batch is not None and hr.safe_batch <= hr.largest_pass
    assert hr.headroom_mb is not None and 0 < hr.headroom_mb < 500
