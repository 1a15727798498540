"""The run agent's step records: what each optimizer step of this process did (issue 44).

Installed by ``_trainguard_run_agent`` when its spec has ``steps_dir``; standard library only,
and nothing is patched that the job does not import itself (the run agent's import hook hands
each module over right after the job's import of it). The wire format is docs/step-records.md:
one JSON line per optimizer step, checkpoint save, state restore and seeding, written to
``<steps_dir>/rank{RANK}.jsonl`` through the run agent's O_APPEND ``JsonlWriter``.

* ``torch``: torch's global optimizer step pre/post hooks record each step (learning rates and
  hyperparameters per param group, fingerprints of every parameter, gradient and optimizer state
  before the update, backward calls since the optimizer's previous step, the loss scaler, the RNG
  states at the step's start). A step given a closure (Lightning runs forward and backward inside
  ``optimizer.step(closure)``) is recorded right after the closure's first call: gradients
  present, parameters not yet updated. A step inside another optimizer's step (accelerate's
  wrapper) is the same step: one record. ``GradScaler.step`` is wrapped: a step the scaler skips
  is still a line (``skipped: true``). The RNG states are read at the first module forward after a
  step (``nn.Module.__call__`` swapped for one call). ``torch.autograd.backward`` is counted.
  ``torch.save``/``torch.load``, ``load_state_dict`` of modules, optimizers, LR schedulers and
  scalers, ``set_rng_state`` and ``manual_seed`` write save/restore/seed lines.
* ``torch.distributed.checkpoint`` (+ ``.state_dict``), ``safetensors.torch``, ``numpy.random``,
  ``random``, ``torchdata.stateful_dataloader``: their save/load/seed/set-state calls.

A fingerprint is ``[fp, ss]``: the sum mod 2**64 of the elements' bit patterns (torch ops on the
tensor's device, one device-to-host copy per device and step) and the sum of squares; it and the
other values of a record are computed by the sibling ``_trainguard_step_values``.
"""

from __future__ import annotations

import functools
import gc
import os
import sys
import time
import weakref
from collections.abc import Callable
from typing import Any

#: the functions of torch.distributed.checkpoint.state_dict that step an optimizer to create
#: its state (not a training step)
_DCP_STATE_DICT = "torch.distributed.checkpoint.state_dict"
_STATE_INIT_STEPS = frozenset({"_init_optim_state"})

#: default size cap of one rank's file (bytes)
DEFAULT_CAP = 64 * 1024 * 1024
#: save/restore/seed lines still written after the cap
_EVENTS_AFTER_CAP = 1000
#: the keys of a step record that :meth:`StepAgent._step_line` writes (no invariants' fields)
_STEP_KEYS = ("k", "opt", "n", "t", "groups", "backward", "rng", "param", "grad", "optim", "scaler")
#: the optimizer state and the RNG states are read at each of a process's first this many
#: optimizer steps (then on the schedule of ``state_every``: docs/step-records.md#the-schedule)
STATE_FIRST_STEPS = 8
#: ... and every this many steps after them, unless the spec's ``state_every`` says otherwise
DEFAULT_STATE_EVERY = 8
#: top-level keys listed per save
_MAX_KEYS = 256
#: calls not recorded when this package makes them: DataLoader workers seed themselves; DCP
#: saves and loads its own pieces with torch.save/torch.load, and async_save calls save (in
#: background threads too)
_QUIET = {"torch.save": "torch.", "torch.load": "torch.", "dcp": "torch."}
#: modules whose wrappers stand between the job and a function it calls (torch._dynamo wraps
#: torch.manual_seed)
_WRAPPERS = ("torch._dynamo.eval_frame", "torch._compile", "functools", "contextlib")
#: modules whose constructors load an optimizer's own state back into it (not a restore)
_RELOADS = frozenset({"accelerate.optimizer"})


def _state_init_step(frame: Any) -> bool:
    """Whether the optimizer step being called is one DCP's ``get_state_dict`` /
    ``set_state_dict`` makes itself to create an empty optimizer's state (zero gradients, lr
    set to 0 for the call): a resumed FSDP2 run makes one before it loads its checkpoint."""
    for _ in range(8):
        if frame is None:
            return False
        if frame.f_code.co_name in _STATE_INIT_STEPS and frame.f_globals.get("__name__") == _DCP_STATE_DICT:
            return True
        frame = frame.f_back
    return False


