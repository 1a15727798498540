"""The run agent's records for the invariants check beyond the step's fingerprints (issue 45,
docs/invariants.md "What the agent records for it"): which parameters each optimizer holds and
which the model trains, gradients carried into a step, modules in the wrong train/eval mode,
gradient clipping under a loss scaler.

Loaded by path next to ``_trainguard_step_agent`` (``_trainguard_run_agent.sibling``), standard
library only; the step agent calls :meth:`StepExtras.on_record` once per step record and
:meth:`StepExtras.patch_torch` once torch is imported. What it writes (docs/step-records.md):

* a ``params`` line per optimizer when its parameters are first recorded or change: each param
  group's names and dtypes, and those another live optimizer holds too (with a DTensor's mesh
  coordinates, and the ranks of a ``DistributedDataParallel`` wrapper's process group when it is
  smaller than the world: ``dp_ranks``); and, at its next step, a
  ``model`` line: the trainable and frozen parameters of the root modules holding that
  optimizer's parameters, the trainable ones that had a gradient (the forward used them) and
  that no live optimizer holds, and the count of watched modules;
* on a step line: ``carried``, the optimizer's parameters whose gradient was not ``None`` and not
  zero at every backward since its previous step (a missing ``zero_grad``); ``eval_in_step``, the
  dropout and batch-norm modules called in eval mode with gradients enabled since the previous
  step; ``clip``, the ``clip_grad_norm_``/``clip_grad_value_`` calls since then and how many ran on
  gradients a GradScaler had scaled and not unscaled;
* an ``eval`` line when a watched module runs in training mode without gradients (validation in
  train mode), once per module between two steps; a ``scaler`` line with a GradScaler's settings
  at its first recorded step.

Cost, per step: a dictionary lookup and an identity test per optimizer; one ``p.grad is None``
read per parameter at the first backward after its step (and one ``_foreach_norm`` per device
when gradients are zero-filled rather than ``None``); per call of a watched module (dropout,
batch norm, instance norm) one ``is_grad_enabled`` and one attribute comparison; per clip call
and per ``GradScaler.scale``/``unscale_`` a flag. Names are looked up only when something is
found.
"""

from __future__ import annotations

import functools
import sys
import weakref
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

#: frames looked through for torch's activation checkpointing (its no-grad first forward)
_STACK_DEPTH = 64
_CHECKPOINT = "torch.utils.checkpoint"
#: modules whose mode changes what they compute (their ``forward`` is wrapped)
_WATCHED = (("torch.nn.modules.dropout", "_DropoutNd"), ("torch.nn.modules.batchnorm", "_BatchNorm"),
            ("torch.nn.modules.instancenorm", "_InstanceNorm"))
_CLIPS = ("clip_grad_norm_", "clip_grad_value_")


def _matters(module: Any) -> bool:
    """Whether ``module``'s mode changes its output: dropout with p > 0, a norm with running stats."""
    p = getattr(module, "p", None)
    if p is not None:
        return bool(p > 0)
    return bool(getattr(module, "track_running_stats", False))


