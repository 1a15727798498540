"""The ``sdc`` fault without a drill run: the bit flip itself on real tensors (exponent and
mantissa, float32 and bfloat16, the element chosen, a stuck bit), the start-up hook in a real
Python process with torch (transient and persistent, parameter and gradients), and its parameters
in the job file. The drills on real DDP ranks are in tests/distributed/test_sdc_drill.py."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import load_hook_module
from tests.steplines import Step, trajectory, write_rank
from tests.unit.test_nan_fault import HEAD
from trainguard._internal import envvars
from trainguard.config import DrillSpec, parse_config
from trainguard.config.fault_params import FaultParams
from trainguard.config.faults import Expectation
from trainguard.drills.judges import DrillContext, Injection
from trainguard.drills.sdc import judge_caught, judge_detect
from trainguard.errors import ConfigError
from trainguard.faults.hook import read_events
from trainguard.faults.sdc import SDC_RECORD, Flip, SdcFault
from trainguard.launch import MetricPoint, RankExit, RunResult
from trainguard.launch.hook import hook_env
from trainguard.run.request import RunRequest
from trainguard.run.runner import SupervisedRun

torch = pytest.importorskip("torch")


agent = load_hook_module("_trainguard_sdc_agent", "sdc_agent_under_test")


def _bits32(value: float) -> int:
    return int.from_bytes(struct.pack("<f", value), "little")


def test_an_exponent_flip_of_float32_jumps_by_orders_of_magnitude_and_a_mantissa_flip_does_not() -> None:
    t = torch.tensor([[0.01, 1.0], [2.0, 3.0]])
    done = agent.flip_bit(torch, t, 0, agent.bit_of("float32", "exponent"))
    assert done["bit"] == 30 and done["changed"] and done["position"] == [0, 0]
    assert t[0, 0].item() > 1e30  # 0.01's top exponent bit was 0: now ~3.4e36
    assert _bits32(t[0, 0].item()) ^ _bits32(0.01) == 1 << 30
    assert t.flatten()[1:].tolist() == [1.0, 2.0, 3.0]  # no other element touched
    done = agent.flip_bit(torch, t, 3, agent.bit_of("float32", "mantissa"))
    assert done["bit"] == 22 and t[1, 1].item() == 2.0  # 3.0 = 1.5 * 2: the top mantissa bit off -> 1.0 * 2
    assert (done["old"], done["new"], done["old_bits"], done["new_bits"]) == (3.0, 2.0, "40400000", "40000000")


def test_bfloat16_has_its_own_bits_and_the_element_is_chosen_row_major_even_in_a_strided_view() -> None:
    b = torch.tensor([0.01, 1.0, -2.0], dtype=torch.bfloat16)
    assert agent.bit_of("bfloat16", "mantissa") == 6 and agent.bit_of("bfloat16", "exponent") == 14
    done = agent.flip_bit(torch, b, 1, agent.bit_of("bfloat16", "mantissa"))
    assert b.tolist()[1] == 1.5 and (done["old_bits"], done["new_bits"]) == ("3f80", "3fc0")
    sign = agent.flip_bit(torch, b, 2, 15)
    assert b.tolist()[2] == 2.0 and sign["dtype"] == "torch.bfloat16"
    strided = torch.arange(6.0).reshape(2, 3).t()  # [[0, 3], [1, 4], [2, 5]], not contiguous
    agent.flip_bit(torch, strided, 1, 22)  # row-major element 1 of the view: 3.0
    assert strided.tolist() == [[0.0, 2.0], [1.0, 4.0], [2.0, 5.0]]


def test_a_stuck_bit_is_set_not_toggled_and_bad_bits_are_refused() -> None:
    t = torch.tensor([3.0])
    first = agent.flip_bit(torch, t, 0, 22)
    assert first["bit_now"] == 0 and t.item() == 2.0
    again = agent.flip_bit(torch, t, 0, 22, set_to=first["bit_now"])
    assert not again["changed"] and t.item() == 2.0  # stuck at 0: a second flip would restore 3.0
    assert agent.bit_of("float32", 7) == 7
    with pytest.raises(ValueError, match="bit 40 is outside a float32"):
        agent.bit_of("float32", 40)
    with pytest.raises(ValueError, match="floating tensor"):
        agent.bit_of("int64", "mantissa")
    assert agent.strip_prefixes("module._orig_mod.layers._fsdp_wrapped_module.0.weight") == "layers.0.weight"


SCRIPT = textwrap.dedent("""
    import sys, torch
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 1))
    with torch.no_grad():
        model[0].weight[0, 0] = 1.0
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # nothing changes but what the fault does
    x = torch.randn(8, 4)
    for step in range(1, 6):
        opt.zero_grad()
        (model(x) ** 2).sum().backward()
        seen = model[0].weight.grad[0, 0].item()
        opt.step()
        print(step, model[0].weight[0, 0].item(), seen, model[0].weight.grad[0, 0].item(), flush=True)
        with torch.no_grad():
            model[0].weight[0, 0] = 1.0  # repaired after each step: only a stuck bit comes back
