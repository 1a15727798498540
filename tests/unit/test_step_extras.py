"""The run agent's records for the invariants check (``_trainguard_step_extras``, docs/step-records.md),
in one real hooked process: the ``params`` and ``model`` lines, ``carried``, ``eval_in_step``, the
``eval`` line and ``clip`` on the step lines, each with its clean twin in the same process (one
optimizer per scenario), read back through ``read_steps``."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from trainguard.launch.hook import ENV_RUN_SPEC, ENV_SPEC, STEPS_DIR, run_hook_env
from trainguard.launch.steps import read_steps

torch = pytest.importorskip("torch")

JOB = textwrap.dedent(
    """
    import torch
    from torch.utils.checkpoint import checkpoint
    torch.manual_seed(0)
    F = torch.nn.functional

    def net():
        return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 1))

    def batch():
        return torch.randn(4, 6), torch.randn(4, 1)

    # optimizer 0, clean: zero_grad, validation in eval mode, checkpointing's no-grad forward
    m = net(); opt = torch.optim.SGD(m.parameters(), lr=0.1)
    for _ in range(3):
        x, y = batch(); opt.zero_grad()
        F.mse_loss(checkpoint(m, x.requires_grad_(), use_reentrant=True), y).backward(); opt.step()
        m.eval()
        with torch.no_grad():
            m(x)
        m.train()
    # optimizer 1: the biases' group left out, zero_grad never called
    m = net(); opt = torch.optim.SGD([m[0].weight, m[2].weight], lr=0.1)
    for _ in range(3):
        x, y = batch(); F.mse_loss(m(x), y).backward(); opt.step()
    # optimizer 2: eval mode left on from step 2, then a validation in train mode
    m = net(); opt = torch.optim.SGD(m.parameters(), lr=0.1)
    for i in range(3):
        x, y = batch(); opt.zero_grad(); F.mse_loss(m(x), y).backward(); opt.step()
        m.eval()
    m.train()
    with torch.no_grad():
        m(x)
    # optimizer 3: a GradScaler, clipping before unscale_ at step 1, after it at step 2; optimizer 4 holds
    # its first layer too (and names its parameters as optimizer 1's are named: another model)
    m = net(); opt = torch.optim.SGD(m.parameters(), lr=0.1); scaler = torch.amp.GradScaler("cpu")
    for first in (True, False):
        x, y = batch(); opt.zero_grad(); scaler.scale(F.mse_loss(m(x), y)).backward()
        if first:
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        scaler.unscale_(opt)
        if not first:
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        scaler.step(opt); scaler.update()
        if first:
            other = torch.optim.SGD(m[0].parameters(), lr=0.1); other.step()
    """
)


def test_the_invariants_records_of_each_defect_and_none_of_its_clean_twin(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in (ENV_SPEC, ENV_RUN_SPEC, "PYTHONPATH", "RANK")}
    env.update({"OMP_NUM_THREADS": "1"})
    env.update(run_hook_env({"steps_dir": str(tmp_path / STEPS_DIR)}, env))
    done = subprocess.run([sys.executable, "-c", JOB], env=env, capture_output=True, text=True, timeout=120,
                          check=False)
    assert done.returncode == 0 and "trainguard" not in done.stderr, done.stderr
    rank = read_steps(tmp_path).ranks[0]
    assert rank.malformed == 0
    params = {p.opt: p for p in rank.params}
    assert params[0].groups == (("0.weight", "0.bias", "2.weight", "2.bias"),)
    assert params[0].dtype("0.bias") == "float32"
    assert params[1].groups == (("0.weight", "2.weight"),)
    assert params[4].groups == (("0.weight", "0.bias"),) and params[4].shared == ("0.weight", "0.bias")
    assert params[1].shared == params[3].shared == ()
    models = {m.opt: m for m in rank.models}
    assert models[0].grad == () and models[0].watched == 1
    assert models[1].trainable == ("0.weight", "0.bias", "2.weight", "2.bias")
    assert models[1].grad == ("0.bias", "2.bias")  # trainable, given a gradient, in no group
    steps = {(s.opt, s.n): s for s in rank.steps}
    assert [steps[0, n].carried for n in (1, 2, 3)] == [None, None, None]
    assert [steps[1, n].carried for n in (1, 2, 3)] == [None, ("0.weight", "2.weight"), ("0.weight", "2.weight")]
    assert [steps[0, n].eval_in_step for n in (1, 2, 3)] == [(), (), ()]
    assert [steps[2, n].eval_in_step for n in (1, 2, 3)] == [(), ("1",), ("1",)]
    assert [(e.opt, e.after, e.train_mode) for e in rank.evals] == [(2, 3, ("1",))]  # not checkpointing's
    assert [(steps[3, n].clip.calls, steps[3, n].clip.scaled) for n in (1, 2)] == [(1, 1), (1, 0)]  # type: ignore[union-attr]
    assert steps[0, 1].clip is None
    assert [(s.opt, s.growth_factor, s.backoff_factor, s.growth_interval) for s in rank.scalers] == [(3, 2.0, 0.5, 2000)]
