"""What the invariants' records (``_trainguard_step_extras``, docs/invariants.md) cost a step, in
this process: the run agent installed for real (torch patched as in a hooked rank), then each
piece timed over many calls, the best of 5 rounds (CPU time: a busy machine's other processes do
not count):

* ``on_record``: what a step record adds (a plan lookup, the carried/eval/clip fields);
* ``before_backward``: the first backward after a step with ``set_to_none`` gradients (one
  ``p.grad is None`` per parameter), at 10 and 300 parameters, and with zero-filled gradients
  (one ``_foreach_norm``);
* a watched module's call (``Dropout``) with and without the wrapper of its ``forward``;
* a clip call with and without the wrapper.

    .venv/bin/python -m tests.benchmarks.step_extras_cost
"""

from __future__ import annotations

import os
import tempfile
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch

from tests.helpers import load_hook_module

CALLS = 2000


def best_us(fn: Callable[[], Any], calls: int = CALLS, rounds: int = 5) -> float:
    """The best of ``rounds`` CPU times of ``calls`` calls of ``fn``, per call, in µs."""
    best = float("inf")
    for _ in range(rounds):
        started = time.process_time()
        for _ in range(calls):
            fn()
        best = min(best, time.process_time() - started)
    return best / calls * 1e6


def _agent(steps_dir: str) -> Any:
    run_agent = load_hook_module("_trainguard_run_agent", "_trainguard_run_agent")
    import sys

    sys.modules["_trainguard_run_agent"] = run_agent
    agent = run_agent.Agent({"steps_dir": steps_dir})
    agent.install()  # torch is imported: patched now
    return agent.steps


def _optimizer(params: int) -> tuple[torch.optim.Optimizer, list[torch.nn.Parameter]]:
    tensors = [torch.nn.Parameter(torch.randn(16)) for _ in range(params)]
    return torch.optim.SGD(tensors, lr=0.1), tensors


def main() -> None:
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        steps = _agent(os.path.join(tmp, "steps"))
        extras = steps.extras
        rows: list[tuple[str, float]] = []
        for size in (10, 300):
            opt, tensors = _optimizer(size)
            for t in tensors:
                t.grad = torch.ones(16)
            opt.step()  # recorded: the plan and the params/model lines made once
            opt.step()
            record: dict[str, Any] = {}
            plan = steps.names[id(opt)]
            rows.append((f"on_record, {size} parameters", best_us(lambda o=opt, r=record: extras.on_record(o, 0, 3, r))))

            def arm(p: Any = plan, o: Any = opt) -> None:
                extras.watch[id(o)] = [p.params, p.names, None, weakref.ref(o)]
                extras.before_backward()

            for t in tensors:
                t.grad = None
            rows.append((f"first backward after a step, {size} parameters, set_to_none", best_us(arm)))
            for t in tensors:
                t.grad = torch.zeros(16)
            rows.append((f"first backward after a step, {size} parameters, zero-filled", best_us(arm, calls=200)))
            extras.watch.clear()
        drop = torch.nn.Dropout(0.1)
        x = torch.randn(32, 64)
        wrapped = rows_call = best_us(lambda: drop(x))
        forward = torch.nn.Dropout.forward
        torch.nn.Dropout.forward = forward.__wrapped__  # type: ignore[attr-defined]
        bare = best_us(lambda: drop(x))
        torch.nn.Dropout.forward = forward
        rows.append(("Dropout(0.1) call: the wrapper's share", wrapped - bare))
        rows.append(("Dropout(0.1) call, wrapped", rows_call))
        p = [torch.nn.Parameter(torch.randn(16))]
        p[0].grad = torch.ones(16)
        clip = torch.nn.utils.clip_grad_norm_
        wrapped_clip = best_us(lambda: clip(p, 1.0), calls=500)
        bare_clip = best_us(lambda: clip.__trainguard_wrapped__(p, 1.0), calls=500)  # type: ignore[attr-defined]
        rows.append(("clip_grad_norm_ call: the wrapper's share", wrapped_clip - bare_clip))
        for what, us in rows:
            print(f"{what:<70} {us:8.2f} µs")


if __name__ == "__main__":
    main()