""")


def _run(tmp_path: Path, **params: Any) -> tuple[list[list[float]], list[Flip]]:
    work = tmp_path / "_".join(str(v) for v in params.values())
    work.mkdir()
    (work / "train.py").write_text(SCRIPT)
    spec = {"fault": "sdc", "rank": 0, "trigger": str(work / "trigger"), "events": str(work / "events.jsonl"),
            "step": 3, **params}
    env = {**os.environ, **hook_env(spec), "RANK": "0", envvars.RUN_DIR: str(work)}
    proc = subprocess.run([sys.executable, "train.py"], cwd=work, env=env, text=True, capture_output=True,
                          timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    events = read_events(work / "events.jsonl")
    assert not [e for e in events if e.get("event") == "error"], events
    flips = [Flip.of(e, 0) for e in events if e.get("event") == "flipped"]
    recorded = [json.loads(line) for line in (work / SDC_RECORD).read_text().splitlines()]
    assert [r["step"] for r in recorded] == [f.step for f in flips]  # the run folder's copy
    return [[float(v) for v in line.split()] for line in proc.stdout.splitlines()], flips


def test_the_hook_flips_a_parameter_once_or_keeps_the_bit_stuck(tmp_path: Path) -> None:
    lines, flips = _run(tmp_path, target="parameter", mode="transient")
    assert [line[1] for line in lines] == [1.0, 1.0, 1.5, 1.0, 1.0]  # the top mantissa bit at step 3 only
    assert [(f.step, f.tensor, f.index, f.bit, f.old, f.new) for f in flips] == [(3, "0.weight", 0, 22, 1.0, 1.5)]
    lines, flips = _run(tmp_path, target="parameter", mode="persistent")
    assert [line[1] for line in lines] == [1.0, 1.0, 1.5, 1.5, 1.5]  # stuck: back after each repair
    assert [f.step for f in flips] == [3, 4, 5] and {f.mode for f in flips} == {"persistent"}


@pytest.mark.slow  # three more processes importing torch; the drills run these targets on DDP too
def test_the_hook_flips_a_gradient_before_or_after_its_reduction(tmp_path: Path) -> None:
    clean, _ = _run(tmp_path, target="gradient", mode="transient", bit=31)  # the sign bit
    grads_after_backward, grads_at_step = [line[2] for line in clean], [line[3] for line in clean]
    assert grads_at_step[2] == -grads_after_backward[2]  # flipped at the step, after the backward
    assert grads_at_step[:2] + grads_at_step[3:] == grads_after_backward[:2] + grads_after_backward[3:]
    before, flips = _run(tmp_path, target="gradient_before_reduction", mode="transient", bit=31)
    assert [line[2] for line in before] == grads_at_step  # in the backward: seen right after it
    assert [(f.step, f.target, f.tensor) for f in flips] == [(3, "gradient_before_reduction", "0.weight")]
    out, flips = _run(tmp_path, target="output", mode="transient", name="1", bit=31)
    assert [(f.step, f.tensor, f.target) for f in flips] == [(3, "1", "output")]
    assert out[2][2] != out[1][2] and out[3][2] == out[1][2]  # the loss's gradient takes the sign at step 3 only


def _problem(entry: str) -> str:
    with pytest.raises(ConfigError) as exc:
        parse_config(HEAD + "    - " + entry + "\n")
    return str(exc.value)


def test_an_sdc_drill_is_caught_by_default_and_bad_params_name_the_key_and_the_fix() -> None:
    drills = parse_config(HEAD + "    - {name: a, fault: sdc, rank: 1}\n"
                          "    - {name: b, fault: sdc, expect: detect, params: {within_steps: 1, bit: 30}}\n").checks.drills
    assert [d.expectation for d in drills] == [Expectation.CAUGHT, Expectation.DETECT]
    assert "checks.drills[0].params.target: expected one of parameter, optimizer_state, gradient, " \
           "gradient_before_reduction, output, got 'weights'" in _problem("{name: a, fault: sdc, params: {target: weights}}")
    assert "params.bit: expected exponent, mantissa or a bit index" in _problem(
        "{name: a, fault: sdc, params: {bit: sign}}")
    assert "params.mode: expected one of transient, persistent" in _problem(
        "{name: a, fault: sdc, params: {mode: sometimes}}")
    assert "params.detect_pattern: not a regular expression" in _problem(
        "{name: a, fault: sdc, params: {detect_pattern: '('}}")
    assert "handle_nonfinite" in _problem("{name: a, fault: sdc, expect: handle_nonfinite}")


# -- the verdicts, on step records written by hand (tests/steplines.py) -----------------------


class _Flipped(SdcFault):
    """The hook's flips, as the recorded run would have left them."""

    def __init__(self, params: dict[str, Any], flips: list[Flip]) -> None:
        super().__init__(FaultParams(params), rank=1, after_step=3)
        self.recorded = flips
        self.injected_at = 1.3

    def flips(self) -> list[Flip]:
        return self.recorded


