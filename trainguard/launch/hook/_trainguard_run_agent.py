"""The in-process half of trainguard's run recording: trainer metrics and sample indices.

Loaded by the hook's ``sitecustomize.py`` (by file path, standard library only: the job's
interpreter need not have trainguard installed) when ``TRAINGUARD_RUN_HOOK`` holds a JSON spec
(see :func:`trainguard.launch.hook.run_hook_env`). Nothing is imported here that the job does not
import itself: an import hook patches a module the moment the job's own import of it finishes.

* ``transformers.trainer``: ``Trainer.__init__`` adds a callback and wraps the instance's
  ``training_step``. The losses ``training_step`` returns during one optimizer step (already
  scaled by the Trainer for gradient accumulation) add up to the loss the Trainer accumulates for
  that step; ``on_step_end`` writes their sum at full precision with ``state.global_step``.
  Other keys come from ``on_log``.
* ``lightning.pytorch`` / ``pytorch_lightning``: ``Trainer.__init__`` appends a callback whose
  ``on_train_batch_end`` writes, once ``trainer.global_step`` advanced, the mean of the step's
  micro-batch losses (from ``outputs``); other keys come from ``trainer.callback_metrics``.
* with ``steps_dir``: every optimizer step, checkpoint save and state restore of the process
  (``_trainguard_step_agent``, docs/step-records.md).
* with ``stall_dir``: the rank's answer when trainguard's stall watchdog fires (its Flight
  Recorder and main stack, ``_trainguard_stall_agent``, docs/drills.md "Which rank hung").
* with ``pace_dir``: each optimizer step's CPU time, run-queue wait and wall clock of the thread
  that stepped (``_trainguard_pace_agent``, docs/drills.md "Stragglers").
* ``torch.utils.data.dataloader``: every DataLoader iterator of a process that is not a
  DataLoader worker records the indices of each batch it yields (torchdata's
  ``StatefulDataLoader`` and accelerate's prepared loaders are DataLoaders too). Not recorded:
  an iterable dataset (no indices) and a loader with workers and ``in_order=False`` (its
  batches come back out of the order asked, so indices could be paired with the wrong batch).

Everything this agent does is wrapped: an exception inside it is reported once on stderr and
never reaches the job. Each record is one ``os.write`` of a whole line to a file opened with
``O_APPEND`` (a reader never sees half a line from two writers interleaved); step lines are held
and written a few together (``JsonlWriter.hold_line``).

The file's name is unusual on purpose: the hook directory is first on the rank's PYTHONPATH, so
every module in it is importable by its bare name there.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import importlib.abc
import itertools
import json
import math
import os
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any

ENV_RUN_SPEC = "TRAINGUARD_RUN_HOOK"
#: the attribute a recorded DataLoader iterator carries its state in
_ITER_ATTR = "_trainguard_samples"
#: micro-batch losses kept while waiting for the end of a step (a loop that never ends a step
#: must not grow this without bound)
_MAX_PENDING = 4096

_agent: Agent | None = None


def install(raw_spec: str) -> Agent:
    """Install the recording described by ``raw_spec`` in this process (once)."""
    global _agent
    if _agent is None:
        _agent = Agent(json.loads(raw_spec))
        _agent.install()
        _flush_before_os_exit()
    return _agent


def _flush_before_os_exit() -> None:
    """``os._exit`` skips the exit handlers that write the held step lines: a job that ends
    with it (to skip a collective library's teardown) would lose its last steps' records."""
    real = os._exit
    if getattr(real, "_trainguard_flushes", False):
        return

    def _exit(code: int) -> None:
        try:
            flush()
        finally:
            real(code)

    _exit._trainguard_flushes = True  # type: ignore[attr-defined]
    os._exit = _exit  # type: ignore[assignment]


def flush() -> None:
    """Write the step lines and step clocks this process's agent holds (``JsonlWriter.hold_line``,
    the pace agent's buffer): for a Ray
    Train worker at the end of its training function, whose process Ray ends without running
    its exit handlers."""
    if _agent is not None and _agent.steps is not None:
        _agent.steps.writer.flush()
    if _agent is not None and _agent.pace is not None:
        _agent.pace.flush()


def _jsonable(obj: Any) -> Any:
    """What json cannot write itself: numpy/torch scalars and arrays, anything else as text."""
    if hasattr(obj, "tolist"):
        return obj.tolist()
    if hasattr(obj, "__index__"):
        return int(obj)
    return repr(obj)


class JsonlWriter:
    """Appends one JSON object per line to ``path`` (created with its directory on first use)."""

    #: lines held (:meth:`hold_line`) are written together once this many bytes wait ...
    HOLD_BYTES = 64 * 1024
    #: ... or this many seconds after the first of them
    HOLD_SECONDS = 0.2

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd: int | None = None
        self._lock = threading.Lock()
        self._held: list[bytes] = []
        self._held_bytes = 0
        self._held_since = 0.0
        self._at_exit = False
        os.register_at_fork(after_in_child=self._after_fork)

    def _after_fork(self) -> None:
        self._lock = threading.Lock()  # a lock held by another thread at fork time stays held
        self._held, self._held_bytes = [], 0  # the parent's lines: the parent writes them

    def write(self, record: dict[str, Any]) -> None:
        self.write_line(self.encode(record))

    #: the encoder of a line's JSON (made once: ``json.dumps`` with arguments makes one per call)
    ENCODER = json.JSONEncoder(separators=(",", ":"), default=_jsonable)

    @classmethod
    def encode(cls, record: dict[str, Any]) -> bytes:
        """The line ``write`` writes for ``record``."""
        return (cls.ENCODER.encode(record) + "\n").encode()

    def write_line(self, line: bytes) -> None:
        """Append one encoded line, after the lines held (one ``os.write``)."""
        with self._lock:
            self._write(line)

    def hold_line(self, line: bytes) -> None:
        """Append one encoded line with the next ones: a step line, many a second, each written
        by its own ``os.write`` would cost the job a system call per step. Written at the
        latest after ``HOLD_BYTES`` or ``HOLD_SECONDS``, with the next :meth:`write_line`, at
        :meth:`flush` and at the process's exit (a process killed loses what it held)."""
        with self._lock:
            if not self._held:
                self._held_since = time.monotonic()
                if not self._at_exit:
                    self._at_exit = True
                    atexit.register(self.flush)
                    if (mp_util := sys.modules.get("multiprocessing.util")) is not None:
                        # a multiprocessing child ends with os._exit: its finalizers run, atexit's not
                        mp_util.Finalize(None, self.flush, exitpriority=0)
            self._held.append(line)
            self._held_bytes += len(line)
            if self._held_bytes >= self.HOLD_BYTES or time.monotonic() - self._held_since >= self.HOLD_SECONDS:
                self._write(b"")

    def flush(self) -> None:
        """Write the lines held."""
        with self._lock:
            if self._held:
                self._write(b"")

    def _write(self, line: bytes) -> None:
        if self._held:
            line = b"".join([*self._held, line])
            self._held, self._held_bytes = [], 0
        if not line:
            return
        if self._fd is None:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.write(self._fd, line)


class Agent:
    """The recording of one process: which metrics, where, and the patches that feed them."""

    def __init__(self, spec: dict[str, Any]) -> None:
        rank = os.environ.get("RANK", "0")
        self.huggingface: dict[str, str] = dict(spec.get("huggingface") or {})
        self.lightning: dict[str, str] = dict(spec.get("lightning") or {})
        metrics_dir = spec.get("metrics_dir")
        samples_dir = spec.get("samples_dir")
        self.metrics = (JsonlWriter(os.path.join(metrics_dir, f"rank{rank}.jsonl"))
                        if metrics_dir and (self.huggingface or self.lightning) else None)
        self.samples = JsonlWriter(os.path.join(samples_dir, f"rank{rank}.jsonl")) if samples_dir else None
        self._reported: set[str] = set()
        #: the step records (``_trainguard_step_agent.StepAgent``) when the spec has ``steps_dir``
        self.steps: Any = None
        if spec.get("steps_dir"):
            every = os.environ.get("TRAINGUARD_STEP_STATE_EVERY")  # a drill's, over the job's
            self.steps = sibling("_trainguard_step_agent").StepAgent(
                self, {**spec, "state_every": every} if every else spec, JsonlWriter, sibling("_trainguard_step_values"))
            self.steps.extras = sibling("_trainguard_step_extras").StepExtras(self.steps)
        #: the answer to a stall (``_trainguard_stall_agent.StallAgent``) when the spec has ``stall_dir``
        self.stall: Any = sibling("_trainguard_stall_agent").StallAgent(self, spec) if spec.get("stall_dir") else None
        #: each optimizer step's clocks (``_trainguard_pace_agent.PaceAgent``) when the spec has ``pace_dir``
        self.pace: Any = sibling("_trainguard_pace_agent").PaceAgent(self, spec) if spec.get("pace_dir") else None

    # -- safety ----------------------------------------------------------------------------

    def report(self, what: str, exc: BaseException) -> None:
        """Say once on stderr that ``what`` failed (the job goes on)."""
        if what in self._reported:
            return
        self._reported.add(what)
        with contextlib.suppress(Exception):
            print(f"trainguard run hook: {what} failed ({type(exc).__name__}: {exc}); the job goes "
                  "on, but what trainguard records from this process may be incomplete",
                  file=sys.stderr, flush=True)

    def guard(self, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)``, an exception reported (once per ``what``) instead of raised."""
        try:
            return fn(*args)
        except Exception as exc:
            self.report(what, exc)
            return None

    def write_metrics(self, step: int, values: dict[str, float]) -> None:
        if self.metrics is not None and values:
            self.metrics.write({"step": int(step), **values})

    # -- patching --------------------------------------------------------------------------

    def install(self) -> None:
        """Patch the watched modules now when the job already imported them, else as soon as
        it does."""
        patches: dict[str, Callable[[Any], None]] = {}
        if self.samples is not None:
            patches["torch.utils.data.dataloader"] = self._patch_dataloader
        if self.metrics is not None and self.huggingface:
            patches["transformers.trainer"] = self._patch_huggingface
        if self.metrics is not None and self.lightning:
            patches["lightning.pytorch.trainer.trainer"] = self._patch_lightning
            patches["pytorch_lightning.trainer.trainer"] = self._patch_lightning
        if self.steps is not None:
            patches.update(self.steps.patches())
        if self.stall is not None:
            patches.update(self.stall.patches())
        if self.pace is not None:
            patches.update(self.pace.patches())
        pending = {}
        for name, patch in patches.items():
            if name in sys.modules:
                self.guard(f"patching {name}", patch, sys.modules[name])
            else:
                pending[name] = patch
        if pending:
            sys.meta_path.insert(0, _ImportHook(self, pending))

    def _patch_huggingface(self, module: Any) -> None:
        trainer_cls = module.Trainer
        recorder_cls = recorder_class("huggingface", sys.modules["transformers.trainer_callback"].TrainerCallback)
        original = trainer_cls.__init__
        agent = self

        @functools.wraps(original)
        def __init__(trainer: Any, *args: Any, **kwargs: Any) -> None:
            original(trainer, *args, **kwargs)
            agent.guard("attaching to the Hugging Face Trainer", _attach_huggingface, trainer, recorder_cls)

        trainer_cls.__init__ = __init__

    def _patch_lightning(self, module: Any) -> None:
        package = module.__name__[: -len(".trainer.trainer")]
        callbacks = sys.modules.get(package + ".callbacks")
        if callbacks is None:  # the trainer module imports it; a layout change lands here
            import importlib

            callbacks = importlib.import_module(package + ".callbacks")
        recorder_cls = recorder_class("lightning", callbacks.Callback)
        trainer_cls = module.Trainer
        original = trainer_cls.__init__
        agent = self

        @functools.wraps(original)
        def __init__(trainer: Any, *args: Any, **kwargs: Any) -> None:
            original(trainer, *args, **kwargs)
            agent.guard("attaching to the Lightning Trainer", trainer.callbacks.append, recorder_cls())

        trainer_cls.__init__ = __init__

    def _patch_dataloader(self, module: Any) -> None:
        base = module._BaseDataLoaderIter
        iterable = module.IterableDataset
        original_init, original_reset = base.__init__, base._reset
        original_next_index, original_next = base._next_index, base.__next__
        loaders: weakref.WeakKeyDictionary[Any, list[int]] = weakref.WeakKeyDictionary()
        numbers = itertools.count()
        agent, writer = self, self.samples
        assert writer is not None

        def start(it: Any, loader: Any) -> None:
            """A new pass over ``loader`` (a new iterator, or a persistent one reset)."""
            it.__dict__.pop(_ITER_ATTR, None)
            worker = sys.modules.get("torch.utils.data._utils.worker")
            if worker is not None and worker.get_worker_info() is not None:
                return  # a DataLoader worker: the main process records its loader's batches
            dataset = loader.dataset
            if isinstance(dataset, iterable):
                return  # no indices: an iterable dataset yields what it yields
            if getattr(loader, "in_order", True) is False and getattr(loader, "num_workers", 0) > 0:
                return  # its workers' batches come back out of the order asked: never a wrong pairing
            record = loaders.get(loader)
            if record is None:
                record = loaders[loader] = [next(numbers), 0]
            try:
                size = str(len(dataset))
            except Exception:
                size = "?"
            it.__dict__[_ITER_ATTR] = _Pass(record[0], f"{type(dataset).__name__}({size})", record[1])
            record[1] += 1

        @functools.wraps(original_init)
        def __init__(it: Any, loader: Any, *args: Any, **kwargs: Any) -> None:
            original_init(it, loader, *args, **kwargs)
            agent.guard("recording sample indices", start, it, loader)

        @functools.wraps(original_reset)
        def _reset(it: Any, *args: Any, **kwargs: Any) -> None:
            original_reset(it, *args, **kwargs)
            loader = args[0] if args else kwargs.get("loader")
            first = args[1] if len(args) > 1 else kwargs.get("first_iter", False)
            if loader is not None and not first:  # first_iter: __init__ just started this pass
                agent.guard("recording sample indices", start, it, loader)
            elif (state := it.__dict__.get(_ITER_ATTR)) is not None:
                state.pending.clear()

        @functools.wraps(original_next_index)
        def _next_index(it: Any) -> Any:
            index = original_next_index(it)
            state = it.__dict__.get(_ITER_ATTR)
            if state is not None:  # a worker-backed iterator asks ahead: paired in __next__
                state.pending.append(list(index) if isinstance(index, (list, tuple)) else [index])
            return index

        @functools.wraps(original_next)
        def __next__(it: Any) -> Any:
            data = original_next(it)
            state = it.__dict__.get(_ITER_ATTR)
            if state is not None and state.pending:
                agent.guard("recording sample indices", state.emit, writer)
            return data

        base.__init__, base._reset = __init__, _reset
        base._next_index, base.__next__ = _next_index, __next__


def sibling(name: str) -> Any:
    """The module ``name`` of this directory, loaded by path once (the directory need not be on
    ``sys.path``)."""
    module = sys.modules.get(name)
    if module is None:
        import importlib.util

        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), name + ".py")
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return module


class _Pass:
    """One pass of a DataLoader iterator: the indices asked for and not yet yielded."""

    __slots__ = ("batch", "dataset", "iteration", "loader", "pending")

    def __init__(self, loader: int, dataset: str, iteration: int) -> None:
        self.loader = loader
        self.dataset = dataset
        self.iteration = iteration
        self.batch = 0
        self.pending: deque[list[Any]] = deque()

    def emit(self, writer: JsonlWriter) -> None:
        indices = self.pending.popleft()
        writer.write({"loader": self.loader, "dataset": self.dataset, "iter": self.iteration,
                      "batch": self.batch, "indices": indices})
        self.batch += 1


class _ImportHook(importlib.abc.MetaPathFinder):
    """Runs a patch on a watched module right after the job's import of it executed."""

    def __init__(self, agent: Agent, pending: dict[str, Callable[[Any], None]]) -> None:
        self.agent = agent
        self.pending = pending

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname not in self.pending:
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None:  # (a spec only looked up, not imported, patches nothing)
            spec.loader = _PatchingLoader(spec.loader, self)
        return spec

    def executed(self, module: Any) -> None:
        """``module`` was just imported: patch it (once) and leave once nothing is left."""
        patch = self.pending.pop(module.__name__, None)
        if not self.pending:
            with contextlib.suppress(ValueError):
                sys.meta_path.remove(self)
        if patch is not None:
            self.agent.guard(f"patching {module.__name__}", patch, module)


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, loader: Any, hook: _ImportHook) -> None:
        self._loader = loader
        self._hook = hook

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        module.__loader__ = self._loader  # importlib.resources and friends see the real one
        if getattr(module, "__spec__", None) is not None:
            module.__spec__.loader = self._loader
        self._loader.exec_module(module)
        self._hook.executed(module)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


