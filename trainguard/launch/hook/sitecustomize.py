"""trainguard's start-up hook: Python runs this at start-up in every rank trainguard launches
with the hook (fault drills; command jobs recording trainer metrics or sample indices).

trainguard puts this directory first on the ranks' PYTHONPATH, so ``site`` imports this module as
``sitecustomize``. It

1. runs the ``sitecustomize`` that would have run without us (the next one on ``sys.path``: a
   distribution's or a virtual environment's), so the job starts as it always does;
2. arms the fault through ``_trainguard_fault_agent`` when ``TRAINGUARD_FAULT_HOOK`` holds its
   spec;
3. installs ``_trainguard_run_agent`` when ``TRAINGUARD_RUN_HOOK`` holds its spec.

Each agent is standard library only and loaded by path (the job's interpreter need not have
trainguard installed); without its variable it is not even loaded. torch is never imported here.
"""

from __future__ import annotations

import os
import sys


def _chain() -> None:
    """Execute the sitecustomize found on the rest of sys.path (as ``site`` would have)."""
    import importlib.machinery
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    rest = []
    for entry in sys.path:
        try:
            same = os.path.samefile(entry or os.curdir, here)
        except OSError:
            same = False
        if not same:
            rest.append(entry)
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    globals()["chained"] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # what site.py does with a failing sitecustomize
        print(f"Error in sitecustomize; set PYTHONVERBOSE for traceback:\n"
              f"{type(exc).__name__}: {exc}", file=sys.stderr)


def _load(env_var: str, module: str, failure: str) -> None:
    """Load the agent ``module`` from this directory and hand it the spec in ``env_var``."""
    raw = os.environ.get(env_var)
    if not raw:
        return
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), module + ".py")
    spec = importlib.util.spec_from_file_location(module, path)
    if spec is None or spec.loader is None:
        return
    agent = importlib.util.module_from_spec(spec)
    sys.modules[module] = agent
    try:
        spec.loader.exec_module(agent)
        agent.install(raw)
    except Exception as exc:  # a broken spec must not stop the job: say it on stderr
        print(f"{failure}: {type(exc).__name__}: {exc}", file=sys.stderr)


if __name__ == "sitecustomize":  # not when imported as trainguard.launch.hook.sitecustomize
    _chain()
    _load("TRAINGUARD_FAULT_HOOK", "_trainguard_fault_agent", "trainguard fault hook not armed")
    _load("TRAINGUARD_RUN_HOOK", "_trainguard_run_agent", "trainguard run hook not installed")
