"""The GPU tests that take the whole device's memory: the OOM drill that fills the device until
``cudaMalloc`` fails, and the headroom search whose budget on a GPU is the device's memory.
``ci/gpu.sh`` runs this file alone, after the others, so nothing else shares the device."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.gpu.gpujobs import assert_cuda_oom_drill_passed, make_job
from trainguard.config import load_config
from trainguard.config.settings import Settings
from trainguard.profiling.check import profile_job
from trainguard.run.runner import JobRunner
from trainguard.session import drill

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]

DEVICE_DRILL = """\
  drills:
    - {name: oom-device, fault: oom, params: {mode: gpu, gpu_limit: device}, rank: 0, world_size: 1, steps: 40, after_step: 10, expect: fail_clean, deadline: 60}
"""


def test_the_oom_drill_fills_the_device_until_cuda_runs_out(tmp_path: Path) -> None:
    """gpu_limit: device takes the device's free memory, as a neighbour or a leak would."""
    root = make_job(tmp_path, DEVICE_DRILL, extra=" --sleep 0.1")
    assert_cuda_oom_drill_passed(drill(root, report_json=str(tmp_path / "drills.json")), "oom-device")


# The probe job keeps 32 MB of device memory per sample alive in each step: the device's memory
# (the headroom search's budget on a GPU) holds about total / 32 MB samples.
PROFILE = """\
  profile:
    steps: 12
    warmup_steps: 2
    world_sizes: [1]
    samples_per_step: 256
    headroom: {start: 256, max: 16384, steps: 3, margin: 0.2, resolution: 0.1, max_probes: 10}
"""


def test_the_profile_reads_nvml_and_the_headroom_search_finds_the_device_memory(tmp_path: Path) -> None:
    from trainguard.profiling.profile import _gpu_memory_mb

    root = make_job(tmp_path, PROFILE, extra=" --batch-size {batch_size} --mem-per-sample-mb 32",
                job_extra="target: {steps: 100000, max_gpus: 8}\n")
    root.joinpath("trainguard.yaml").write_text(
        root.joinpath("trainguard.yaml").read_text().replace("  world_size: 1\n", "  world_size: 1\n  batch_size: 256\n"))
    job_file = load_config(root / "trainguard.yaml")
    assert job_file.checks.profile is not None
    profile, paths = profile_job(JobRunner(job_file, Settings()), job_file.checks.profile)
    assert profile.device == "gpu", profile.machine
    size = profile.sizes[0]
    # 256 samples x 32 MB held in each step, plus the CUDA context
    assert size.peak_gpu_mb and max(size.peak_gpu_mb.values()) > 256 * 32 * 0.9, size.peak_gpu_mb
    assert size.gpu_util_pct is not None, "NVML utilisation was not sampled"
    total = _gpu_memory_mb()
    assert total is not None
    hr = profile.headroom
    assert hr is not None and hr.enforcement == "gpu", hr
    assert hr.largest_pass is not None and hr.first_fail is not None, hr.reason
    assert hr.largest_pass * 32 < total <= hr.first_fail * 32 * 1.1, (hr.largest_pass, hr.first_fail, total)
    assert any(p.outcome == "oom" and "CUDA" in p.detail for p in hr.probes), [p.detail for p in hr.probes]
    markdown = Path(paths["markdown"]).read_text()
    assert any(name in markdown for name in profile.machine["gpus"]), markdown[:2000]
    data = json.loads(Path(paths["json"]).read_text())
    assert data["device"] == "gpu" and data["sizing"], list(data)