# -- Hugging Face ------------------------------------------------------------------------------


def _step_loss(losses: list[Any]) -> list[float]:
    """The micro-batch losses as floats, with one device-to-host copy for all of them."""
    torch = sys.modules.get("torch")
    if torch is not None and losses and all(isinstance(x, torch.Tensor) for x in losses):
        with contextlib.suppress(Exception):  # mixed devices or dtypes: one by one below
            return [float(v) for v in torch.stack([x.detach().reshape(()) for x in losses]).tolist()]
    return [float(x) for x in losses]


def _names(trainer: str) -> tuple[list[str], dict[str, str]]:
    """The metric names that take ``trainer``'s per-step loss, and name -> logged key of the rest."""
    wanted = getattr(_agent, trainer, None) or {}
    return [n for n, k in wanted.items() if k == "loss"], {n: k for n, k in wanted.items() if k != "loss"}


#: the recorder classes made so far, by (trainer, callback base class)
_classes: dict[tuple[str, type], type] = {}


def recorder_class(trainer: str, base: type) -> type:
    """The recorder callback class of ``trainer`` ("huggingface" or "lightning") on ``base``
    (the framework's callback class; two Lightning packages have two)."""
    cls = _classes.get((trainer, base))
    if cls is None:
        body = _HuggingFaceRecorder if trainer == "huggingface" else _LightningRecorder
        cls = _classes[trainer, base] = type("TrainguardRecorder", (body, base), {})
    return cls


