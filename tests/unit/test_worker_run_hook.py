"""The run agent in a rank the launcher does not start (Ray Train's workers): the driver
installs it once the rank is known (trainguard.raytrain.driver), from the spec the runner puts
in ``TRAINGUARD_WORKER_RUN_HOOK`` -- a variable the start-up hook does not read, so the driver's
own process and Ray's other workers record nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from trainguard._internal import envvars
from trainguard.launch.hook import (
    ENV_RUN_SPEC,
    PACE_DIR,
    STEPS_DIR,
    hook_pythonpath,
    worker_run_hook_env,
)
from trainguard.launch.pace import read_pace

# a process that imports torch first (as a Ray worker has), learns its rank later, then trains and
# ends as Ray ends a worker: the driver flushes the agent, no exit handler runs
WORKER = textwrap.dedent(
    """
    import json, os, sys
    import torch
    os.environ["RANK"], os.environ["WORLD_SIZE"] = "1", "2"   # what Ray Train sets later
    from trainguard.launch.hook import install_run_agent
    install_run_agent(sys.argv[1])
    torch.manual_seed(0)
    m = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    for _ in range(3):
        m(torch.randn(4, 3)).sum().backward()
        opt.step()
        opt.zero_grad()
    from trainguard.launch.hook import flush_run_agent
    flush_run_agent()
    sys.stdout.flush()
    os._exit(0)
    """
)


def test_a_worker_installs_the_agent_after_its_start_and_records_under_its_rank(tmp_path: Path) -> None:
    env = worker_run_hook_env(tmp_path / STEPS_DIR, tmp_path / PACE_DIR)
    assert set(env) == {envvars.WORKER_RUN_HOOK}  # no PYTHONPATH, no TRAINGUARD_RUN_HOOK
    spec = json.loads(env[envvars.WORKER_RUN_HOOK])
    assert spec["steps_dir"] == str(tmp_path / STEPS_DIR) and spec["pace_dir"] == str(tmp_path / PACE_DIR)
    assert worker_run_hook_env(None) == {}  # nothing to record: no agent
    base = {k: v for k, v in os.environ.items() if k not in (ENV_RUN_SPEC, "RANK", "WORLD_SIZE", "PYTHONPATH")}
    # the start-up hook is on the path with the worker spec in the environment: it stays inert
    # (else it would record from the start, as rank 0: Ray's other processes, the driver)
    child = {**base, **env, "OMP_NUM_THREADS": "1", "PYTHONPATH": hook_pythonpath(base)}
    done = subprocess.run([sys.executable, "-c", WORKER, env[envvars.WORKER_RUN_HOOK]], env=child,
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert "trainguard run hook" not in done.stderr, done.stderr
    assert sorted(p.name for p in (tmp_path / STEPS_DIR).iterdir()) == ["rank1.jsonl"]
    lines = [json.loads(line) for line in (tmp_path / STEPS_DIR / "rank1.jsonl").read_text().splitlines()]
    assert lines[0]["k"] == "meta" and lines[0]["rank"] == 1 and lines[0]["world"] == 2
    steps = [r for r in lines if r["k"] == "step"]
    assert [s["n"] for s in steps] == [1, 2, 3]
    assert set(steps[0]["param"]) == {"weight", "bias"}  # the model made after the install is named
    # each step's clocks too (the stragglers of a Ray job), written by the driver's flush
    assert len(read_pace(tmp_path / PACE_DIR)[1]) == 3

