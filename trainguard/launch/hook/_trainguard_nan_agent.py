"""The ``nan`` fault inside a rank's Python: a NaN (or Inf) put into the loss or the gradients.

Loaded by ``_trainguard_fault_agent`` (by file path, standard library only) for a spec with
``fault: nan``, in the target rank's first Python process only (DataLoader workers and spawned
children stay inert). torch is patched the moment the job imports it, never imported here.

Spec keys besides the fault agent's (``rank``, ``trigger``, ``events``, ``step``): ``target``
(``loss`` | ``grads``) and ``value`` (``nan`` | ``inf`` | ``-inf``). Once the trigger file exists
(the drill creates it when the rank has printed step ``after_step``), once:

* ``target: loss``: the next loss computed with autograd on by a ``torch.nn.functional`` loss
  function (``cross_entropy``, ``mse_loss``, ... and the ``torch.nn`` ``*Loss`` modules, which
  call them) is returned multiplied by ``value``: the job's own check of its loss sees it, and
  every gradient of the backward from it is non-finite. A loss computed by hand (no such
  function called with autograd on in this process) gets it at ``backward()`` instead: its value
  and the gradient flowing from it are multiplied then, so a check placed before ``backward()``
  sees it one step late.
* ``target: grads``: the next ``torch.autograd.backward`` (which ``Tensor.backward`` calls)
  fills the gradient of every parameter it reaches with ``value``, in a hook that runs before the
  gradient is accumulated: before DDP's all-reduce of it and before ``optimizer.step()``.

The event ``injected`` records the target, the value, where it went in (``via``) and the step:
the optimizer steps done so far in this process (``torch.optim`` counts them) plus one.
"""

from __future__ import annotations

import functools
import importlib
import os
from typing import Any

__all__ = ["NanHook", "is_loss_function"]

#: loss functions of torch.nn.functional whose names do not end in ``_loss``
_OTHER_LOSSES = ("cross_entropy", "binary_cross_entropy", "binary_cross_entropy_with_logits", "kl_div")


def is_loss_function(name: str) -> bool:
    """Whether ``torch.nn.functional.<name>`` computes a loss."""
    return not name.startswith("_") and (name.endswith("_loss") or name in _OTHER_LOSSES)