def _restore_recorder(trainer: str, module: str, qualname: str) -> Any:
    """A recorder that was pickled (Lightning's ``ddp_spawn`` sends the Trainer to new
    processes): a fresh one writing through this process's agent, or an inert callback."""
    import importlib

    base: Any = importlib.import_module(module)
    for part in qualname.split("."):
        base = getattr(base, part)
    if _agent is None or _agent.metrics is None:
        return base()
    return recorder_class(trainer, base)()


class _Recorder:
    """What the recorders share: they pickle as a fresh recorder of the receiving process."""

    trainer = ""

    def __reduce__(self) -> Any:
        base = next(c for c in type(self).__mro__[1:] if not issubclass(c, _Recorder))
        return _restore_recorder, (self.trainer, base.__module__, base.__qualname__)


class _LossTap:
    """The Trainer instance's ``training_step``: the original, whose return value the recorder
    also sees. Pickled or copied with the Trainer, it leaves the plain method behind."""

    def __init__(self, step: Any, recorder: Any) -> None:
        self.step = step
        self.recorder = recorder
        functools.update_wrapper(self, step)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        loss = self.step(*args, **kwargs)
        if _agent is not None:
            _agent.guard("reading the Trainer's loss", self.recorder.add, loss)
        return loss

    def __reduce__(self) -> Any:
        return _same, (self.step,)


