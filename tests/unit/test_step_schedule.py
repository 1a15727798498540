"""The step records' schedule (docs/step-records.md#the-schedule): the optimizer state and the
RNG states are read at a process's first 8 steps, the step after a save or restore and every 8th
step; parameters and gradients at every step. Real processes with the run agent; the checks read
the records back: a resume that never loaded the optimizer state is still named at its first
step, a correct one agrees, and the schedule's gaps are never a difference."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from trainguard.checks.divergence import (
    Agreement,
    Divergence,
    first_divergence,
    observed_resume_causes,
)
from trainguard.launch.hook import ENV_RUN_SPEC, ENV_SPEC, STEPS_DIR, run_hook_env
from trainguard.launch.steps import read_steps

pytest.importorskip("torch")

#: 26 steps of Adam with dropout; a save after step --save-at; --resume loads it, the
#: optimizer's state too unless --no-optimizer (the planted defect)
JOB = textwrap.dedent(
    """
    import sys, torch
    flags = dict(zip(sys.argv[1::2], sys.argv[2::2]))  # --save-at N, --ckpt PATH, --resume 1, --no-optimizer 1
    save_at, ckpt = int(flags.get("--save-at", 0)), flags.get("--ckpt")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Dropout(0.2), torch.nn.Linear(16, 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(4, 6, generator=g), torch.randn(4, 1, generator=g)) for _ in range(26)]
    start = 0
    if "--resume" in flags:
        ck = torch.load(ckpt, weights_only=True)
        model.load_state_dict(ck["model"]); torch.set_rng_state(ck["rng"]); start = ck["step"]
        if "--no-optimizer" not in flags:
            opt.load_state_dict(ck["optimizer"])
    for step in range(start + 1, 27):
        x, y = data[step - 1]
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step(); opt.zero_grad()
        if step == save_at:
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "rng": torch.get_rng_state(),
                        "step": step}, ckpt)
    """
)


def _run(run_dir: Path, *args: str, every: str | None = None) -> None:
    env = {k: v for k, v in os.environ.items() if k not in (ENV_SPEC, ENV_RUN_SPEC, "PYTHONPATH", "RANK")}
    env.update({"OMP_NUM_THREADS": "1", **({"TRAINGUARD_STEP_STATE_EVERY": every} if every else {})})
    env.update(run_hook_env({"steps_dir": str(run_dir / STEPS_DIR)}, env))
    done = subprocess.run([sys.executable, "-c", JOB, *args], env=env, capture_output=True, text=True, timeout=120,
                          check=False)
    assert done.returncode == 0, done.stderr


def _read(run_dir: Path) -> dict[str, Any]:
    steps = read_steps(run_dir).ranks[0].steps
    return {"optim": [s.n for s in steps if s.optim is not None], "rng": [s.n for s in steps if s.rng is not None],
            "all": [s.n for s in steps if s.param and all(g is not None for g in s.grad.values())]}


def test_the_schedule_and_a_resume_compared_on_it_where_a_lost_optimizer_state_is_named_at_its_first_step(
        tmp_path: Path) -> None:
    ckpt = str(tmp_path / "ck.pt")
    _run(tmp_path / "reference", "--save-at", "13", "--ckpt", ckpt)
    read = _read(tmp_path / "reference")
    assert read["all"] == list(range(1, 27))  # parameters and gradients at every step
    assert read["optim"] == read["rng"] == [1, 2, 3, 4, 5, 6, 7, 8, 14, 16, 24]  # first 8, after the save, every 8th
    _run(tmp_path / "resumed", "--resume", "1", "--ckpt", ckpt)
    _run(tmp_path / "lost", "--resume", "1", "--no-optimizer", "1", "--ckpt", ckpt, every="1")
    assert _read(tmp_path / "lost")["optim"] == _read(tmp_path / "lost")["rng"] == list(range(1, 14))  # n of 13 steps
    reference = read_steps(tmp_path / "reference")
    clean = first_divergence(reference, read_steps(tmp_path / "resumed"), offset=13)
    assert isinstance(clean, Agreement) and (clean.first_step, clean.last_step) == (14, 26), clean
    lost = read_steps(tmp_path / "lost")  # read at every step, compared where the reference read too
    found = first_divergence(reference, lost, offset=13)
    assert isinstance(found, Divergence) and (found.step, found.first.kind) == (14, "optimizer state"), found
    assert observed_resume_causes(found, lost, reference)[0].key == "optimizer"
