"""trainguard's start-up hook: what runs inside a rank's Python process, before the job's code.

This directory goes first on a rank's PYTHONPATH, so Python imports its ``sitecustomize.py`` at
start-up (which chains any existing one). Two agents live here, each loaded by file path and
each inert unless its environment variable holds a JSON spec:

* ``_trainguard_fault_agent.py`` (``TRAINGUARD_FAULT_HOOK``, :func:`hook_env`): arms one fault
  of a drill (docs/faults-memory-and-disk.md);
* ``_trainguard_run_agent.py`` (``TRAINGUARD_RUN_HOOK``, :func:`run_hook_env`): records the
  training loss of Hugging Face and Lightning Trainers and the sample indices of each DataLoader
  batch (docs/metrics.md), and with ``_trainguard_step_agent.py`` every optimizer step, checkpoint
  save and state restore (docs/step-records.md).

Both may be active in one process; they share the one PYTHONPATH entry.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from trainguard._internal import envvars

__all__ = [
    "ENV_RUN_SPEC",
    "ENV_SPEC",
    "HOOK_DIR",
    "METRICS_DIR",
    "PACE_DIR",
    "SAMPLES_DIR",
    "STALL_DIR",
    "STALL_FR_ENTRIES",
    "STEPS_CAP",
    "STEPS_DIR",
    "flush_run_agent",
    "hook_env",
    "hook_pythonpath",
    "install_run_agent",
    "mark_training_thread",
    "run_hook_env",
    "worker_run_hook_env",
]

#: the fault agent's spec (a drill's fault)
ENV_SPEC = envvars.FAULT_HOOK
#: the run agent's spec (trainer metrics, sample indices)
ENV_RUN_SPEC = envvars.RUN_HOOK
#: the directory that goes first on the ranks' PYTHONPATH
HOOK_DIR = Path(__file__).resolve().parent
#: under a run directory: the run agent's trainer metrics, ``rank{rank}.jsonl``
METRICS_DIR = "trainguard-metrics"
#: under a run directory: the run agent's sample indices, ``rank{rank}.jsonl``
SAMPLES_DIR = "trainguard-samples"
#: under a run directory: the run agent's step records, ``rank{rank}.jsonl`` (docs/step-records.md)
STEPS_DIR = "trainguard-steps"
#: under a run directory: each rank's answer when the stall watchdog fires, ``rank{rank}.json``,
#: and the ``trigger`` file that asks for it (docs/drills.md "Which rank hung")
STALL_DIR = "trainguard-stall"
#: the run folder's directory of each rank's per-step CPU and wall clocks (docs/drills.md "Stragglers")
PACE_DIR = "trainguard-pace"
#: ``TORCH_FR_BUFFER_SIZE`` for the hooked ranks (the job's own value wins): the Flight Recorder's
#: ring of collectives per process, read back when the job stalls
STALL_FR_ENTRIES = "2000"
#: the size cap of one rank's step records (bytes): then one ``truncated`` line
STEPS_CAP = 64 * 1024 * 1024


def hook_pythonpath(base_env: Mapping[str, str] | None = None) -> str:
    """PYTHONPATH with the hook directory first, then the entries ``base_env`` (else this
    process's environment) already has, the hook's own entry not repeated."""
    env = base_env if base_env is not None else os.environ
    existing = env.get("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
    parts = [str(HOOK_DIR), *[p for p in existing.split(os.pathsep) if p and p != str(HOOK_DIR)]]
    return os.pathsep.join(parts)


def hook_env(spec: Mapping[str, Any], base_env: Mapping[str, str] | None = None) -> dict[str, str]:
    """PYTHONPATH (the hook first, then the job's own entries) and the fault spec for the ranks.

    ``base_env`` is the job's environment; its PYTHONPATH (or this process's) is kept after ours.
    """
    if "trigger" not in spec:
        raise ValueError("a fault hook spec needs a 'trigger' file path")
    return {"PYTHONPATH": hook_pythonpath(base_env), ENV_SPEC: json.dumps(dict(spec))}


def run_hook_env(spec: Mapping[str, Any], base_env: Mapping[str, str] | None = None) -> dict[str, str]:
    """PYTHONPATH (the hook first) and the run agent's spec for the ranks.

    Spec keys: ``metrics_dir`` (where each rank writes ``rank{RANK}.jsonl``), ``huggingface`` and
    ``lightning`` (metric name -> the trainer's key, ``loss`` being the per-step training loss),
    ``samples_dir`` (None: sample indices not recorded), ``steps_dir`` (each optimizer step, save
    and restore; absent or None: not recorded), ``steps_cap`` (bytes per rank) and ``stall_dir``
    (each rank's answer to the stall watchdog; the ranks' ``TORCH_FR_BUFFER_SIZE`` is set unless
    ``base_env`` has it) and ``pace_dir`` (each optimizer step's clocks of the training thread). A drill's fault spec in ``base_env``
    keeps working: both agents load from the same directory.
    """
    env = {"PYTHONPATH": hook_pythonpath(base_env), ENV_RUN_SPEC: json.dumps(dict(spec))}
    if spec.get("stall_dir") and "TORCH_FR_BUFFER_SIZE" not in {**os.environ, **(base_env or {})}:
        env["TORCH_FR_BUFFER_SIZE"] = STALL_FR_ENTRIES
    return env


def worker_run_hook_env(steps_dir: Path | None, pace_dir: Path | None = None, state_every: int | None = None) -> dict[str, str]:
    """The environment of a driver that starts the ranks itself (Ray Train): the run agent's
    spec for the step records under ``steps_dir`` and each step's clocks under ``pace_dir``
    (either None: not recorded) in ``TRAINGUARD_WORKER_RUN_HOOK``, which the start-up hook does
    not read; the driver hands it to each rank (:func:`install_run_agent`). Nothing to record:
    an empty environment."""
    spec: dict[str, object] = {"steps_dir": str(steps_dir), "steps_cap": STEPS_CAP} if steps_dir is not None else {}
    if pace_dir is not None:
        spec["pace_dir"] = str(pace_dir)
    if spec and state_every is not None:
        spec["state_every"] = state_every
    return {envvars.WORKER_RUN_HOOK: json.dumps(spec)} if spec else {}


def install_run_agent(raw_spec: str) -> Any:
    """Install the run agent in this process now, from its spec (the JSON ``run_hook_env``
    puts in ``TRAINGUARD_RUN_HOOK``): for a rank that the start-up hook did not see start, a Ray
    Train worker whose rank Ray sets after its process started. The module is loaded by path
    under the name the start-up hook gives it (once per process; ``install`` is idempotent).
    What the process imported before is patched at once, the rest on import."""
    name = "_trainguard_run_agent"
    module = sys.modules.get(name)
    if module is None:
        spec = importlib.util.spec_from_file_location(name, HOOK_DIR / f"{name}.py")
        if spec is None or spec.loader is None:  # pragma: no cover -- the file is ours
            raise ImportError(f"cannot load {HOOK_DIR / name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return module.install(raw_spec)


def flush_run_agent() -> None:
    """Write what the run agent of this process holds (step lines are written a few together):
    for a process whose end runs no exit handlers (a Ray Train worker). Nothing when no agent
    is installed."""
    module = sys.modules.get("_trainguard_run_agent")
    if module is not None:
        module.flush()


def mark_training_thread() -> None:
    """The calling thread runs the job's steps: a raise of the fault agent armed in this process
    (crash_loop's ``how: raise``) goes there instead of the main thread -- a Ray Train worker
    runs its train function in a thread of its own. Nothing when no agent is armed."""
    module = sys.modules.get("_trainguard_fault_agent")
    if module is not None:
        module.mark_training_thread()