def _same(value: Any) -> Any:
    return value


def _attach_huggingface(trainer: Any, recorder_cls: type) -> None:
    recorder = recorder_cls()
    trainer.training_step = _LossTap(trainer.training_step, recorder)  # the most derived class's
    trainer.add_callback(recorder)


class _HuggingFaceRecorder(_Recorder):
    """Writes each optimizer step's training loss and the logged keys trainguard reads."""

    trainer = "huggingface"

    def __init__(self) -> None:
        self.losses: list[Any] = []

    def add(self, loss: Any) -> None:
        if len(self.losses) >= _MAX_PENDING:
            self.losses.clear()
        self.losses.append(loss)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if _agent is not None:
            _agent.guard("recording the Trainer's loss", self._step_end, state)

    def _step_end(self, state: Any) -> None:
        losses, self.losses = self.losses, []
        loss_names, _ = _names(self.trainer)
        if loss_names and losses and _agent is not None:
            # each value is already divided by the accumulation steps (or normalised by the
            # step's token count): their sum is what the Trainer adds to its running loss
            value = math.fsum(_step_loss(losses))
            _agent.write_metrics(state.global_step, dict.fromkeys(loss_names, value))

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
        if logs and _agent is not None:
            _agent.guard("recording the Trainer's logs", self._log, state, logs)

    def _log(self, state: Any, logs: dict[str, Any]) -> None:
        _, logged = _names(self.trainer)
        values = {name: float(logs[key]) for name, key in logged.items()
                  if isinstance(logs.get(key), (int, float)) and not isinstance(logs[key], bool)}
        if _agent is not None:
            _agent.write_metrics(state.global_step, values)


