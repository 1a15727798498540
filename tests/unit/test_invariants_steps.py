"""The invariants read from the agent's ``params``, ``model`` and ``eval`` lines and the step lines'
``carried``, ``eval_in_step`` and ``clip`` (trainguard.checks.invariants_steps, docs/invariants.md):
each planted defect named at its step with its ranks and parameter or module, each clean twin
passing, each declared exception honoured. Lines are written in the agent's format
(tests/steplines.py) and read back with ``read_steps``."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from tests.steplines import PARAMS, Step, model_line, params_line, trajectory, write_rank
from trainguard.checks.invariants import check_invariants
from trainguard.checks.invariants_records import Allowed, Invariant
from trainguard.checks.invariants_steps import (
    clip_findings,
    group_findings,
    growth_findings,
    mode_findings,
    unchanged_findings,
    zero_grad_findings,
)
from trainguard.launch.steps import read_steps

EXTRA = "head.bias"


def _run(tmp_path: Path, steps: list[Step], *, ranks: int = 2, params: dict[str, object] | None = None,
         model: dict[str, object] | None = None, after: list[dict[str, object]] | None = None) -> Path:
    for r in range(ranks):
        write_rank(tmp_path, r, steps, before=[params or params_line(), model or model_line()], extra=after or [])
    return tmp_path


# -- every trainable parameter is in one param group ------------------------------------------------


def test_a_trainable_parameter_in_no_group_is_named_at_its_first_step(tmp_path: Path) -> None:
    model = model_line([*PARAMS, EXTRA], grad=[EXTRA])
    findings, cover = group_findings(read_steps(_run(tmp_path, trajectory(1, 4), model=model)))
    assert [(f.invariant, f.step, f.ranks, f.name) for f in findings] == [(Invariant.TRAINS, 1, (0, 1), EXTRA)]
    assert "no optimizer's param group holds it" in findings[0].observation
    assert "allow.frozen" in findings[0].fix
    assert cover.compared == 8


def test_every_trainable_parameter_in_a_group_is_no_finding_nor_one_the_forward_gave_no_gradient(
        tmp_path: Path) -> None:
    model = model_line([*PARAMS, EXTRA], frozen=["emb.weight"])  # head.bias: trainable, no gradient (unused)
    findings, cover = group_findings(read_steps(_run(tmp_path, trajectory(1, 4), model=model)))
    assert findings == []
    assert cover.compared == 8 and cover.reason == ""


def test_a_declared_frozen_parameter_is_no_finding(tmp_path: Path) -> None:
    model = model_line([*PARAMS, EXTRA], grad=[EXTRA])
    findings, _ = group_findings(read_steps(_run(tmp_path, trajectory(1, 3), model=model)),
                                 allowed=Allowed(frozen=("head.*",)))
    assert findings == []


def test_a_parameter_two_optimizers_hold_is_named_by_the_later_one(tmp_path: Path) -> None:
    run = _run(tmp_path, [*trajectory(1, 3), Step(1, opt=1), Step(2, opt=1)],
               after=[params_line([["fc1.weight", "fc1.bias"]], opt=1, shared=["fc1.weight"])])
    findings, _ = group_findings(read_steps(run))
    assert [(f.name, f.ranks, f.optimizer, f.step) for f in findings] == [("fc1.weight", (0, 1), 1, 1)]
    assert "so does another optimizer" in findings[0].observation


def test_records_of_an_agent_without_param_groups_are_not_judged_and_say_so(tmp_path: Path) -> None:
    for r in range(2):
        write_rank(tmp_path, r, [replace(s, carried=PARAMS) for s in trajectory(1, 3)])
    steps = read_steps(tmp_path)
    for check in (group_findings, zero_grad_findings, mode_findings):
        findings, cover = check(steps)
        assert findings == [] and cover.compared == 0 and "agent before this version" in cover.reason


def test_model_lines_naming_no_trainable_parameter_say_why_nothing_was_checked(tmp_path: Path) -> None:
    """torch's TP + DDP recipe: no module holds the optimizer's parameters themselves, so the
    ``model`` line names none; the coverage says so (and, without a model line, why)."""
    write_rank(tmp_path / "none", 0, trajectory(1, 3), before=[params_line(), model_line(trainable=(), watched=0)])
    findings, cover = group_findings(read_steps(tmp_path / "none"))
    assert findings == [] and cover.compared == 0 and "no module holds the optimizer's parameters" in cover.reason
    write_rank(tmp_path / "once", 0, trajectory(1, 1), before=[params_line()])
    assert "no optimizer stepped twice" in group_findings(read_steps(tmp_path / "once"))[1].reason


# -- gradients start from zero ----------------------------------------------------------------------


def test_gradients_carried_into_a_step_name_the_parameters_at_that_step(tmp_path: Path) -> None:
    steps = [s if s.n < 2 else replace(s, carried=PARAMS) for s in trajectory(1, 4)]
    findings, cover = zero_grad_findings(read_steps(_run(tmp_path, steps)))
    assert [(f.invariant, f.step, f.ranks) for f in findings] == [(Invariant.ZERO_GRADS, 2, (0, 1))]
    assert findings[0].name == "fc1.weight, fc1.bias, fc2.weight"
    assert "allow.accumulates" in findings[0].fix
    assert cover.compared == 6


def test_gradients_that_start_from_zero_and_declared_accumulation_are_no_finding(tmp_path: Path) -> None:
    clean = read_steps(_run(tmp_path / "clean", trajectory(1, 4)))
    assert zero_grad_findings(clean)[0] == []
    carried = read_steps(_run(tmp_path / "acc", [replace(s, carried=PARAMS) for s in trajectory(1, 4)]))
    assert zero_grad_findings(carried, allowed=Allowed(accumulates=True))[0] == []


# -- train and eval modes ---------------------------------------------------------------------------


def test_a_dropout_left_in_eval_mode_is_named_at_the_first_training_step_on_its_rank(tmp_path: Path) -> None:
    write_rank(tmp_path, 0, [s if s.n < 5 else replace(s, eval_in_step=("body.2",)) for s in trajectory(1, 6)],
               before=[params_line(), model_line()])
    write_rank(tmp_path, 1, trajectory(1, 6), before=[params_line(), model_line()])
    findings, cover = mode_findings(read_steps(tmp_path))
    assert [(f.invariant, f.step, f.ranks, f.name) for f in findings] == [(Invariant.MODES, 5, (0,), "body.2")]
    assert "in eval mode in training step 5" in findings[0].observation
    assert cover.compared == 12
    assert mode_findings(read_steps(tmp_path), allowed=Allowed(eval_modules=("body.*",)))[0] == []


def test_a_validation_in_train_mode_is_named_after_its_step(tmp_path: Path) -> None:
    evals = [{"k": "eval", "opt": 0, "after": 4, "train_mode": ["body.2"], "t": 9.0}]
    write_rank(tmp_path, 0, trajectory(1, 6), before=[params_line(), model_line()], extra=evals)
    findings, _ = mode_findings(read_steps(tmp_path))
    assert [(f.step, f.ranks, f.name) for f in findings] == [(4, (0,), "body.2")]
    assert "training mode in a forward without gradients after step 4" in findings[0].observation
    assert mode_findings(read_steps(tmp_path), allowed=Allowed(train_modules=("body.2",)))[0] == []


def test_modes_in_a_model_with_no_watched_module_are_not_judged(tmp_path: Path) -> None:
    findings, cover = mode_findings(read_steps(_run(tmp_path, trajectory(1, 3), model=model_line(watched=0))))
    assert findings == [] and cover.compared == 0 and "no dropout" in cover.reason


# -- clipping after unscaling -----------------------------------------------------------------------


def test_clipping_scaled_gradients_is_named_and_clipping_after_unscale_is_not(tmp_path: Path) -> None:
    scaled = [replace(s, scale=65536.0, clip=(1, 1)) for s in trajectory(1, 3)]
    findings, cover = clip_findings(read_steps(_run(tmp_path / "bad", scaled)))
    assert [(f.invariant, f.step, f.ranks) for f in findings] == [(Invariant.SCALER, 1, (0, 1))]
    assert "before scaler.unscale_" in findings[0].observation
    unscaled = [replace(s, scale=65536.0, clip=(1, 0)) for s in trajectory(1, 3)]
    findings, cover = clip_findings(read_steps(_run(tmp_path / "good", unscaled)))
    assert findings == [] and cover.compared == 6


def test_check_invariants_passes_a_clean_run_with_every_new_invariant_compared(tmp_path: Path) -> None:
    steps = [replace(s, scale=1024.0, clip=(1, 0)) for s in trajectory(1, 4)]
    found = check_invariants(read_steps(_run(tmp_path, steps)), {})
    assert found.findings == ()
    compared = {c.invariant for c in found.coverage if c.compared}
    assert {Invariant.ZERO_GRADS, Invariant.MODES, Invariant.SCALER, Invariant.TRAINS} <= compared


# -- every update changes its fp32 parameter --------------------------------------------------------


def _stuck(steps: list[Step], first: int) -> list[Step]:
    """``fc1.weight`` the same from step ``first`` on (its updates undone)."""
    return [replace(s, param_of={"fc1.weight": 5000}) if s.n >= first else s for s in steps]


def test_an_fp32_parameter_its_updates_leave_unchanged_is_named_at_the_first_such_step(tmp_path: Path) -> None:
    findings, cover = unchanged_findings(read_steps(_run(tmp_path, _stuck(trajectory(1, 6), 3))))
    assert [(f.invariant, f.step, f.ranks, f.name) for f in findings] == [(Invariant.TRAINS, 3, (0, 1), "fc1.weight")]
    assert "left every bit of it as it was" in findings[0].observation
    assert cover.compared > 0


def test_parameters_that_change_bf16_ones_and_skipped_or_lr_0_steps_are_no_finding(tmp_path: Path) -> None:
    clean, cover = unchanged_findings(read_steps(_run(tmp_path / "clean", trajectory(1, 6))))
    assert clean == [] and cover.compared == 2 * 4 * len(PARAMS)
    stuck = _stuck(trajectory(1, 6), 3)
    bf16 = _run(tmp_path / "bf16", stuck, params=params_line(dtype="bfloat16"))
    assert unchanged_findings(read_steps(bf16))[0] == []
    skipped = [replace(s, scale=1024.0, skipped=s.n >= 3) for s in stuck]
    assert unchanged_findings(read_steps(_run(tmp_path / "skipped", skipped)))[0] == []
    warmup = [replace(s, lr=0.0) if s.n >= 3 else s for s in stuck]
    assert unchanged_findings(read_steps(_run(tmp_path / "lr0", warmup)))[0] == []


# -- the loss scale grows back ----------------------------------------------------------------------


def _scaler_line(interval: int) -> dict[str, object]:
    return {"k": "scaler", "opt": 0, "n": 1, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": interval}


def test_a_scale_that_grows_after_growth_interval_clean_steps_is_no_finding_and_a_fixed_one_is_named(
        tmp_path: Path) -> None:
    grows = [replace(s, scale=1024.0 * 2 ** ((s.n - 1) // 3)) for s in trajectory(1, 9)]  # x2 every 3 steps
    findings, cover = growth_findings(read_steps(_run(tmp_path / "grows", grows, after=[_scaler_line(3)])))
    assert findings == [] and cover.compared == 4  # 2 growths seen on each rank
    fixed = [replace(s, scale=1024.0) for s in trajectory(1, 9)]
    findings, _ = growth_findings(read_steps(_run(tmp_path / "fixed", fixed, after=[_scaler_line(3)])))
    assert [(f.invariant, f.step, f.ranks, f.name) for f in findings] == [
        (Invariant.SCALER, 4, (0, 1), "optimizer 0's loss scaler")]
    skips = [replace(s, scale=1024.0, skipped=s.n % 3 == 0) for s in trajectory(1, 9)]  # never 3 clean in a row
    findings, cover = growth_findings(read_steps(_run(tmp_path / "skips", skips, after=[_scaler_line(3)])))
    assert findings == [] and cover.compared == 0 and "growth_interval" in cover.reason
