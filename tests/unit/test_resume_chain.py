"""Chained resumes (``checks.resume.chain``): one run killed after each listed step and resumed
from the checkpoint the kill before left, every cycle compared with the uninterrupted run
(issue 26, item 3).

The job is plain Python (it starts in milliseconds): ``w`` follows a fixed trajectory driven by
``seen``, the steps trained so far, and a JSON checkpoint every 5 steps holds both. The planted
defect (``--bug``): a run that itself resumed leaves ``seen`` out of its checkpoints, so the
first resume is exact and the second starts ``seen`` again from 0 -- caught only by a chain.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import report_evidence
from trainguard.config import ResumeCheck
from trainguard.session import check

JOB = '''
import argparse, json, os, time
p = argparse.ArgumentParser()
p.add_argument("--steps", type=int); p.add_argument("--ckpt-dir"); p.add_argument("--seed", type=int)
p.add_argument("--resume", action="store_true"); p.add_argument("--bug", action="store_true")
a = p.parse_args()
step, w, seen = 0, 1.0, 0
saved = sorted(f for f in os.listdir(a.ckpt_dir) if f.startswith("ckpt_")) if a.resume else []
if saved:
    state = json.load(open(os.path.join(a.ckpt_dir, saved[-1])))
    step, w, seen = state["step"], state["w"], state.get("seen", 0)
while step < a.steps:
    step += 1
    seen += 1
    w = w * 0.9 + 0.01 * seen
    if step % 5 == 0:
        state = {"step": step, "w": w, "seen": seen}
        if a.bug and saved:
            del state["seen"]  # planted: a resumed run's saves leave the counter out
        tmp = os.path.join(a.ckpt_dir, "tmp.json")
        json.dump(state, open(tmp, "w")); os.replace(tmp, os.path.join(a.ckpt_dir, f"ckpt_{step:04d}.json"))
    print(f"step {step} loss {w:.6f}", flush=True)
    time.sleep(0.15)  # 9 steps after each cut: 1.35 s for trainguard to read the cut
'''


def chain_job(tmp_path: Path, *, bug: bool, resume: str) -> Path:
    """The job and its job file in ``tmp_path`` (``--bug`` planted or not), ``resume`` its check."""
    (tmp_path / "job.py").write_text(JOB)
    path = tmp_path / "trainguard.yaml"
    path.write_text(
        "job:\n"
        "  name: chain-job\n"
        f'  command: "{sys.executable} job.py --steps {{steps}} --ckpt-dir {{checkpoint_dir}} --seed {{seed}}'
        + (' --bug"' if bug else '"') + "\n"
        '  resume_args: "--resume"\n'
        "  metrics:\n"
        "    loss: 'step (?P<step>\\d+) loss (?P<value>\\S+)'\n"
        "  timeout: 60\n"
        f"checks:\n  resume: {resume}\n"
    )
    return path


def _run(tmp_path: Path, *, bug: bool, resume: str) -> tuple[str, str, dict[str, Any]]:
    (result,) = check(chain_job(tmp_path, bug=bug, resume=resume), only=["resume"]).checks
    return result.status, result.summary, report_evidence(result)


def test_state_lost_only_by_a_resumed_runs_save_fails_the_second_cycle_not_a_single_kill(tmp_path: Path) -> None:
    (tmp_path / "single").mkdir()
    status, summary, evidence = _run(tmp_path / "single", bug=True, resume="{steps: 26, after_step: 6}")
    assert status == "passed", summary  # one kill: the first resume is exact
    (tmp_path / "chain").mkdir()
    status, summary, evidence = _run(tmp_path / "chain", bug=True, resume="{steps: 26, chain: [6, 17]}")
    assert status == "failed", summary
    # a kill that lands up to 8 steps late still leaves cycle 2 a save of its own (step 15) to
    # resume the third cycle from
    assert evidence["failing_cycle"] == 3, evidence
    third = evidence["cycles"][2]
    assert f"cycle 3 (resumed from step {third['resumed_from_step']}, run to the end): loss diverges" in summary
    assert "cycles 1-2 matched" in summary
    assert evidence["likely_causes"][0].startswith("state a resume restores and the next save leaves out")
    assert evidence["cycles"][1]["metrics"][0]["first_divergent_step"] is None  # the first resume matched


def test_a_job_that_saves_its_state_on_every_resume_passes_every_cycle(tmp_path: Path) -> None:
    status, summary, evidence = _run(tmp_path, bug=False, resume="{steps: 26, chain: [6, 17]}")
    assert status == "passed", summary
    assert "2 kills after steps 6, 17" in summary and "every cycle matches the uninterrupted run" in summary
    assert [c["cycle"] for c in evidence["cycles"]] == [1, 2, 3]
    assert evidence["cycles"][1]["resumed_from_step"] > 0 and evidence["cycles"][2]["killed_after_step"] is None


@pytest.mark.parametrize(("fields", "message"), [
    ({"steps": 22, "chain": [6, 6]}, "must list increasing steps"),
    ({"steps": 22, "chain": [6, 22]}, "chain ends at (22) must be smaller than steps (22)"),
    ({"steps": 22, "after_step": 5, "chain": [6, 13]}, "give chain alone"),
])
def test_a_bad_chain_says_what_is_wrong(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ResumeCheck.model_validate(fields)
    assert ResumeCheck.model_validate({"steps": 22, "chain": [6, 13]}).cuts == [6, 13]


#: a job that saves every step and prints its `gnorm` line 0.2 s after its `loss` line
LATE_SECOND_METRIC = '''
import argparse, json, os, time
p = argparse.ArgumentParser()
p.add_argument("--steps", type=int); p.add_argument("--ckpt-dir"); p.add_argument("--seed", type=int)
p.add_argument("--resume", action="store_true")
a = p.parse_args()
step, w = 0, 1.0
saved = sorted(f for f in os.listdir(a.ckpt_dir) if f.startswith("ckpt_")) if a.resume else []
if saved:
    state = json.load(open(os.path.join(a.ckpt_dir, saved[-1])))
    step, w = state["step"], state["w"]
while step < a.steps:
    step += 1
    w = w * 0.9 + 0.01 * step
    tmp = os.path.join(a.ckpt_dir, "tmp.json")
    json.dump({"step": step, "w": w}, open(tmp, "w")); os.replace(tmp, os.path.join(a.ckpt_dir, f"ckpt_{step:04d}.json"))
    print(f"step {step} loss {w:.6f}", flush=True)
    time.sleep(0.2)
    print(f"step {step} gnorm {w / 2:.6f}", flush=True)
'''


def test_a_chained_kill_waits_for_the_cut_steps_second_metric(tmp_path: Path) -> None:
    """The kill landed right after the cut step's loss line, before its `gnorm` line 0.2 s
    later, and the cycle's comparison called gnorm missing at the cut step (a false failure in
    2 of 9 runs of a job printing it 50 ms later). The kill waits for every metric line the
    uninterrupted run printed for that step."""
    (tmp_path / "job.py").write_text(LATE_SECOND_METRIC)
    path = tmp_path / "trainguard.yaml"
    path.write_text(
        "job:\n"
        "  name: late-metric\n"
        f'  command: "{sys.executable} job.py --steps {{steps}} --ckpt-dir {{checkpoint_dir}} --seed {{seed}}"\n'
        '  resume_args: "--resume"\n'
        "  metrics:\n"
        "    loss: 'step (?P<step>\\d+) loss (?P<value>\\S+)'\n"
        "    gnorm: 'step (?P<step>\\d+) gnorm (?P<value>\\S+)'\n"
        "  timeout: 60\n"
        "checks:\n  resume: {steps: 7, chain: [2, 4]}\n"
    )
    (result,) = check(path, only=["resume"]).checks
    assert result.status == "passed", result.summary
    killed = [c["killed_after_step"] for c in report_evidence(result)["cycles"][:2]]
    assert all(k is not None and k < 7 for k in killed), killed