class _LightningRecorder(_Recorder):
    """Writes each optimizer step's training loss and the logged keys trainguard reads (keeps
    no state in checkpoints: ``state_dict`` stays empty)."""

    trainer = "lightning"

    def __init__(self) -> None:
        self.losses: list[Any] = []
        self.before = 0
        self.step_done = False
        self.seen: dict[str, Any] = {}

    def _guard(self, what: str, fn: Callable[..., Any], *args: Any) -> None:
        if _agent is not None:
            _agent.guard(what, fn, *args)

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self.step_done:  # the logger connector has taken the last step's logs by now
            self._guard("recording Lightning's logged metrics", self._logged, trainer)
        self.step_done = False
        self.before = trainer.global_step

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._guard("recording Lightning's loss", self._batch_end, trainer, pl_module, outputs)

    def _batch_end(self, trainer: Any, pl_module: Any, outputs: Any) -> None:
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if hasattr(loss, "detach") or (isinstance(loss, (int, float)) and not isinstance(loss, bool)):
            if len(self.losses) >= _MAX_PENDING:
                self.losses.clear()
            self.losses.append(loss)
        if trainer.global_step <= self.before:
            return  # accumulating: the step ends with a later micro-batch
        self.step_done = True
        losses, self.losses = self.losses, []
        loss_names, _ = _names(self.trainer)
        if not (loss_names and losses) or _agent is None:
            return
        values = _step_loss(losses)
        if pl_module.automatic_optimization:
            # Lightning divides each micro-batch loss by accumulate_grad_batches
            scale = getattr(trainer, "accumulate_grad_batches", 1) or 1
            total = math.fsum(values)
            value = total if len(values) == scale else total * scale / len(values)
        else:
            value = math.fsum(values) / len(values)
        _agent.write_metrics(trainer.global_step, dict.fromkeys(loss_names, value))

    def _logged(self, trainer: Any) -> None:
        _, logged = _names(self.trainer)
        step = trainer.global_step
        if not logged or step < 1 or _agent is None:
            return
        metrics = trainer.callback_metrics
        values = {}
        for name, key in logged.items():
            value = metrics.get(key)
            if value is None or self.seen.get(key) is value:
                continue  # not logged, or not logged again since it was written
            self.seen[key] = value
            values[name] = float(value)
        _agent.write_metrics(step, values)

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        self._guard("recording Lightning's logged metrics", self._logged, trainer)

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        if not trainer.sanity_checking:
            self._guard("recording Lightning's logged metrics", self._logged, trainer)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._guard("recording Lightning's logged metrics", self._logged, trainer)


__all__ = ["ENV_RUN_SPEC", "Agent", "JsonlWriter", "install", "recorder_class", "sibling"]
