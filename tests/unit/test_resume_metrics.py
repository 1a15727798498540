"""The resume check compares every metric the job declares (``checks.resume.metrics`` narrows
it): state a resume drops can show in one metric only, as an EMA of the weights left out of the
checkpoint shows in the EMA's own metric while the loss matches (issue 26).

The job is a few lines of plain Python (no torch: it starts in milliseconds): ``w`` follows a
fixed trajectory, ``ema`` averages it, and a JSON checkpoint every 5 steps holds both, or with
``--drop-ema`` only ``w`` -- the planted defect.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.helpers import report_evidence
from trainguard.session import check

JOB = '''
import argparse, json, os, time
p = argparse.ArgumentParser()
p.add_argument("--steps", type=int); p.add_argument("--ckpt-dir"); p.add_argument("--seed", type=int)
p.add_argument("--resume", action="store_true"); p.add_argument("--drop-ema", action="store_true")
a = p.parse_args()
step, w, ema = 0, 1.0, 1.0
saved = sorted(f for f in os.listdir(a.ckpt_dir) if f.startswith("ckpt_")) if a.resume else []
if saved:
    state = json.load(open(os.path.join(a.ckpt_dir, saved[-1])))
    step, w = state["step"], state["w"]
    ema = state.get("ema", w)  # --drop-ema: the EMA starts again from the weights
while step < a.steps:
    step += 1
    w = w * 0.9 + 0.05 * (step % 3)
    ema = 0.8 * ema + 0.2 * w
    if step % 5 == 0:
        state = {"step": step, "w": w} if a.drop_ema else {"step": step, "w": w, "ema": ema}
        tmp = os.path.join(a.ckpt_dir, "tmp.json")
        json.dump(state, open(tmp, "w")); os.replace(tmp, os.path.join(a.ckpt_dir, f"ckpt_{step:04d}.json"))
    print(f"step {step} loss {w:.6f} ema {ema:.6f}", flush=True)
    time.sleep(0.15)  # 12 steps after the kill step: 1.8 s for trainguard to read step 8
'''


def _job(tmp_path: Path, *, drop_ema: bool, metrics: str = "") -> Path:
    (tmp_path / "job.py").write_text(JOB)
    path = tmp_path / "trainguard.yaml"
    path.write_text(
        "job:\n"
        "  name: ema-job\n"
        f'  command: "{sys.executable} job.py --steps {{steps}} --ckpt-dir {{checkpoint_dir}} --seed {{seed}}'
        + (' --drop-ema"' if drop_ema else '"') + "\n"
        '  resume_args: "--resume"\n'
        "  metrics:\n"
        "    loss: 'step (?P<step>\\d+) loss (?P<value>\\S+)'\n"
        "    ema: 'step (?P<step>\\d+) .*ema (?P<value>\\S+)'\n"
        "  timeout: 60\n"
        "checks:\n"
        f"  resume: {{steps: 20, after_step: 8{metrics}}}\n"
    )
    return path


def _resume(tmp_path: Path, **kw: object) -> tuple[str, str, dict[str, object]]:
    report = check(_job(tmp_path, **kw), only=["resume"])  # type: ignore[arg-type]
    (result,) = report.checks
    return result.status, result.summary, report_evidence(result)


def test_an_ema_left_out_of_the_checkpoint_fails_the_resume_in_its_own_metric(tmp_path: Path) -> None:
    status, summary, evidence = _resume(tmp_path, drop_ema=True)
    assert status == "failed", summary
    # the first step after the resume (the kill may land a checkpoint later on a loaded machine)
    first = int(evidence["resumed_from_step"]) + 1  # type: ignore[call-overload]
    assert f"ema diverges from the uninterrupted run at step {first}" in summary and "while loss matches" in summary
    (other,) = evidence["other_metrics"]  # type: ignore[misc]
    assert other["metric"] == "ema" and other["first_divergent_step"] == first
    assert evidence["trajectory"]["first_divergent_step"] is None  # type: ignore[index]


def test_a_job_that_saves_its_ema_passes_in_every_metric(tmp_path: Path) -> None:
    status, summary, evidence = _resume(tmp_path, drop_ema=False)
    assert status == "passed", summary
    assert "match the uninterrupted run in loss, ema" in summary
    assert evidence["other_metrics"][0]["compared_steps"] == 20 - evidence["resumed_from_step"]  # type: ignore[index,operator]


def test_metrics_narrows_what_counts_and_an_unknown_name_is_a_config_error(tmp_path: Path) -> None:
    status, summary, evidence = _resume(tmp_path, drop_ema=True, metrics=", metrics: [loss]")
    assert status == "passed", summary
    assert "other_metrics" not in evidence
    from trainguard.errors import ConfigError

    other = tmp_path / "other"
    other.mkdir()
    with pytest.raises(ConfigError, match=r"checks\.resume\.metrics\[0\]: 'val' is not one of job\.metrics"):
        check(_job(other, drop_ema=False, metrics=", metrics: [val]"), only=["resume"])
