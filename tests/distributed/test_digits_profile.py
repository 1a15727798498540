"""The profile of the shipped example end to end: real runs at 1 and 2 ranks, the reports
written, the numbers sane; and (slow) a planted slowdown the baseline comparison must catch
while a clean re-run passes."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from trainguard.config import load_config
from trainguard.config.settings import Settings
from trainguard.profiling.check import profile_job
from trainguard.run.runner import JobRunner
from trainguard.session import check

if TYPE_CHECKING:
    from conftest import PatchedExample

JOB_FILE = """\
job:
  name: digits-profile
  # --keep-last 3: the step-5 checkpoint is not pruned at step 12. The profile lists the directory
  # at each step line, and a loaded run read every line after the last save: a file deleted
  # before any line is read is never seen
  command: "python train.py --steps {steps} --ckpt-dir {checkpoint_dir} --seed {seed} --keep-last 3"
  env: {OMP_NUM_THREADS: "1"}
  metrics:
    loss: 'step (?P<step>\\d+) loss (?P<value>\\S+)'
  timeout: 120
  stall_timeout: 60
checks:
  profile:
    steps: %(steps)d
    warmup_steps: 2
    world_sizes: %(sizes)s
    samples_per_step: 64
target: {steps: 100000, max_gpus: 4, price_per_gpu_hour: 2.0, deadline_hours: 48}
"""


@pytest.mark.profile
def test_profile_of_the_example_writes_sane_reports(tmp_path: Path, patched_example: PatchedExample) -> None:
    root = patched_example({}, JOB_FILE % {"steps": 12, "sizes": "[1, 2]"})
    report = check(root, only=["profile"], report_json=str(tmp_path / "report.json"))
    result = report.checks[0]
    assert result.status == "passed", result.summary
    assert "2 ranks give" in result.summary and "measured on CPU" in result.summary

    latest = root / ".trainguard" / "profile"
    data = json.loads((latest / "latest.json").read_text())
    assert Path(data["reports"]["html"]).is_file() and (latest / "latest.md").is_file()
    assert data["device"] == "cpu" and "CPU" in data["measured_on"]
    for size in data["sizes"]:
        step = size["step"]
        assert size["outcome"] == "ok"
        assert step["count"] == 10 and step["warmup_steps"] == 2  # steps 3..12
        assert 0 < step["p50_s"] <= step["p90_s"] <= step["p99_s"] < 10
        assert size["throughput_sps"] == pytest.approx(64 / step["mean_s"])
        assert 0 < size["startup_s"] < 120
        assert len(size["peak_rss_mb"]) == size["world_size"]
        assert all(50 < mb < 4000 for mb in size["peak_rss_mb"].values())
        assert all(pct > 0 for pct in size["cpu_util_pct"].values())
        # train.py checkpoints after steps 5, 10 and the last one
        assert size["checkpoint"]["steps"] == [5, 10, 12], size["checkpoint"]
        assert size["checkpoint"]["bytes_per_write"] > 10_000
        assert len(size["loss"]) == 12
        if size["world_size"] == 2:  # the run agent's step clocks in the timed run: a row per rank
            assert [(r["rank"], r["steps"] > 0) for r in size["pace"]["ranks"]] == [(0, True), (1, True)]
            assert "not judged" in size["pace"]["summary"] and size["timed_rank"] == 0  # 12 steps
        else:
            assert size["pace"] is None
    table = data["scaling"]["table"]
    assert table["1"]["efficiency"] == 1.0 and 0 < table["2"]["efficiency"] <= 1.5
    assert data["scaling"]["fit"]["chosen"] == "amdahl"  # 2 sizes: never the unvalidated USL
    sizing = data["sizing"]
    assert [c["gpus"] for c in sizing["candidates"]] == [1, 2, 3, 4]
    assert all(c["extrapolated"] == (c["gpus"] > 2) for c in sizing["candidates"])
    assert sizing["recommendation"]
    # the goodput forecast (docs/profiling.md): every size, the measured checkpoint save, the
    # target's default restart (no drill in this session), timeouts above the measured tail
    assert sizing["failure_inputs"]["restart_source"].startswith("default: target.restart_minutes")
    for c in sizing["candidates"]:
        assert 0.9 < c["goodput"] < 1 and c["checkpoint_cost_s"] is not None
        assert c["hours_with_failures"] > c["hours"] and c["wasted_gpu_hours"] > 0
        assert c["checkpoint_every_s"] <= 600  # target.max_lost_minutes 10 (default)
        # train.py saves every 5 steps: far more often than the optimum for a 100,000-step run
        assert c["job_checkpoint_every_steps"] in (3, 5), c  # median gap of saves 5, 10, 12
        if c["checkpoint_cost_s"]:
            assert 0 < c["goodput_at_job_cadence"] < c["goodput"]
        else:  # a loaded machine read the lines in bursts: the save's cost not measurable
            assert c["goodput_at_job_cadence"] is None and "nothing measurable" in c["checkpoint_rule"], c
    assert sizing["goodput_curve"]["gpus"] == sizing["recommended"]
    p99 = max(s["step"]["p99_s"] for s in data["sizes"])
    assert all(t["reason"] for t in sizing["timeouts"])
    # the restart policy's settings ride in the same list (issue 47): four of job.restart
    restart = sorted(t["setting"].split(" ")[0] for t in sizing["timeouts"] if t["setting"].startswith("job.restart."))
    assert restart == ["job.restart.backoff_s", "job.restart.jitter", "job.restart.max_attempts_without_progress",
                       "job.restart.max_backoff_s"], restart
    timeouts = [t for t in sizing["timeouts"] if not t["setting"].startswith("job.restart.")]
    assert len(timeouts) == 6 and all(t["value"] > p99 for t in timeouts if "max_failures" not in t["setting"])
    assert "**Goodput forecast**" in (latest / "latest.md").read_text()

    html = (latest / "latest.html").read_text()
    images = re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', html)
    assert len(images) == 5  # step times, scaling, cost, goodput, loss
    assert all(img.startswith("iVBORw0KGgo") for img in images)  # PNG signature
    assert "measured on CPU" in html.lower() or "Measured on CPU" in html


_SLOWDOWN = (
    "            # Printed after the checkpoint: whoever reads \"step N\" may rely on checkpoint N.\n",
    "            time.sleep(0.1)  # planted: a slower step\n"
    "            # Printed after the checkpoint: whoever reads \"step N\" may rely on checkpoint N.\n",
)


@pytest.mark.slow
@pytest.mark.profile
def test_compare_catches_a_planted_slowdown_and_passes_a_clean_rerun(
    tmp_path: Path, patched_example: PatchedExample
) -> None:
    root = patched_example({}, JOB_FILE % {"steps": 20, "sizes": "[1]"})
    job_file = load_config(root)
    assert job_file.checks.profile is not None
    spec = job_file.checks.profile
    saved, _ = profile_job(JobRunner(job_file, Settings()), spec, save=True)
    assert saved.saved_path is not None

    train = root / "train.py"
    clean_text = train.read_text()
    assert clean_text.count(_SLOWDOWN[0]) == 1
    train.write_text(clean_text.replace(*_SLOWDOWN))
    slow, _ = profile_job(JobRunner(job_file, Settings()), spec, compare=["p50_step_time:+50%"])
    assert [r.regressed for r in slow.regressions] == [True], [r.describe() for r in slow.regressions]
    assert slow.baseline_path == saved.saved_path

    train.write_text(clean_text)
    clean, _ = profile_job(JobRunner(job_file, Settings()), spec, compare=["p50_step_time:+50%"])
    assert [r.regressed for r in clean.regressions] == [False], [r.describe() for r in clean.regressions]
