"""The ``sdc`` fault inside a rank's Python: one bit of one element of one tensor flipped, as a
silent data corruption of the hardware would (docs/invariants.md, "Silent data corruption drills").

Loaded by ``_trainguard_fault_agent`` (by file path, standard library only) for a spec with
``fault: sdc``, in the target rank's first Python process only. torch is never imported here: the
fault agent hands it over when the job imports it.

Spec keys besides the fault agent's (``rank``, ``events``): ``step`` (the optimizer step, from 1 as
torch.optim counts them and the step records number them, at which the flip happens), ``target``,
``mode``, ``bit``, ``index`` and ``name``; each flip is also written to the run directory's
``trainguard-sdc.jsonl`` (``record``: another file). The targets:

* ``parameter``: at the step's optimizer pre-hook (before the run agent records it), the
  parameter as the previous step left it;
* ``optimizer_state``: likewise, the parameter's first floating optimizer state tensor
  (``exp_avg``, ``momentum_buffer``; the first step that has one when the state is still empty);
* ``gradient``: likewise, the parameter's gradient, after DDP reduced it;
* ``gradient_before_reduction``: in the step's backward, in a hook on the parameter that runs
  before its gradient is accumulated, so before DDP's all-reduce averages it into every rank;
* ``output``: in the step's forward, the output of the module ``name`` (default: the module that
  holds the optimizer's first parameter), before the next layer reads it.

``mode: transient`` flips once. ``mode: persistent`` is a stuck bit, as a failing unit has: from
that step on, at every step, the bit is set to the value the first flip gave it (a fresh tensor,
an output or a gradient, whose bit already has that value is left as it is).

Every flip is an event ``flipped``: the rank, the step, the target, the tensor's name (``tensor``: a parameter's or a module's), the element
(``index``, row-major, in the rank's local tensor: a DTensor's shard), the bit, the old and new
values (as Python floats and as bit patterns).
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import importlib.util
import os
import time
from typing import Any

__all__ = ["TARGETS", "SdcHook", "bit_of", "flip_bit", "int_dtype", "strip_prefixes"]

TARGETS = ("parameter", "optimizer_state", "gradient", "gradient_before_reduction", "output")
#: float dtype name -> (bits, the highest exponent bit, the highest mantissa bit)
_LAYOUT = {"float32": (32, 30, 22), "float64": (64, 62, 51), "bfloat16": (16, 14, 6), "float16": (16, 14, 9)}
#: under the run directory (``TRAINGUARD_RUN_DIR``): every flip of every rank, one JSON line each
RECORD = "trainguard-sdc.jsonl"
#: persistent flips recorded at most (each step's is the same element and bit)
MAX_EVENTS = 200


def strip_prefixes(name: str) -> str:
    """``module._orig_mod.0.weight`` -> ``0.weight``: the name the step records give
    (``_trainguard_step_values.clean_name``, the run agent's own)."""
    return _step_values().clean_name(name)  # type: ignore[no-any-return]


def _step_values() -> Any:
    """The run agent's ``_trainguard_step_values``, loaded by path here (its names, not its state)."""
    global _STEP_VALUES
    if _STEP_VALUES is None:
        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_trainguard_step_values.py")
        spec = importlib.util.spec_from_file_location("_trainguard_sdc_step_values", path)
        if spec is None or spec.loader is None:
            raise ImportError(f"no {path}")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        _STEP_VALUES = module
    return _STEP_VALUES


_STEP_VALUES: Any = None


def bit_of(dtype_name: str, bit: Any) -> int:
    """The bit index (0: the lowest) that ``bit`` (``exponent``, ``mantissa`` or an int) means for
    a ``dtype_name`` tensor (``float32``, ``bfloat16``, ...): the highest exponent or mantissa bit."""
    layout = _LAYOUT.get(dtype_name)
    if layout is None:
        raise ValueError(f"an sdc flip needs a floating tensor of {', '.join(_LAYOUT)}, not {dtype_name}")
    width, exponent, mantissa = layout
    if bit in (None, "mantissa"):
        return mantissa
    if bit == "exponent":
        return exponent
    index = int(bit)
    if not 0 <= index < width:
        raise ValueError(f"bit {index} is outside a {dtype_name} ({width} bits: 0..{width - 1})")
    return index


def int_dtype(torch: Any, dtype: Any) -> Any:
    """The integer dtype of the same width as the float ``dtype`` (its bit pattern's view)."""
    return {2: torch.int16, 4: torch.int32, 8: torch.int64}[dtype.itemsize]


def _unravel(index: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    out = []
    for size in reversed(shape):
        out.append(index % size)
        index //= size
    return tuple(reversed(out))


def flip_bit(torch: Any, tensor: Any, index: int, bit: int, set_to: int | None = None) -> dict[str, Any]:
    """Flip bit ``bit`` of element ``index`` (row-major, modulo the element count) of ``tensor``
    in place (``set_to`` 0/1: set it to that instead; a stuck bit). Returns what was done: the
    element's position, the old and new values and bit patterns, and the bit's value after."""
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor  # a DTensor: this rank's shard
    with torch.no_grad():
        data = local.detach()
        count = data.numel()
        if count == 0:
            raise ValueError("an sdc flip needs a tensor with an element; this one is empty")
        position = _unravel(index % count, tuple(data.shape))
        element = data[position] if position else data
        pattern = element.view(int_dtype(torch, element.dtype))
        width = element.dtype.itemsize * 8
        old_bits = int(pattern.item()) & ((1 << width) - 1)
        old = float(element.item())
        was = (old_bits >> bit) & 1
        want = (1 - was) if set_to is None else set_to
        if want != was:
            new_bits = old_bits ^ (1 << bit)
            signed = new_bits - (1 << width) if new_bits >= 1 << (width - 1) else new_bits
            pattern.fill_(signed)
        new_bits = int(pattern.item()) & ((1 << width) - 1)
        return {"index": index % count, "position": list(position), "bit": bit, "dtype": str(element.dtype),
                "old": old, "new": float(element.item()), "old_bits": f"{old_bits:0{width // 4}x}",
                "new_bits": f"{new_bits:0{width // 4}x}", "bit_now": want, "changed": want != was}


class SdcHook:
    """The armed sdc fault of one process; ``agent`` is the fault agent (its ``spec`` and ``event``)."""

    def __init__(self, agent: Any) -> None:
        spec = agent.spec
        self.agent = agent
        self.target = str(spec.get("target", "parameter"))
        self.mode = str(spec.get("mode", "transient"))
        self.step = int(spec.get("step") or 1)
        self.bit_setting = spec.get("bit", "mantissa")
        self.index = int(spec.get("index") or 0)
        self.name = spec.get("name") or None
        run_dir = getattr(agent, "run_dir", None)  # the fault agent reads it from the environment
        self.record_path = spec.get("record") or (os.path.join(run_dir, RECORD) if run_dir else None)
        self.pid = os.getpid()
        self.torch: Any = None
        #: optimizer steps begun (pre-hook) and done (post-hook) in this process, of the first optimizer
        self.begun = 0
        self.done = 0
        self.optimizer: Any = None
        #: the bit's value after the first flip (persistent: it stays stuck there)
        self.stuck: int | None = None
        self.flips = 0
        self.finished = False
        #: gradient_before_reduction: the tensor whose gradient hook is in place
        self._hooked: Any = None
        self._owned: tuple[str, Any, str] | None = None
        self._resolved: tuple[str, Any] | None = None

    # -- patching ----------------------------------------------------------------------------

    def patch(self, torch: Any) -> None:
        """Register torch's global optimizer step hooks (and a global module forward hook for
        the targets that act inside the forward and backward)."""
        self.torch = torch
        optimizer = importlib.import_module("torch.optim.optimizer")
        handle = optimizer.register_optimizer_step_pre_hook(self._pre)
        # first of the global pre-hooks: the flip is in place before the run agent's pre-hook
        # records the step (whichever agent patched torch first)
        first: Any = True
        try:
            optimizer._global_optimizer_pre_hooks.move_to_end(handle.id, last=False)
        except Exception as exc:  # another torch: the flip shows one step later in the records
            first = f"{type(exc).__name__}: {exc}"
        optimizer.register_optimizer_step_post_hook(self._post)
        if self.target in ("output", "gradient_before_reduction"):
            importlib.import_module("torch.nn.modules.module").register_module_forward_hook(self._forward)
        self.agent.event("torch_patched", target=self.target, step=self.step, first_pre_hook=first)

    def _ours(self) -> bool:
        return not self.finished and os.getpid() == self.pid

    def _due(self, step: int) -> bool:
        return step == self.step or (self.mode == "persistent" and self.flips > 0 and step > self.step)

    def _guard(self, what: str, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except Exception as exc:  # never break the job for a bug of ours: say so
            self.finished = True
            self.agent.event("error", error=f"{what}: {type(exc).__name__}: {exc}")
            return None

    def _pre(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if not self._ours():
            return
        if self.optimizer is None:
            self.optimizer = optimizer
        if optimizer is not self.optimizer:
            return  # one optimizer's steps are counted (the first to step)
        self.begun += 1
        if self.target in ("parameter", "optimizer_state", "gradient"):
            due = self._due(self.begun) or (self.target == "optimizer_state" and self.flips == 0
                                              and self.begun > self.step)
            if due:
                self._guard(f"flipping a bit of the {self.target}", self._flip_at_step, optimizer)

    def _post(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if optimizer is self.optimizer:
            self.done += 1

    # -- the targets -------------------------------------------------------------------------

    def _flip_at_step(self, optimizer: Any) -> None:
        name, param = self._parameter(optimizer)
        if self.target == "parameter":
            self._flip(param, name, self.begun)
        elif self.target == "gradient":
            if param.grad is not None:
                self._flip(param.grad, name, self.begun)
        else:
            state = optimizer.state.get(param, {})
            for key, value in sorted(state.items()):
                if isinstance(value, self.torch.Tensor) and value.is_floating_point() and value.numel() > 1:
                    self._flip(value, name, self.begun, state_key=key)
                    return

    def _forward(self, module: Any, inputs: Any, output: Any) -> Any:
        if not self._ours() or not self._due(self.done + 1):
            return None
        return self._guard(f"flipping a bit of the {self.target}", self._in_forward, module, output)

    def _in_forward(self, module: Any, output: Any) -> Any:
        torch = self.torch
        if self.target == "gradient_before_reduction":
            name, owner, attr = self._owner()
            # the tensor the module computes with now: under FSDP2 the unsharded parameter (a
            # hook on the sharded one never runs: its gradient is the reduce-scatter's result)
            tensor = getattr(owner, attr, None) if module is owner else None
            if tensor is not None and tensor is not self._hooked and getattr(tensor, "requires_grad", False):
                self._hooked = tensor
                tensor.register_hook(lambda grad: self._gradient_hook(grad, name))
            return None
        name, target = self._module()
        if module is not target or not isinstance(output, torch.Tensor) or not output.is_floating_point():
            return None
        step = self.done + 1
        if self.flips and self._last_step == step:
            return None  # once a step: a module called twice in a step (shared weights) keeps the first
        changed = output.clone()
        self._flip(changed, name, step)
        return changed

    def _gradient_hook(self, grad: Any, name: str) -> Any:
        step = self.done + 1
        if not self._ours() or not self._due(step) or (self.flips and self._last_step == step):
            return None
        changed = grad.clone()
        self._guard("flipping a bit of the gradient before its reduction", self._flip, changed, name, step)
        return changed

    _last_step = 0

    # -- what to flip ------------------------------------------------------------------------

    def _modules(self) -> list[Any]:
        """Every nn.Module of the process (looked up once, at the first flip)."""
        module_type = self.torch.nn.Module
        return [o for o in gc.get_objects() if isinstance(o, module_type)]

    def _root(self) -> Any:
        """The module holding the most parameters: the model (with its wrappers)."""
        return max(self._modules(), key=lambda m: sum(1 for _ in m.parameters()))

    def _names(self) -> dict[int, tuple[str, Any]]:
        """id(tensor) -> (its name as the step records give it, the tensor), from the module
        giving the longest name (the model's root, wrappers dropped)."""
        names: dict[int, tuple[str, Any]] = {}
        for module in self._modules():
            with contextlib.suppress(Exception):
                for qualified, param in module.named_parameters():
                    name = strip_prefixes(qualified)
                    if len(name) > len(names.get(id(param), ("",))[0]):
                        names[id(param)] = (name, param)
        return names

    def _parameter(self, optimizer: Any) -> tuple[str, Any]:
        if self._resolved is not None:
            return self._resolved
        names = self._names()
        if self.name is not None:
            found = [(n, p) for n, p in names.values() if n == self.name]
            if not found:
                raise LookupError(f"no parameter named {self.name!r} (there are: "
                                  f"{', '.join(sorted(n for n, _ in names.values())[:12])})")
            self._resolved = found[0]
        else:
            optimizer = optimizer or self.optimizer
            if optimizer is not None:
                param = optimizer.param_groups[0]["params"][0]
            else:  # before the first optimizer step: the model's first parameter
                param = next(self._root().parameters())
            self._resolved = (names.get(id(param), ("group0.0", param))[0], param)
        return self._resolved

    def _owner(self) -> tuple[str, Any, str]:
        """(the target parameter's name, the module that holds it, its attribute name there)."""
        if self._owned is None:
            root = self._root()
            # by name: under FSDP2 the optimizer holds the sharded parameters, the modules (in
            # the forward) the unsharded ones
            name = self.name or strip_prefixes(next(root.named_parameters())[0])
            qualified = next((q for q, _ in root.named_parameters() if strip_prefixes(q) == name), None)
            if qualified is None:
                raise LookupError(f"no module of the model holds the parameter {name!r}")
            path, _, attr = qualified.rpartition(".")
            self._owned = (name, root.get_submodule(path) if path else root, attr)
        return self._owned

    def _module(self) -> tuple[str, Any]:
        if self._resolved is not None:
            return self._resolved
        modules: dict[int, tuple[str, Any]] = {}
        for root in self._modules():
            with contextlib.suppress(Exception):
                for qualified, module in root.named_modules():
                    name = strip_prefixes(qualified + ".").rstrip(".")
                    if name and len(name) > len(modules.get(id(module), ("",))[0]):
                        modules[id(module)] = (name, module)
        if self.name is not None:
            found = [(n, m) for n, m in modules.values() if n == self.name]
            if not found:
                raise LookupError(f"no module named {self.name!r} (there are: "
                                  f"{', '.join(sorted(n for n, _ in modules.values())[:12])})")
            self._resolved = found[0]
        else:  # the module that holds the model's first parameter
            self._resolved = next((strip_prefixes(n + ".").rstrip("."), m) for n, m in self._root().named_modules()
                                  if any(True for _ in m.parameters(recurse=False)))
        return self._resolved

    # -- the flip ----------------------------------------------------------------------------

    def _flip(self, tensor: Any, name: str, step: int, state_key: str | None = None) -> None:
        dtype = str(tensor.dtype).replace("torch.", "")
        bit = bit_of(dtype, self.bit_setting)
        done = flip_bit(self.torch, tensor, self.index, bit, set_to=self.stuck)
        if self.stuck is None:
            self.stuck = done["bit_now"]
        self.flips += 1
        self._last_step = step
        if self.mode != "persistent":
            self.finished = True
            self.agent.fired = True
        if self.flips <= MAX_EVENTS and (done["changed"] or self.flips == 1):
            event = {"target": self.target, "mode": self.mode, "step": step, "tensor": name,
                     "state_key": state_key, "shape": list(getattr(tensor, "shape", ())), **done}
            self.agent.event("flipped", **event)
            self._record(event)

    def _record(self, event: dict[str, Any]) -> None:
        if not self.record_path:
            return
        self.agent.append(self.record_path, {"t": time.time(), "rank": int(os.environ.get("RANK", "0")), **event})
