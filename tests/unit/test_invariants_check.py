"""The invariants check's wiring (trainguard.checks.invariants_check): which run it reads (another
check's uninterrupted run when the session makes one, of two or more ranks first; else its own),
and a run that recorded no step is an error, never a pass."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from tests.helpers import TOY
from tests.steplines import trajectory, write_rank
from trainguard.checks.invariants import check_invariants
from trainguard.checks.invariants_check import invariants_verdict
from trainguard.config.settings import Settings
from trainguard.launch.hook import ENV_RUN_SPEC, ENV_SPEC, STEPS_DIR, run_hook_env
from trainguard.launch.samples import read_samples
from trainguard.launch.steps import read_steps
from trainguard.session import check
from trainguard.session.plan import make_plan


def _job(where: Path, checks: str, *, extra: str = "") -> Path:
    where.mkdir(parents=True, exist_ok=True)
    path = where / "trainguard.yaml"
    path.write_text(textwrap.dedent(f"""\
        job:
          name: toy
          command: "python {TOY} --steps {{steps}} --seed {{seed}} --ckpt-dir {{checkpoint_dir}}"
          world_size: 1
          metrics:
            loss: 'step (?P<step>\\d+) loss (?P<value>\\S+)'
          timeout: 60
          stall_timeout: 20
        """) + extra + "checks:\n" + textwrap.indent(checks, "  "))
    return path


def _invariants_runs(path: Path, only: list[str] | None = None) -> list[tuple[int, int, bool]]:
    plan = make_plan(path, Settings(), only=only)
    (planned,) = [c for c in plan.checks if c.name == "invariants"]
    return [(r.steps, r.world_size, r.reference is not None) for r in planned.runs]


def test_it_reads_the_run_another_check_makes_the_multi_rank_one_first(tmp_path: Path) -> None:
    both = "determinism: {steps: 6}\nparallel: {steps: 8, world_size: 2}\ninvariants: {}\n"
    assert _invariants_runs(_job(tmp_path / "a", both)) == [(8, 2, True)]
    without = make_plan(_job(tmp_path / "w", both.replace("invariants: {}\n", "")), Settings())
    assert make_plan(_job(tmp_path / "a", both), Settings()).launches == without.launches  # no launch of its own
    assert _invariants_runs(_job(tmp_path / "b", "determinism: {steps: 6}\ninvariants: {}\n")) == [(6, 1, True)]
    # another seed is another run: its own
    other = "determinism: {steps: 6}\ninvariants: {seed: 3}\n"
    assert _invariants_runs(_job(tmp_path / "c", other)) == [(20, 1, True)]
    assert _invariants_runs(_job(tmp_path / "d", "invariants: {steps: 5}\n")) == [(5, 1, True)]


def test_nothing_compared_is_a_skip_saying_why_never_a_pass(tmp_path: Path) -> None:
    # one rank, one step, no DataLoader: no invariant applies
    write_rank(tmp_path, 0, trajectory(1, 1))
    found = check_invariants(read_steps(tmp_path), read_samples(tmp_path))
    status, summary = invariants_verdict(found, has_steps=True, run_dir=str(tmp_path))
    assert (status, found.compared) == ("skipped", 0), summary
    assert "replicas: one rank recorded steps" in summary and "trains: 1 optimizer(s) of a rank recorded fewer" in summary
    assert "data: no sample records" in summary
    write_rank(tmp_path, 0, trajectory(1, 3))  # two steps or more: every parameter's gradient is checked
    status, summary = invariants_verdict(check_invariants(read_steps(tmp_path), {}), has_steps=True, run_dir="r")
    assert status == "passed" and "trains: 3 parameter(s) checked" in summary and "not checked: replicas" in summary
    assert invariants_verdict(check_invariants(read_steps(tmp_path / "none"), {}), has_steps=False,
                              run_dir="r")[0] == "error"


def test_a_run_without_step_records_is_an_error_and_record_steps_off_a_skip(tmp_path: Path) -> None:
    # toy_train.py imports no torch: its run records no optimizer step
    report = check(_job(tmp_path / "toy", "invariants: {steps: 3}\n"))
    (result,) = report.checks
    assert result.status == "error", result.summary
    assert "left no step records, so no invariant was checked" in result.summary
    report = check(_job(tmp_path / "off", "invariants: {steps: 3}\n", extra="  record_steps: false\n"))
    (result,) = report.checks
    assert result.status == "skipped" and "job.record_steps is false" in result.summary, result.summary


#: three small loops under the real run agent, each with a defect its records show: a loss scale
#: set back by hand after an overflow, a head replaced after the optimizer was built, a layer frozen
#: after it was built
DEFECTS = textwrap.dedent(
    """
    import torch
    torch.manual_seed(0)
    m = torch.nn.Linear(4, 1)
    opt = torch.optim.Adam(m.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    for i in range(3):
        scaler.scale(m(torch.randn(2, 4)).sum()).backward()
        if i == 0:
            m.weight.grad[0, 0] = float("inf")
        scaler.step(opt); scaler.update(1024.0); opt.zero_grad()

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model[1] = torch.nn.Linear(4, 1)  # the optimizer keeps the old head's parameters
    for _ in range(3):
        model(torch.randn(2, 4)).sum().backward(); opt.step(); opt.zero_grad()

    body = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(body.parameters(), lr=0.1)
    body[0].weight.requires_grad_(False)
    for _ in range(3):
        body(torch.randn(2, 4)).sum().backward(); opt.step(); opt.zero_grad()
    """
)


def test_the_real_agents_records_show_a_scale_set_back_a_replaced_head_and_a_frozen_layer(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in (ENV_SPEC, ENV_RUN_SPEC, "PYTHONPATH", "RANK")}
    env.update(run_hook_env({"steps_dir": str(tmp_path / STEPS_DIR)}, {**env, "OMP_NUM_THREADS": "1"}))
    done = subprocess.run([sys.executable, "-c", DEFECTS], env=env, capture_output=True, text=True, timeout=120,
                          check=False)
    assert done.returncode == 0, done.stderr
    found = check_invariants(read_steps(tmp_path), {})
    named = sorted((f.invariant.value, f.optimizer, f.step, f.name) for f in found.findings)
    assert named == [("scaler", 0, 1, "optimizer 0's loss scaler"), ("trains", 1, 1, "1.bias"), ("trains", 1, 1, "1.weight"),
                     ("trains", 1, 1, "group0.2"), ("trains", 1, 1, "group0.3"), ("trains", 2, 1, "0.weight")], named
    new_head = next(f for f in found.findings if f.name == "1.weight")  # the new head: trained, in no group
    assert "no optimizer's param group holds it" in new_head.observation
    replaced = next(f for f in found.findings if f.name == "group0.2")
    assert "replaced after the optimizer was built" in replaced.observation


def test_the_gate_adds_it_where_another_check_makes_the_run_it_reads(tmp_path: Path) -> None:
    """``trainguard gate`` runs the invariants check by default, with ``missing_records: skip``,
    only where the job file does not configure it, records steps, and another check makes an
    uninterrupted run of the same job (no launch of its own); otherwise the checks are the file's."""
    from trainguard.config import load_config
    from trainguard.gate.policy import gate_checks_to_run

    def names(checks: str, extra: str = "", where: str = "j") -> list[str]:
        return [n for n, _ in gate_checks_to_run(load_config(_job(tmp_path / where, checks, extra=extra)))]

    assert names("determinism: {steps: 6}\n") == ["determinism", "invariants"]
    (_, added) = gate_checks_to_run(load_config(_job(tmp_path / "s", "canary: {steps: 6}\n")))
    assert added[0] == "invariants" and added[1].missing_records == "skip"  # type: ignore[attr-defined]
    assert names("smoke: {steps: 3}\n", where="smoke") == ["smoke"]  # nothing to read: no run of its own
    assert names("determinism: {steps: 6}\n", "  record_steps: false\n", "off") == ["determinism"]
    configured = gate_checks_to_run(load_config(_job(tmp_path / "c", "determinism: {steps: 6}\ninvariants: {seed: 3}\n")))
    assert [n for n, _ in configured] == ["determinism", "invariants"]
    assert configured[1][1].missing_records == "error"  # type: ignore[attr-defined]