class StepExtras:
    """The invariants' records of one process (see the module's docstring)."""

    def __init__(self, agent: Any) -> None:
        self.agent = agent
        #: id(optimizer) -> (the StepPlan last seen, its names, its groups' sizes) when described
        self.described: dict[int, tuple[Any, list[str], list[int]]] = {}
        #: id(optimizer) -> [its parameters, their names, indices carried at every backward so far
        #: (None: no backward yet), the optimizer (weakly)]
        self.watch: dict[int, list[Any]] = {}
        #: id(optimizer) -> its model line and the parameters outside it with a gradient (weakly),
        #: written at its next step
        self.models: dict[int, tuple[dict[str, Any], list[tuple[str, Any]]]] = {}
        self.eval_in_step: dict[int, Any] = {}  # id -> module called in eval mode with grad on
        self.train_seen: set[int] = set()  # modules named in an eval line since the last step
        #: modules whose no-grad forwards are checkpointing's, and modules' names: held weakly, by
        #: the modules themselves (a module freed and another made at its address is another)
        self.checkpointed: weakref.WeakSet[Any] = weakref.WeakSet()
        self.module_names: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()
        self.scaled = self.unscaled = False
        self.clip_calls = self.clip_scaled = 0
        self.last: tuple[int, int] = (0, 0)  # (optimizer, n) of the last step recorded
        self.scalers: set[int] = set()
        self.torch: Any = None

    # -- the step record -------------------------------------------------------------------

    def on_record(self, optimizer: Any, key: int, n: int, record: dict[str, Any]) -> None:
        """Add this module's fields to ``optimizer``'s step record ``record`` (step ``n``)."""
        plan = self.agent.names.get(id(optimizer))
        known = self.described.get(id(optimizer))
        if plan is not None and (known is None or known[0] is not plan):
            sizes = [len(g["params"]) for g in optimizer.param_groups]
            if known is None or known[1] != plan.names or known[2] != sizes:
                self.agent.guard("recording the param groups", self._describe, optimizer, key, n, plan)
            self.described[id(optimizer)] = (plan, plan.names, sizes)
        waiting = self.models.pop(id(optimizer), None)
        if waiting is not None:
            self.agent.guard("recording the model's parameters", self._model_line, waiting)
        watched = self.watch.pop(id(optimizer), None)
        if watched is not None and watched[2] is not None:
            record["carried"] = [watched[1][i] for i in sorted(watched[2])]
        if plan is not None:
            self.watch[id(optimizer)] = [plan.params, plan.names, None, weakref.ref(optimizer)]
        if self.eval_in_step:
            record["eval_in_step"] = sorted({self._name(m) for m in self.eval_in_step.values()})
            self.eval_in_step.clear()
        if self.clip_calls:
            record["clip"] = {"calls": self.clip_calls, "scaled": self.clip_scaled}
        scaler = self.agent.scaler
        if scaler is not None and id(scaler) not in self.scalers:
            self.scalers.add(id(scaler))
            self.agent.event({"k": "scaler", "opt": key, "n": n, **_scaler_settings(scaler)})
        self.clip_calls = self.clip_scaled = 0
        self.scaled = self.unscaled = False
        self.train_seen.clear()
        self.last = (key, n)

    def _describe(self, optimizer: Any, key: int, n: int, plan: Any) -> None:
        """The ``params`` line (each group's names and dtypes, and those another live optimizer
        holds too) now, and the ``model`` line at this optimizer's next step (:meth:`_model_line`)."""
        groups, dtypes, at = [], [], 0
        for group in optimizer.param_groups:
            size = len(group["params"])
            groups.append(plan.names[at:at + size])
            dtypes.append([str(p.dtype).replace("torch.", "") for p in plan.params[at:at + size]])
            at += size
        others = self._held(but=id(optimizer))
        shared = [name for name, p in zip(plan.names, plan.params) if id(p) in others]
        line = {"k": "params", "opt": key, "n": n, "groups": groups, "dtypes": dtypes, "shared": shared}
        mesh = _mesh_coordinates(plan.names, plan.params)
        if mesh:
            line["mesh"] = mesh
        dp_ranks = self._dp_ranks(plan.params)
        if dp_ranks:
            line["dp_ranks"] = dp_ranks
        self.agent.event(line)
        held = {id(p) for p in plan.params}
        trainable: list[str] = []
        frozen: list[str] = []
        outside: list[tuple[str, Any]] = []
        watched = 0
        for root in self._roots(held):
            for name, p in root.named_parameters():
                name = self.agent.v.clean_name(name)
                (trainable if p.requires_grad else frozen).append(name)
                if p.requires_grad and id(p) not in held and p.grad is not None:
                    outside.append((name, weakref.ref(p)))
            watched += sum(1 for m in root.modules()
                           if getattr(type(m).forward, "__trainguard_watched__", False) and _matters(m))
        self.models[id(optimizer)] = ({"k": "model", "opt": key, "n": n, "trainable": trainable, "frozen": frozen,
                                       "watched": watched}, outside)

    def _dp_ranks(self, params: list[Any]) -> list[int] | None:
        """The ranks of the process group of the ``DistributedDataParallel`` wrappers holding every
        one of ``params`` (by identity, or over the same elements: torch's TP + DDP recipe), when
        they share one and it is not the whole world (a data-parallel group beside tensor
        parallelism: Megatron's layout); else None."""
        torch = self.torch
        ddp = getattr(getattr(torch.nn, "parallel", None), "DistributedDataParallel", None)
        dist = torch.distributed
        if ddp is None or not dist.is_available() or not dist.is_initialized():
            return None
        key = self.agent.v.storage_key
        covered: set[int] = set()
        groups: set[tuple[int, ...]] = set()
        for wrapper in (m for m in (ref() for ref in list(self.agent.modules.values())) if isinstance(m, ddp)):
            ids, keys = set(), set()
            for q in [*wrapper.parameters(), *getattr(wrapper, "_module_parameters", ())]:  # (those at its start)
                ids.add(id(q))
                keys.add(key(q))
            keys.discard(None)
            mine = {i for i, p in enumerate(params) if id(p) in ids or key(p) in keys}
            if mine:
                covered |= mine
                groups.add(tuple(dist.get_process_group_ranks(wrapper.process_group)))
        if len(groups) != 1 or len(covered) < len(params):
            return None
        (ranks,) = groups
        return sorted(ranks) if len(ranks) < dist.get_world_size() else None

    def _model_line(self, waiting: tuple[dict[str, Any], list[tuple[str, Any]]]) -> None:
        """The ``model`` line of an optimizer's step, written at its next step: ``grad``, the trainable
        parameters that had a gradient then and that no live optimizer holds now (another optimizer
        of the job, a GAN's, has stepped by then)."""
        line, outside = waiting
        held = self._held()
        self.agent.event({**line, "grad": [name for name, ref in outside if (p := ref()) is not None and id(p) not in held]})

    def _held(self, but: int | None = None) -> set[int]:
        """The ids of the parameters of every live optimizer the agent recorded (but ``but``)."""
        held: set[int] = set()
        for key, known in list(self.agent.optimizers.items()):
            plan = self.agent.names.get(key)
            if key != but and plan is not None and known[0]() is not None:
                held.update(id(p) for p in plan.params)
        return held

    def _roots(self, held: set[int] | None = None) -> list[Any]:
        """The tracked modules no other tracked module holds (each model, its wrapper when wrapped),
        those holding one of ``held``'s parameters first (all, when ``held`` is None)."""
        modules = [m for m in (ref() for ref in list(self.agent.modules.values())) if m is not None]
        inner = {id(c) for m in modules for c in m.children()}
        roots = [m for m in modules if id(m) not in inner]
        if held is None:
            return roots
        return [m for m in roots if any(id(p) in held for p in m.parameters())]

    def _name(self, module: Any) -> str:
        """``module``'s name in its root module (wrapper prefixes removed), found once."""
        known = self.module_names.get(module)
        if known is None:
            known = type(module).__name__
            for root in self._roots():
                found = next((n for n, m in root.named_modules() if m is module and n), None)
                if found is not None:
                    known = self.agent.v.clean_name(found + ".").rstrip(".") or known
                    break
            self.module_names[module] = known
        return known

    # -- gradients carried into a step -----------------------------------------------------

    def before_backward(self) -> None:
        """Before a backward: which of each watched optimizer's parameters hold a gradient that is
        not zero (kept: those that did at every backward since the optimizer's step)."""
        for key, entry in list(self.watch.items()):
            params, _, kept, alive = entry
            if alive() is None:  # an optimizer the job dropped: its parameters are not held here
                del self.watch[key]
                continue
            candidates = range(len(params)) if kept is None else kept
            with_grad = [i for i in candidates if params[i].grad is not None]
            carried = set(self._nonzero(params, with_grad)) if with_grad else set()
            if not carried:
                del self.watch[key]  # started from zero: nothing more to watch until its next step
            else:
                entry[2] = carried

    def _nonzero(self, params: list[Any], indices: list[int]) -> list[int]:
        """The indices among ``indices`` whose gradient is not all zero: one ``_foreach_norm``
        and one copy to the host per device and dtype (a DTensor's: its local shard's)."""
        torch = self.torch
        by_kind: dict[Any, tuple[list[int], list[Any]]] = {}
        for i in indices:
            grad = params[i].grad
            if grad.is_sparse:
                continue
            if type(grad).__name__ not in ("Tensor", "Parameter"):
                grad = self.agent.v.local_shard(grad)[0]
            group = by_kind.setdefault((grad.device, grad.dtype), ([], []))
            group[0].append(i)
            group[1].append(grad)
        out: list[int] = []
        for group_indices, grads in by_kind.values():
            nonzero = torch.stack(torch._foreach_norm(grads)).ne(0).tolist()
            out += [i for i, yes in zip(group_indices, nonzero) if yes]
        return out

    # -- train and eval modes --------------------------------------------------------------

    def mode_seen(self, module: Any, grad_enabled: bool) -> None:
        """A watched module called in a mode that does not fit the gradient mode."""
        if not _matters(module):
            return
        if grad_enabled:  # eval mode in a training forward
            self.eval_in_step.setdefault(id(module), module)
            return
        key = id(module)
        if key in self.train_seen or module in self.checkpointed:
            return
        if _in_checkpoint():
            self.checkpointed.add(module)  # reentrant checkpointing's first forward: not a validation
            return
        self.train_seen.add(key)
        opt, n = self.last
        self.agent.event({"k": "eval", "opt": opt, "after": n, "train_mode": [self._name(module)]})

    # -- clipping under a loss scaler ------------------------------------------------------

    def clipped(self) -> None:
        self.clip_calls += 1
        if self.scaled and not self.unscaled:
            self.clip_scaled += 1

    # -- patching --------------------------------------------------------------------------

    def patch_torch(self, torch: Any) -> None:
        """Wrap torch.autograd.backward (outside the step agent's counter), the watched modules'
        ``forward``, the clip functions and GradScaler's ``scale`` and ``unscale_``."""
        self.torch = torch
        extras = self
        backward = torch.autograd.backward

        @functools.wraps(backward)
        def watched_backward(*args: Any, **kwargs: Any) -> Any:
            if extras.watch and extras.agent.enabled:
                extras.agent.guard("recording carried gradients", extras.before_backward)
            return backward(*args, **kwargs)

        torch.autograd.backward = watched_backward
        for module_name, base_name in _WATCHED:
            base = getattr(sys.modules.get(module_name), base_name, None)
            if base is None:
                continue
            for cls in (base, *_subclasses(base)):
                if "forward" in cls.__dict__ and not hasattr(cls.__dict__["forward"], "__trainguard_watched__"):
                    cls.forward = self._watched_forward(torch, cls.__dict__["forward"])
        owners = [o for o in (torch.nn.utils, getattr(torch.nn.utils, "clip_grad", None)) if o is not None]
        for name in _CLIPS:  # (one wrapper for both names of each function: the agent's _replace)
            self.agent._replace(owners, name, self._clip_wrapper)
        for cls in (torch.amp.GradScaler, *_subclasses(torch.amp.GradScaler)):
            for method in ("scale", "unscale_"):
                fn = cls.__dict__.get(method)
                if fn is not None and not hasattr(fn, "__trainguard_wrapped__"):
                    setattr(cls, method, self._scaler_wrapper(method, fn))

    def _watched_forward(self, torch: Any, forward: Callable[..., Any]) -> Callable[..., Any]:
        extras = self
        grad_enabled = torch.is_grad_enabled
        compiling = torch.compiler.is_compiling

        @functools.wraps(forward)
        def watched(module: Any, *args: Any, **kwargs: Any) -> Any:
            enabled = grad_enabled()
            if module.training is not enabled and not compiling() and extras.agent.enabled:
                extras.agent.guard("recording a module's mode", extras.mode_seen, module, enabled)
            return forward(module, *args, **kwargs)

        watched.__trainguard_watched__ = True  # type: ignore[attr-defined]
        return watched

    def _clip_wrapper(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        extras = self

        @functools.wraps(fn)
        def clip(*args: Any, **kwargs: Any) -> Any:
            extras.clipped()
            return fn(*args, **kwargs)

        clip.__trainguard_wrapped__ = fn  # type: ignore[attr-defined]
        return clip

    def _scaler_wrapper(self, method: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        extras = self

        @functools.wraps(fn)
        def wrapper(scaler: Any, *args: Any, **kwargs: Any) -> Any:
            out = fn(scaler, *args, **kwargs)
            if getattr(scaler, "_enabled", True):
                if method == "scale":
                    extras.scaled = True
                else:
                    extras.unscaled = True
            return out

        wrapper.__trainguard_wrapped__ = fn  # type: ignore[attr-defined]
        return wrapper


def _mesh_coordinates(names: list[str], params: list[Any]) -> dict[str, list[int]]:
    """This rank's coordinate on each DTensor parameter's device mesh, by name (one per mesh
    dimension, in its placements' order): ranks equal on every ``Shard`` dimension hold the same
    shard, replicas along the ``Replicate`` ones (HSDP)."""
    out: dict[str, list[int]] = {}
    for name, p in zip(names, params):
        mesh = getattr(p, "device_mesh", None)
        coordinate = mesh.get_coordinate() if mesh is not None and hasattr(p, "placements") else None
        if coordinate is not None:
            out[name] = [int(c) for c in coordinate]
    return out


def _scaler_settings(scaler: Any) -> dict[str, Any]:
    """A GradScaler's growth and backoff settings (None where it has no such attribute)."""
    out: dict[str, Any] = {}
    for name in ("growth_factor", "backoff_factor", "growth_interval"):
        value = getattr(scaler, "_" + name, None)
        out[name] = value if isinstance(value, (int, float)) and not isinstance(value, bool) else None
    return out


def _in_checkpoint() -> bool:
    """Whether torch's activation checkpointing is on the stack (its reentrant variant runs the
    forward once without gradients, in training mode)."""
    frame: FrameType | None = sys._getframe(2)
    for _ in range(_STACK_DEPTH):
        if frame is None:
            return False
        if frame.f_globals.get("__name__") == _CHECKPOINT:
            return True
        frame = frame.f_back
    return False


def _subclasses(cls: type) -> Iterator[type]:
    """Every subclass of ``cls`` defined now, at any depth (one reached twice: yielded twice)."""
    sub: type
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)


__all__ = ["StepExtras"]
