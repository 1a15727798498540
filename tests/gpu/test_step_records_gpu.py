"""The run agent's step records on CUDA (issue 50, item 1; docs/step-records.md).

* cuda_train.py's two planted resume defects, located from the step records: ``no-cuda-rng`` (the
  checkpoint lacks the CUDA generator's state: the step records' CUDA RNG fingerprint parts at the
  first resumed step) and ``scaler-not-restored`` (fp16: the GradScaler's recorded scale parts);
  each named first, from what the ranks recorded (``observed``), at the step the records first differ.
* The per-step overhead, agent on vs off, on a CUDA job whose step takes tens of milliseconds
  (an MLP of width 4096 on a batch of 8192, fp32): the numbers are printed for the issue's note;
  the test asserts the records were written on the device (a fingerprint of every parameter, its
  gradient and its optimizer state at every step, the CUDA generator's among the RNG states),
  and only a very wide bound on the ratio.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from tests.gpu.gpujobs import first_cause, make_job, results
from tests.helpers import report_evidence
from trainguard.config import load_config
from trainguard.config.settings import Settings
from trainguard.launch.steps import read_steps
from trainguard.report import CheckResult
from trainguard.run.request import RunRequest
from trainguard.run.runner import JobRunner

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(240)]

# checkpoints every 5 steps: a kill after step 12 resumes from step 10's
RESUME = "  resume: {steps: 16, after_step: 12, args: \"%s\"}\n"


def _located(resume: CheckResult, key: str, name: str) -> None:
    """The resume failed with ``key`` named first from what the ranks recorded, and the step
    records first differ at the first resumed step, the quantity ``name`` of kind ``key`` the first to differ."""
    first = first_cause(resume)
    evidence = report_evidence(resume)
    assert first["key"] == key and first.get("observed") is True, evidence["diagnosis"]
    found = evidence.get("first_divergence") or {}
    print("first_divergence:", json.dumps({k: v for k, v in found.items() if k != "steps"}))
    assert found.get("step") == evidence["resumed_from_step"] + 1, found
    # the first quantity that differs there (parameters, restored, agree): the generator or the scale
    assert found.get("kind") == key and found.get("name") == name, found


def test_the_missing_cuda_rng_state_is_located_in_the_step_records(tmp_path: Path) -> None:
    """The first resumed step's dropout draws from the CUDA generator the resume never set back."""
    resume = results(make_job(tmp_path, RESUME % "--defect no-cuda-rng"), tmp_path, ["resume"])["resume"]
    _located(resume, "rng", "CUDA")


def test_the_scaler_not_restored_is_located_in_the_step_records(tmp_path: Path) -> None:
    """fp16 autocast, a GradScaler growing every 4 clean steps: it overflows and skips from about step 20."""
    root = make_job(tmp_path, "  resume: {steps: 30, after_step: 22, args: \"--precision fp16 --defect scaler-not-restored\"}\n")
    _located(results(root, tmp_path, ["resume"])["resume"], "scaler", "scale")


#: a CUDA step of tens of milliseconds: 3 linear layers, the middle one 4096 x 4096, on 8192 samples
BIG = " --hidden 4096 --batch-size 8192 --ckpt-every 1000 --dropout 0.1"
STEPS, WARMUP = 60, 10


def _step_seconds(points: list) -> list[float]:
    times = {p.step: p.t for p in points if p.name == "loss" and p.rank == 0 and p.step > WARMUP}
    return [times[s] - times[s - 1] for s in sorted(times) if s - 1 in times]


def test_the_agents_overhead_on_a_cuda_step_of_tens_of_milliseconds(tmp_path: Path) -> None:
    root = make_job(tmp_path, "  smoke: {steps: 8}\n", extra=BIG)
    on_yaml = root / "trainguard.yaml"
    off_yaml = root / "trainguard-off.yaml"
    off_yaml.write_text(on_yaml.read_text().replace("job:\n", "job:\n  record_steps: false\n", 1))
    files = {True: load_config(on_yaml), False: load_config(off_yaml)}
    assert files[True].job.record_steps and not files[False].job.record_steps
    request = RunRequest.make(steps=STEPS, seed=0, world_size=1)
    medians: dict[bool, list[float]] = {False: [], True: []}
    for on in (False, True, True, False):  # two pairs, in alternating order
        result = JobRunner(files[on], Settings()).run(request, label=f"overhead-{'on' if on else 'off'}")
        assert result.ok, result.reason
        steps = _step_seconds(result.points)
        assert len(steps) >= STEPS - WARMUP - 2, (len(steps), result.run_dir)
        medians[on].append(statistics.median(steps))
        records = read_steps(Path(result.run_dir))
        if not on:
            assert not records.ranks, f"step records written with record_steps: false in {result.run_dir}"
            continue
        rank0 = records.ranks[0]
        assert len(rank0.steps) >= STEPS - 1, (len(rank0.steps), result.run_dir)
        names = {"0.weight", "0.bias", "3.weight", "3.bias", "6.weight", "6.bias"}
        for step in rank0.steps[1:]:  # from the second step: AdamW's state exists
            assert set(step.param) == names and set(step.optim) == names, (step.n, sorted(step.param))
            assert all(step.grad[n] is not None for n in names), (step.n, step.grad)
            assert step.rng is not None and step.rng.cuda, (step.n, step.rng)  # CUDA initialised: its generator read
    off, on_ = statistics.median(medians[False]), statistics.median(medians[True])
    ratio = on_ / off
    print(f"CUDA MLP step (width 4096, batch 8192): off {[round(m * 1e3, 2) for m in medians[False]]} ms, "
          f"on {[round(m * 1e3, 2) for m in medians[True]]} ms; ratio on/off {ratio:.3f}")
    assert off > 0.005, f"the step took {off * 1e3:.2f} ms, not tens of ms: make BIG larger"
    assert ratio < 3.0, ratio  # only a gross cost: a busy machine shifts the rest