def _flip(target: str, tensor: str = "fc1.weight", step: int = 4) -> Flip:
    return Flip(1, step, target, "transient", tensor, None, 0, 22, "torch.float32", 1.0, 1.5, "3f800000", "3fc00000")


def _records(run_dir: Path, rank1: list[Step], rank0: list[Step] | None = None) -> Path:
    write_rank(run_dir, 0, trajectory(1, 8) if rank0 is None else rank0)
    write_rank(run_dir, 1, rank1)
    return run_dir


def _verdict(tmp_path: Path, target: str, rank1: list[Step], *, rank0: list[Step] | None = None,
             expect: str = "caught", outcome: str = "ok", printed: int = 8, pattern: str = "") -> tuple[str, str]:
    params = {"target": target, **({"detect_pattern": pattern} if pattern else {})}
    spec = DrillSpec.model_validate({"name": "s", "fault": "sdc", "rank": 1, "steps": 8, "after_step": 3,
                                     "expect": expect, "params": params})
    drill = _records(tmp_path / "drill", rank1, rank0)
    reference = _records(tmp_path / "reference", trajectory(1, 8))
    points = [MetricPoint("loss", s, 1.0, r, 1.0 + 0.1 * s) for r in (0, 1) for s in range(1, printed + 1)]
    exits = [RankExit(0, 100, 0), RankExit(1, 101, 0 if outcome == "ok" else 1)]
    attempt = RunResult(outcome, ["python"], drill, 2, 0, exits, points, 5.0, 1.0,  # type: ignore[arg-type]
                        reason="" if outcome == "ok" else "rank 1 exited with code 1",
                        failed_rank=None if outcome == "ok" else 1)
    ref = RunResult("ok", ["python"], reference, 2, 0, [], points, 5.0, 1.0)
    c = DrillContext(None, spec, _Flipped(params, [_flip(target)]),  # type: ignore[arg-type]
                     Injection(watch_rank=1, injected_step=3), SupervisedRun([attempt], drill, drill),
                     ref, RunRequest.make(steps=8, seed=0, world_size=2), "loss", drill, 5.0)
    status, summary, _ = (judge_caught if expect == "caught" else judge_detect)(c)
    return status, summary


def test_caught_passes_only_when_the_replicas_name_the_flip_at_its_step(tmp_path: Path) -> None:
    at_4 = [replace(s, param_of={"fc1.weight": 77 + s.n}) if s.n >= 4 else s for s in trajectory(1, 8)]
    status, summary = _verdict(tmp_path / "a", "parameter", at_4)
    assert status == "passed" and "the replica invariant named it: replicas: fc1.weight at step 4" in summary
    late = [replace(s, param_of={"fc1.weight": 77 + s.n}) if s.n >= 5 else s for s in trajectory(1, 8)]
    status, summary = _verdict(tmp_path / "b", "parameter", late)  # recorded a step late: not named right
    assert status == "failed" and "did not name it at that step: replicas: fc1.weight at step 5" in summary
    status, summary = _verdict(tmp_path / "c", "parameter", trajectory(1, 8))
    assert status == "failed" and "no finding" in summary


def test_caught_names_an_averaged_flip_by_the_first_divergence_and_says_why(tmp_path: Path) -> None:
    averaged = [replace(s, grad_of={"fc2.weight": 5}) if s.n == 4 else s for s in trajectory(1, 8)]
    status, summary = _verdict(tmp_path / "a", "output", averaged, rank0=averaged)  # every rank alike
    assert status == "passed" and "the first divergence from the uninterrupted run names it: the step records " \
        "first differ at step 4" in summary
    assert "the replicas stayed equal, as they must" in summary and "the replica invariant cannot show it" in summary
    status, summary = _verdict(tmp_path / "c", "output", trajectory(1, 8))
    assert status == "failed" and "the flip changed nothing the step records show" in summary
    early = [replace(s, grad_of={"fc2.weight": 5}) if s.n == 2 else s for s in trajectory(1, 8)]
    status, summary = _verdict(tmp_path / "d", "gradient_before_reduction", early, rank0=early)
    assert status == "error" and "not bitwise reproducible" in summary


def test_detect_passes_on_a_prompt_defence_and_fails_a_late_one_or_none(tmp_path: Path) -> None:
    at_4 = [replace(s, param_of={"fc1.weight": 77 + s.n}) if s.n >= 4 else s for s in trajectory(1, 8)]
    status, summary = _verdict(tmp_path / "a", "parameter", at_4, expect="detect", outcome="failed", printed=3)
    assert status == "passed" and "the job exited non-zero (rank 1 exited with code 1), with step 3 its last" in summary
    status, summary = _verdict(tmp_path / "b", "parameter", at_4, expect="detect", outcome="failed", printed=6)
    assert status == "failed" and "too late: its ranks had printed step 6 (the flip's step + 2)" in summary
    status, summary = _verdict(tmp_path / "c", "parameter", at_4, expect="detect")
    assert status == "failed" and "the job has no defence against it: it completed without exiting non-zero" in summary
    assert "the replica invariant named it" in summary  # what trainguard saw