class StepAgent:
    """The step records of one process (docs/step-records.md)."""

    def __init__(self, run_agent: Any, spec: dict[str, Any], writer_cls: type, values: Any) -> None:
        self.run_agent = run_agent
        self.v = values  # the sibling module _trainguard_step_values
        self.rank = os.environ.get("RANK", "0")
        self.writer = writer_cls(os.path.join(spec["steps_dir"], f"rank{self.rank}.jsonl"))
        self.cap = int(spec.get("steps_cap") or DEFAULT_CAP)
        #: read the optimizer state and the RNG states every this many steps after the first
        #: ones, and at the step after any save, restore or seed line (1: every step)
        self.state_every = max(1, int(spec.get("state_every") or DEFAULT_STATE_EVERY))
        self.steps_done = 0  # optimizer steps recorded in this process (all optimizers)
        self.full = True  # the coming step reads the optimizer state and the RNG states
        self.evented = False  # a save, restore or seed line since the current step began
        self.written = 0
        self.truncated = False
        self.events_after_cap = 0
        self.enabled = True
        self.started = False
        # per optimizer, by id: [weak reference, index in this process, steps so far]
        self.optimizers: dict[int, list[Any]] = {}
        self.indices: list[int] = []
        self.backward_marks: dict[int, int] = {}
        self.names: dict[int, Any] = {}  # per optimizer: its StepPlan (names, the record's layout)
        self.backwards = 0
        self.outer_frame: Any = None  # the frame of the step being recorded (nested: not again)
        self.outer: Any = None  # ... and its optimizer
        self.recorded = False  # the current step's record is made
        self.pending: dict[str, Any] | None = None  # ... and waits for the step's end
        self.inner: Any = None  # an optimizer stepping inside the current step
        self.scaler: Any = None  # the GradScaler whose step is running
        self.rng: dict[str, Any] | None = None  # read at the first forward after a step
        self.rng_prints = values.RngPrints()
        self.texts: dict[str, tuple[Any, str]] = {"rng": (None, "null"), "groups": (None, "null")}  # last, as JSON
        self.armed = False  # nn.Module.__call__ reads the RNG states at the next call
        self.restoring: set[str] = set()
        #: the modules made since torch was imported (weakly, by id): where parameter names are
        self.modules: dict[int, Any] = {}
        #: the invariants' records (``_trainguard_step_extras.StepExtras``), set by the run agent
        self.extras: Any = None
        os.register_at_fork(after_in_child=self._after_fork)

    def _after_fork(self) -> None:
        self.enabled = False  # a forked child (a DataLoader worker) is not this rank's trainer

    # -- writing ---------------------------------------------------------------------------

    def guard(self, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        return self.run_agent.guard(what, fn, *args)

    def _write(self, record: dict[str, Any], *, event: bool) -> None:
        if not self.enabled:
            return
        if not self.started:
            self.started = True
            torch = sys.modules.get("torch")
            world = os.environ.get("WORLD_SIZE", "1")
            self._write({"k": "meta", "rank": int(self.rank) if self.rank.isdigit() else self.rank,
                         "world": int(world) if world.isdigit() else world, "pid": os.getpid(),
                         "torch": getattr(torch, "__version__", None), "cap": self.cap}, event=True)
        if self.truncated:
            if not event or self.events_after_cap >= _EVENTS_AFTER_CAP:
                return
            self.events_after_cap += 1
            self.writer.write(record)
            return
        line = self._encode(record)
        if self.written + len(line) > self.cap:
            self.truncated = True
            self.writer.write({"k": "truncated", "bytes": self.written})
            self._write(record, event=event)
            return
        self.written += len(line)
        if event:
            self.writer.write_line(line)
        else:  # a step line: written with the next few (no system call per step)
            self.writer.hold_line(line)

    def _encode(self, record: dict[str, Any]) -> bytes:
        """The line of ``record``: its :class:`Raw` values (a :class:`StepPlan`'s JSON text) as
        they are, after the rest."""
        raw_type, keys = self.v.Raw, tuple(record)
        if (keys[:11] == _STEP_KEYS and type(record["param"]) is raw_type and type(record["grad"]) is raw_type
                and (record["optim"] is None or type(record["optim"]) is raw_type) and record["k"] == "step"
                and not any([type(record[key]) is raw_type for key in keys[11:]])):
            return self._step_line(record, keys[11:])
        raw = [(key, value) for key, value in record.items() if type(value) is raw_type]
        if not raw:
            return bytes(self.writer.encode(record))
        line = self.writer.encode({key: value for key, value in record.items() if type(value) is not self.v.Raw})
        return bytes(line[:-2] + "".join(f',"{key}":{value}' for key, value in raw).encode() + b"}\n")

    def _step_line(self, record: dict[str, Any], extra: tuple[str, ...]) -> bytes:
        """:meth:`_encode` of a step record (``extra``: the invariants' fields after the plain
        ones) formatted directly, the same bytes (rng and groups encoded again only when changed)."""
        encode, texts, scaler, optim = self.writer.ENCODER.encode, self.texts, record["scaler"], record["optim"]
        for key in ("rng", "groups"):
            if record[key] != texts[key][0]:
                texts[key] = (record[key], encode(record[key]))
        more = "".join([f',"{key}":{encode(record[key])}' for key in extra])
        head, tail = ('"optim":null,', "") if optim is None else ("", f',"optim":{optim}')
        return (f'{{"k":"step","opt":{record["opt"]:d},"n":{record["n"]:d},"t":{float(record["t"])!r},'
                f'"groups":{texts["groups"][1]},"backward":{record["backward"]:d},"rng":{texts["rng"][1]},{head}'
                f'"scaler":{"null" if scaler is None else encode(scaler)}{more},"param":{record["param"]},'
                f'"grad":{record["grad"]}{tail}}}\n').encode()

    def event(self, record: dict[str, Any]) -> None:
        self.full = self.evented = True  # the next step reads all: what the save or restore held
        self._write({**record, "t": time.monotonic()}, event=True)

    # -- the step --------------------------------------------------------------------------

    def pre_hook(self, optimizer: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """torch's global optimizer step pre-hook (``args[0]`` is the optimizer)."""
        caller = sys._getframe(1)
        try:
            return self._pre(optimizer, args, kwargs, caller) if self.enabled else None
        except Exception as exc:
            self.run_agent.report("recording an optimizer step", exc)
            return None

    def _pre(self, optimizer: Any, args: tuple[Any, ...], kwargs: dict[str, Any], caller: Any) -> Any:
        if _DCP_STATE_DICT in sys.modules and _state_init_step(caller):
            return None  # not a training step: no line, not counted
        if self.outer_frame is not None:
            frame = caller.f_back
            while frame is not None:
                if frame is self.outer_frame:  # inside another optimizer's step: that step's
                    self.inner = optimizer      # record, with this one's state if it has none
                    if self.pending is not None and self.pending["optim"] == {}:
                        self._inner_state(self.pending)
                    return None
                frame = frame.f_back
        self.flush()  # a step that raised before its post-hook
        self.outer_frame, self.outer, self.recorded, self.inner = caller, optimizer, False, None
        closure = kwargs.get("closure")
        if closure is None and len(args) > 1 and callable(args[1]):
            closure = args[1]
        if closure is None:
            self.record(optimizer, False)
            return None
        wrapped = self._after_closure(optimizer, closure)
        if "closure" in kwargs:
            return args, {**kwargs, "closure": wrapped}
        return (args[0], wrapped, *args[2:]), kwargs

    def _after_closure(self, optimizer: Any, closure: Callable[[], Any]) -> Callable[[], Any]:
        @functools.wraps(closure)
        def closure_then_record(*a: Any, **kw: Any) -> Any:
            out = closure(*a, **kw)
            if not self.recorded:
                self.guard("recording an optimizer step", self.record, optimizer, False)
            return out
        return closure_then_record

    def post_hook(self, optimizer: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """torch's global optimizer step post-hook."""
        if not self.enabled or optimizer is not self.outer:
            return  # a nested step's post hook
        self.outer_frame = self.outer = None
        self.guard("recording an optimizer step", self._post, optimizer)

    def _post(self, optimizer: Any) -> None:
        if not self.recorded:  # a closure the optimizer never called
            self.guard("recording an optimizer step", self.record, optimizer, False)
        try:
            self.flush()
        finally:
            self.step_done()

    def flush(self) -> None:
        """Write the step's record (held until the step's end: a nested optimizer's state may
        still join it)."""
        record, self.pending, self.inner = self.pending, None, None
        if record is not None:
            self._write(record, event=False)

    def step_done(self) -> None:
        """After any optimizer's step: the next module call reads the RNG states (the wrapper of
        ``nn.Module.__call__`` installed once, :meth:`_patch_torch`: not a global forward
        pre-hook, which torch.compile warns about on every compiled module's call, and not a
        class attribute swapped per step, which makes Python redo its specialised lookups)."""
        self.rng, self.armed, self.steps_done = None, True, self.steps_done + 1
        self.full = (self.evented or self.steps_done < STATE_FIRST_STEPS
                     or (self.steps_done + 1) % self.state_every == 0)
        self.evented = False

    def first_call(self) -> None:
        """The first module call since a step: read the RNG states at the step's start (on the
        steps that read them)."""
        self.armed = self.evented = False
        if self.enabled and self.full:
            self.rng = self.guard("reading the RNG states", self.rng_now)

    def rng_now(self) -> dict[str, Any]:
        torch = sys.modules["torch"]
        prints = self.rng_prints
        cuda = None
        if torch.cuda.is_initialized():
            cuda = [prints.sha(("cuda", i), _state_bytes(s)) for i, s in enumerate(torch.cuda.get_rng_state_all())]
        np_random = sys.modules.get("numpy.random")
        random = sys.modules.get("random")
        return {"cpu": prints.sha("cpu", _state_bytes(torch.get_rng_state())), "cuda": cuda,
                "numpy": None if np_random is None else prints.numpy(np_random),
                "python": None if random is None else prints.python(random)}

    def _named_params(self, optimizer: Any) -> list[tuple[str, Any]]:
        """(name, parameter) of every parameter of ``optimizer``, in group order; the names
        found once per optimizer (again when its parameters change)."""
        params = [p for group in optimizer.param_groups for p in group["params"]]
        known = self.names.get(id(optimizer))
        if known is not None and known.fits(params):
            return known.named
        wanted = {id(p) for p in params}
        names = self._find_names(wanted)
        if len(names) < len(wanted):  # a module holding other objects over the same elements (TP + DDP)
            names.update(self.v.names_by_storage([m for m in (r() for r in list(self.modules.values())) if m is not None],
                                                 [p for p in params if id(p) not in names]))
        named: list[tuple[str, Any]] = []
        for g, group in enumerate(optimizer.param_groups):
            for i, p in enumerate(group["params"]):
                named.append((names.get(id(p), f"group{g}.{i}"), p))
        self.names[id(optimizer)] = self.v.StepPlan(optimizer, named)
        return named

    def _prints(self, optimizer: Any, state: bool) -> dict[str, Any]:
        """param, grad, optim (None unless ``state``) and placement of ``optimizer``'s parameters now: through the
        optimizer's :class:`StepPlan` (one batch of fingerprints, the JSON text filled in one
        formatting), made again when it no longer fits; else (DTensors, numbers in the
        optimizer's state) :meth:`_fingerprinted`."""
        named = self._named_params(optimizer)
        plan = self.names[id(optimizer)]
        tensors = plan.tensors(optimizer, state) if plan.usable else None
        if tensors is None and plan.usable:  # a gradient or a state key more or less: laid out again
            plan = self.names[id(optimizer)] = self.v.StepPlan(optimizer, named)
            tensors = plan.tensors(optimizer, state) if plan.usable else None
        if tensors is None:
            return self._fingerprinted(optimizer, params=True, state=state)
        try:
            prints = self.v.raw_prints(sys.modules["torch"], tensors, sys.modules.get("numpy"), cpu=plan.cpu)
            return plan.texts(*prints, state=state)
        except Exception:  # a tensor moved to another device since: laid out again at the next step
            del self.names[id(optimizer)]
            return self._fingerprinted(optimizer, params=True, state=state)

    def _find_names(self, wanted: set[int]) -> dict[int, str]:
        """id(parameter) -> its name in the root module owning it (once per optimizer), the
        root naming most of them first: among the modules made since torch was imported, else
        (a module unpickled or copied without ``__init__``) among all objects (a gc walk)."""
        modules = [m for m in (ref() for ref in list(self.modules.values())) if m is not None]
        names = self._names_in(modules, wanted)
        if len(names) < len(wanted):
            module_type = sys.modules["torch.nn"].Module
            names = self._names_in([o for o in gc.get_objects() if issubclass(type(o), module_type)], wanted)
        return names

    def _names_in(self, modules: list[Any], wanted: set[int]) -> dict[int, str]:
        inner = {id(c) for m in modules for c in m.children()}
        scored = []
        for m in modules:
            if id(m) not in inner:
                mine = [(n, p) for n, p in m.named_parameters() if id(p) in wanted]
                if mine:
                    scored.append((len(mine), mine))
        names: dict[int, str] = {}
        for _, mine in sorted(scored, key=lambda s: -s[0]):
            for n, p in mine:
                names.setdefault(id(p), self.v.clean_name(n))
        return names

    def _fingerprinted(self, optimizer: Any, params: bool, state: bool = True) -> dict[str, Any]:
        """param, grad (``params``), optim (None unless ``state``) and placement of
        ``optimizer``'s parameters now, with one batch of fingerprints."""
        named = self._named_params(optimizer)
        tensors: list[Any] = []
        slots: list[tuple[str, str, str]] = []  # (kind, name, state key)
        out: dict[str, dict[str, Any]] = {"param": {}, "grad": {}, "optim": {}, "placement": {}}
        parts: dict[str, list[tuple[str, int, Any]]] = {}
        for name, p in named:
            if params:
                local, where = self.v.local_shard(p)
                if where is not None:
                    out["placement"][name] = where
                tensors.append(local)
                slots.append(("param", name, ""))
                out["grad"][name] = None
                if p.grad is not None:
                    tensors.append(self.v.local_shard(p.grad)[0])
                    slots.append(("grad", name, ""))
            for skey, value in sorted(optimizer.state.get(p, {}).items() if state else (), key=lambda kv: str(kv[0])):
                if hasattr(value, "detach"):
                    tensors.append(self.v.local_shard(value)[0])
                    slots.append(("optim", name, str(skey)))
                elif isinstance(value, (int, float)) and not isinstance(value, bool):
                    fp, ss = self.v.scalar_fingerprint(value)
                    parts.setdefault(name, []).append((str(skey), fp, ss))
        prints = self.v.fingerprints(sys.modules["torch"], tensors, sys.modules.get("numpy")) if tensors else []
        for (kind, name, skey), (fp, ss) in zip(slots, prints):
            if kind == "optim":
                parts.setdefault(name, []).append((skey, int(fp, 16), ss))
            else:
                out[kind][name] = [fp, ss]
        return {**out, "optim": {name: self.v.combined(p) for name, p in parts.items()} if state else None}

    def _inner_state(self, record: dict[str, Any]) -> None:
        """The optimizer state of the optimizer stepping inside the recorded one (a wrapper
        such as ZeroRedundancyOptimizer keeps none itself)."""
        record["optim"] = self._fingerprinted(self.inner, params=False)["optim"]

    def record(self, optimizer: Any, skipped: bool) -> None:
        """The step record of ``optimizer`` as it is now (parameters before its update), written
        by :meth:`flush` at the step's end."""
        self.recorded = True
        key, n = self._count(optimizer)
        if self.truncated:
            return
        # the optimizer's state at its own first steps and every state_every-th (the step's n: the
        # same steps in two runs of the job), and at any step that reads the RNG states
        values = self._prints(optimizer, self.full or n <= STATE_FIRST_STEPS or n % self.state_every == 0)
        if self.rng is None and self.full:
            self.rng = self.rng_now()
        record: dict[str, Any] = {
            "k": "step", "opt": key, "n": n, "t": time.monotonic(),
            "groups": [self.v.hyperparameters(g) for g in optimizer.param_groups],
            "backward": self.backwards - self.backward_marks.get(id(optimizer), 0),
            "rng": self.rng, "param": values["param"], "grad": values["grad"], "optim": values["optim"],
            "scaler": self._scaler_state(optimizer, skipped),
        }
        self.backward_marks[id(optimizer)] = self.backwards
        if self.extras is not None:  # the invariants' fields (carried, eval_in_step, clip)
            self.guard("recording the invariants' fields", self.extras.on_record, optimizer, key, n, record)
        if values.get("placement"):
            record["placement"] = values["placement"]
        self.pending = record
        if record["optim"] == {} and self.inner is not None:
            self._inner_state(record)

    def _count(self, optimizer: Any) -> tuple[int, int]:
        """This optimizer's index in the process and the 1-based number of this step (an
        optimizer is held weakly: one garbage-collected frees its id for a new one)."""
        known = self.optimizers.get(id(optimizer))
        if known is None or known[0]() is not optimizer:
            known = self.optimizers[id(optimizer)] = [weakref.ref(optimizer), len(self.indices), 0]
            self.indices.append(id(optimizer))
            self.names.pop(id(optimizer), None)
            self.backward_marks.pop(id(optimizer), None)
        known[2] += 1
        return known[1], known[2]

    def _scaler_state(self, optimizer: Any, skipped: bool) -> dict[str, Any] | None:
        scaler = self.scaler
        if scaler is None or not getattr(scaler, "_enabled", True):
            return None
        if not skipped:  # a fused optimizer steps even when the scaler found an inf: ask it
            state = getattr(scaler, "_per_optimizer_states", {}).get(id(optimizer), {})
            found = state.get("found_inf_per_device") or {}
            skipped = any(float(v) != 0.0 for v in found.values())
        return {"scale": self.v.number(float(scaler.get_scale())), "skipped": bool(skipped)}

    def scaler_step(self, original: Callable[..., Any], scaler: Any, optimizer: Any,
                    *args: Any, **kwargs: Any) -> Any:
        """``GradScaler.step``: the optimizer's step line carries the scale; a skipped step
        (no ``optimizer.step`` call) is still a line."""
        if self.scaler is not None or not self.enabled:
            return original(scaler, optimizer, *args, **kwargs)
        self.scaler, self.recorded = scaler, False
        try:
            out = original(scaler, optimizer, *args, **kwargs)
            if not self.recorded and getattr(scaler, "_enabled", True):
                self.guard("recording a skipped optimizer step", self.record, optimizer, True)
                self.guard("recording an optimizer step", self.flush)
                self.guard("recording an optimizer step", self.step_done)
            return out
        finally:
            self.scaler = None

    # -- saves and restores -----------------------------------------------------------------

    def saved(self, how: str, obj: Any, path: Any) -> None:
        keys: dict[str, str] = {}
        if isinstance(obj, dict):
            for key, value in list(obj.items())[:_MAX_KEYS]:
                keys[str(key)] = "value" if how == "safetensors" else self.v.owner_of(value)
        whole = "model" if how == "safetensors" else self.v.owner_of(obj)
        self.event({"k": "save", "how": how, "path": self.v.path_text(path), "keys": keys,
                    "whole": None if whole == "value" else whole})

    def restored(self, kind: str, call: str, target: str, path: Any, by: str) -> None:
        if kind == "seed":
            self.event({"k": "seed", "call": call, "by": by})
        else:
            self.event({"k": "restore", "call": call, "target": target,
                        "path": None if path is None else self.v.path_text(path), "by": by})

    def wrap_restore(self, call: str, fn: Callable[..., Any], *, target: str | None = None,
                     path_arg: int | None = None, path_kwargs: tuple[str, ...] = (),
                     kind: str = "restore") -> Callable[..., Any]:
        """``fn`` writing a restore (or seed) line before it runs (``target``: the name the line
        gives; None: the type of the first argument, the method's object). A call of the same
        kind inside it (``set_rng_state_all`` calling ``set_rng_state``) writes none; nor does
        torch's DataLoader worker seeding itself."""
        agent = self

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if call in agent.restoring or not agent.enabled:
                return fn(*args, **kwargs)
            agent.restoring.add(call)
            try:
                by = _caller()
                if not by.startswith(_QUIET.get(call, "torch.utils.data")) and not _reload(by):
                    agent.guard("recording a restore", agent.restored, kind, call,
                                target if target is not None else type(args[0] if args else None).__name__,
                                _argument(args, kwargs, path_arg, path_kwargs), by)
                return fn(*args, **kwargs)
            finally:
                agent.restoring.discard(call)

        wrapper.__trainguard_wrapped__ = fn  # type: ignore[attr-defined]
        return wrapper

    def wrap_save(self, how: str, fn: Callable[..., Any], path_arg: int | None,
                  path_kwargs: tuple[str, ...] = ()) -> Callable[..., Any]:
        """``fn(obj, ...)`` writing a save line first (its path from ``path_arg`` or the first of
        ``path_kwargs`` given; a storage writer's ``path``)."""
        agent = self
        inside = f"save:{how}"

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if agent.enabled and inside not in agent.restoring and not _caller().startswith(_QUIET.get(how, "-")):
                obj = args[0] if args else next(iter(kwargs.values()), None)
                path = _argument(args, kwargs, path_arg, path_kwargs)
                agent.guard("recording a checkpoint save", agent.saved, how, obj, getattr(path, "path", path))
            agent.restoring.add(inside)
            try:
                return fn(*args, **kwargs)
            finally:
                agent.restoring.discard(inside)

        wrapper.__trainguard_wrapped__ = fn  # type: ignore[attr-defined]
        return wrapper

    # -- patching ----------------------------------------------------------------------------

    def patches(self) -> dict[str, Callable[[Any], None]]:
        """Module name -> the patch to run once the job imported it."""
        return {"torch": self._patch_torch, "torch.distributed.checkpoint": self._patch_dcp,
                "torch.distributed.checkpoint.state_dict": self._patch_dcp_state_dict,
                "safetensors.torch": self._patch_safetensors, "numpy.random": self._patch_numpy,
                "random": self._patch_random, "torchdata.stateful_dataloader": self._patch_torchdata}

    def _replace(self, owners: list[Any], name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
        """Set ``name`` on each of ``owners`` to ``make(original)`` (one wrapper per original
        function: ``torch.save`` and ``torch.serialization.save`` stay one object)."""
        made: dict[int, Callable[..., Any]] = {}
        for owner in owners:
            fn = getattr(owner, name, None)
            if fn is None or hasattr(fn, "__trainguard_wrapped__"):
                continue
            if id(fn) not in made:
                made[id(fn)] = make(fn)
            setattr(owner, name, made[id(fn)])

    def _patch_torch(self, torch: Any) -> None:
        optimizer_module = sys.modules["torch.optim.optimizer"]
        optimizer_module.register_optimizer_step_pre_hook(self.pre_hook)
        optimizer_module.register_optimizer_step_post_hook(self.post_hook)
        agent = self
        original_backward = torch.autograd.backward

        @functools.wraps(original_backward)
        def backward(*args: Any, **kwargs: Any) -> Any:
            agent.backwards += 1
            return original_backward(*args, **kwargs)

        torch.autograd.backward = backward
        original_init = torch.nn.Module.__init__

        @functools.wraps(original_init)
        def __init__(module: Any, *args: Any, **kwargs: Any) -> None:
            original_init(module, *args, **kwargs)
            agent.guard("tracking the modules", agent.track, module)

        torch.nn.Module.__init__ = __init__
        original_call = torch.nn.Module.__call__

        @functools.wraps(original_call)
        def __call__(module: Any, *args: Any, **kwargs: Any) -> Any:
            if agent.armed:
                agent.first_call()
            return original_call(module, *args, **kwargs)

        torch.nn.Module.__call__ = __call__
        scalers = [torch.amp.GradScaler, *_subclasses(torch.amp.GradScaler)]
        for cls in scalers:
            if "step" in cls.__dict__:
                self._replace([cls], "step", self._scaler_wrapper)
        self._replace([torch, torch.serialization], "save", lambda f: self.wrap_save("torch.save", f, 1, ("f",)))
        self._replace([torch, torch.serialization], "load",
                      lambda f: self.wrap_restore("torch.load", f, target="torch", path_arg=0, path_kwargs=("f",)))
        methods = [(torch.nn.Module, "Module.load_state_dict"), (torch.optim.Optimizer, "Optimizer.load_state_dict")]
        scheduler = torch.optim.lr_scheduler.LRScheduler
        methods += [(c, "LRScheduler.load_state_dict") for c in (scheduler, *_subclasses(scheduler))]
        methods += [(c, "GradScaler.load_state_dict") for c in scalers]
        for cls, call in methods:
            if "load_state_dict" in cls.__dict__:
                self._replace([cls], "load_state_dict", functools.partial(self._restore_method, call))
        self._replace([torch, torch.random], "set_rng_state",
                      lambda f: self.wrap_restore("torch.set_rng_state", f, target="torch"))
        self._replace([torch, torch.random], "manual_seed",
                      lambda f: self.wrap_restore("torch.manual_seed", f, kind="seed"))
        for name in ("set_rng_state", "set_rng_state_all"):
            self._replace([torch.cuda, torch.cuda.random], name,
                          lambda f: self.wrap_restore("torch.cuda.set_rng_state", f, target="torch.cuda"))
        if self.extras is not None:  # carried gradients, modules' modes, clipping
            self.guard("patching torch for the invariants' records", self.extras.patch_torch, torch)
        self.rng, self.armed = None, True  # the first forward reads the RNG states of the first step

    def track(self, module: Any) -> None:
        """Keep (weakly) a module just made: :meth:`_find_names` looks among these first."""
        key = id(module)

        def gone(ref: Any) -> None:
            if self.modules.get(key) is ref:
                del self.modules[key]

        self.modules[key] = weakref.ref(module, gone)

    def _restore_method(self, call: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        return self.wrap_restore(call, fn)

    def _scaler_wrapper(self, original: Callable[..., Any]) -> Callable[..., Any]:
        agent = self

        @functools.wraps(original)
        def step(scaler: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
            return agent.scaler_step(original, scaler, optimizer, *args, **kwargs)

        step.__trainguard_wrapped__ = original  # type: ignore[attr-defined]
        return step

    def _patch_dcp(self, dcp: Any) -> None:
        owners = [dcp, getattr(dcp, "state_dict_saver", None)]
        owners = [o for o in owners if o is not None]
        where = ("checkpoint_id", "storage_writer")
        self._replace(owners, "save", lambda f: self.wrap_save("dcp", f, None, where))
        self._replace(owners, "async_save", lambda f: self.wrap_save("dcp_async", f, None, where))
        loaders = [o for o in (dcp, getattr(dcp, "state_dict_loader", None)) if o is not None]
        self._replace(loaders, "load", lambda f: self.wrap_restore(
            "dcp.load", f, target="dcp", path_kwargs=("checkpoint_id", "storage_reader")))

    def _patch_dcp_state_dict(self, module: Any) -> None:
        self._replace([module], "set_state_dict", lambda f: self.wrap_restore("dcp.set_state_dict", f))

    def _patch_safetensors(self, module: Any) -> None:
        self._replace([module], "save_file", lambda f: self.wrap_save("safetensors", f, 1, ("filename",)))
        self._replace([module], "load_file", lambda f: self.wrap_restore(
            "safetensors.load_file", f, target="safetensors", path_arg=0, path_kwargs=("filename",)))

    def _patch_numpy(self, module: Any) -> None:
        self._replace([module], "set_state",
                      lambda f: self.wrap_restore("numpy.random.set_state", f, target="numpy.random"))
        self._replace([module], "seed", lambda f: self.wrap_restore("numpy.random.seed", f, kind="seed"))

    def _patch_random(self, module: Any) -> None:
        self._replace([module], "setstate", lambda f: self.wrap_restore("random.setstate", f, target="random"))
        self._replace([module], "seed", lambda f: self.wrap_restore("random.seed", f, kind="seed"))

    def _patch_torchdata(self, module: Any) -> None:
        loader = getattr(module, "StatefulDataLoader", None)
        if loader is not None and "load_state_dict" in loader.__dict__:
            self._replace([loader], "load_state_dict", lambda f: self.wrap_restore("DataLoader.load_state_dict", f))


def _state_bytes(t: Any) -> bytes:
    """A generator's state tensor's bytes."""
    try:
        return bytes(t.numpy().tobytes())
    except Exception:  # (no numpy)
        return bytes(t.tolist())


def _subclasses(cls: type) -> list[type]:
    out: list[type] = []
    todo: list[type] = list(cls.__subclasses__())
    while todo:
        sub = todo.pop()
        if sub not in out:
            out.append(sub)
            todo.extend(sub.__subclasses__())
    return out


def _caller() -> str:
    """The module that called the wrapped function (past torch._dynamo's wrapper of
    ``torch.manual_seed``)."""
    frame = sys._getframe(2)
    while frame.f_back is not None and frame.f_globals.get("__name__", "") in _WRAPPERS:
        frame = frame.f_back
    return str(frame.f_globals.get("__name__", ""))


def _reload(by: str) -> bool:
    """Whether the wrapped call is a wrapper's constructor loading back the state it just read
    from the object it wraps (accelerate's ``AcceleratedOptimizer``, moving the state to its
    device): no restore."""
    return by in _RELOADS and sys._getframe(2).f_code.co_name == "__init__"


def _argument(args: tuple[Any, ...], kwargs: dict[str, Any], index: int | None, names: tuple[str, ...]) -> Any:
    """The argument at ``index`` or the first of the keyword ``names`` given, else None."""
    if index is not None and len(args) > index:
        return args[index]
    return next((kwargs[n] for n in names if kwargs.get(n) is not None), None)


__all__ = ["DEFAULT_CAP", "StepAgent"]