class NanHook:
    """The armed numerics fault of one process; ``agent`` is the fault agent (its ``spec``,
    ``event`` and ``triggered``)."""

    def __init__(self, agent: Any) -> None:
        self.agent = agent
        self.target = str(agent.spec.get("target", "loss"))
        self.value = float(agent.spec.get("value", "nan"))
        self.pid = os.getpid()
        self.done = False
        #: a torch.nn.functional loss was computed with autograd on here: the loss target waits
        #: for the next one rather than taking the backward of a loss it never saw
        self.loss_function_seen = False
        self._optimizer_steps: dict[int, int] = {}

    def _ours(self) -> bool:
        return not self.done and os.getpid() == self.pid  # forked workers inherit the patches

    def steps_done(self) -> int:
        """Optimizer steps done in this process (the most of any one optimizer)."""
        return max(self._optimizer_steps.values(), default=0)

    def _fired(self, via: str, **data: Any) -> None:
        self.done = True
        self.agent.fired = True
        done = self.steps_done()
        self.agent.event("injected", target=self.target, value=str(self.value), via=via,
                         step=done + 1 if done else None, optimizer_steps_done=done, **data)

    # -- patching ----------------------------------------------------------------------------

    def patch(self, torch: Any) -> None:
        """Wrap torch's loss functions and ``torch.autograd.backward``; count optimizer steps."""
        functional = torch.nn.functional
        wrapped = []
        for name in dir(functional) if self.target == "loss" else ():  # grads: left as they are
            real = getattr(functional, name)
            if is_loss_function(name) and callable(real) and not getattr(real, "_trainguard_hook", False):
                setattr(functional, name, self._loss_function(real, name))
                wrapped.append(name)
        real_backward = torch.autograd.backward
        if not getattr(real_backward, "_trainguard_hook", False):
            torch.autograd.backward = self._backward(torch, real_backward)
        try:
            optimizer = importlib.import_module("torch.optim.optimizer")
            optimizer.register_optimizer_step_post_hook(self._count_step)
            counted: Any = True
        except Exception as exc:  # an older torch: the step is then read from the job's metrics
            counted = f"{type(exc).__name__}: {exc}"
        self.agent.event("torch_patched", loss_functions=len(wrapped), counts_steps=counted)

    def _count_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        key = id(optimizer)
        self._optimizer_steps[key] = self._optimizer_steps.get(key, 0) + 1

    def _loss_function(self, real: Any, name: str) -> Any:
        hook = self

        @functools.wraps(real)
        def loss(*args: Any, **kwargs: Any) -> Any:
            out = real(*args, **kwargs)
            if not hook._ours() or not getattr(out, "requires_grad", False):
                return out  # done, a child process, or no training loss (eval, no_grad)
            hook.loss_function_seen = True
            if hook.target == "loss" and hook.agent.triggered():
                out = out * hook.value
                hook._fired(f"torch.nn.functional.{name}")
            return out

        loss._trainguard_hook = True  # type: ignore[attr-defined]
        return loss

    def _backward(self, torch: Any, real: Any) -> Any:
        hook = self

        @functools.wraps(real)
        def backward(tensors: Any, grad_tensors: Any = None, *args: Any, **kwargs: Any) -> Any:
            if not hook._ours() or (hook.target == "loss" and hook.loss_function_seen) \
                    or not hook.agent.triggered():
                return real(tensors, grad_tensors, *args, **kwargs)
            roots = (tensors,) if isinstance(tensors, torch.Tensor) else tuple(tensors)
            if hook.target == "grads":
                handles = hook._poison_gradients(torch, roots)
                try:
                    return real(tensors, grad_tensors, *args, **kwargs)
                finally:
                    for handle in handles:
                        handle.remove()
            return real(*hook._poison_loss(torch, roots, grad_tensors), *args, **kwargs)

        backward._trainguard_hook = True  # type: ignore[attr-defined]
        return backward

    # -- the injection ---------------------------------------------------------------------

    def _poison_loss(self, torch: Any, roots: tuple[Any, ...], grad_tensors: Any) -> tuple[Any, Any]:
        """A loss computed by hand, at its backward: its value and its gradient times value."""
        if grad_tensors is None or isinstance(grad_tensors, torch.Tensor):
            grads = [grad_tensors] * len(roots)
        else:
            grads = list(grad_tensors)
        out = []
        for root, grad in zip(roots, grads):
            root.data.mul_(self.value)  # the value the job prints after backward
            out.append(torch.full_like(root, self.value) if grad is None else grad * self.value)
        self._fired("backward (a loss computed by hand)")
        return roots, out

    def _poison_gradients(self, torch: Any, roots: tuple[Any, ...]) -> list[Any]:
        """A hook on every parameter this backward reaches: its gradient becomes ``value``
        before it is accumulated (and all-reduced by DDP)."""
        leaves: dict[int, Any] = {}
        seen: set[Any] = set()
        stack = [r.grad_fn for r in roots if getattr(r, "grad_fn", None) is not None]
        while stack:
            node = stack.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            variable = getattr(node, "variable", None)  # an AccumulateGrad: a leaf's gradient
            if variable is not None and variable.requires_grad:
                leaves[id(variable)] = variable
            stack.extend(fn for fn, _ in node.next_functions)
        if not leaves:
            return []
        value = self.value
        handles = [leaf.register_hook(lambda grad: torch.full_like(grad, value)) for leaf in leaves.values()]
        self._fired("backward (parameter gradients, before accumulation and all-reduce)",
                    parameters=len(handles))
        return handles
