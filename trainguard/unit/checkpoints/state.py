"""What a checkpoint holds: its values flattened to keys, each key's component, what is metadata.

A key is the dotted path to a value (``optimizer.state.0.exp_avg``), prefixed in a checkpoint
directory with the file it is in (``optimizer.pt:state.0.exp_avg``). :func:`classify_key` names
its component (:data:`COMPONENTS`): what a resume must restore. Values that are paths or times
(``best_model_checkpoint``, ``dirpath``, ``train_runtime``, a string holding the run directory)
differ between two correct runs in two directories; they are metadata, kept apart from state.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainguard._internal.readers import OverLimit, Unreadable, shown_name
from trainguard.evidence import UNSET, Evidence, Unset
from trainguard.unit.checkpoints.files import (
    FILE_SUFFIXES,
    CheckpointContents,
    read_checkpoint,
    resolve_checkpoint,
)

__all__ = [
    "COMPONENTS",
    "OPTIONAL",
    "CheckpointInventory",
    "Entry",
    "InventoryEvidence",
    "checkpoint_inventory",
    "classify_key",
    "classify_path",
    "flatten_parts",
    "flatten_state",
    "render_key",
]

#: what a checkpoint's keys belong to: the weights, the optimizer's moments and param groups, the
#: LR schedule, the random generators, the data position (sampler, loader), the step/epoch
#: counters, an average of the weights (EMA, SWA), the mixed-precision loss scaler, everything
#: else (hyperparameters, logs, callbacks)
COMPONENTS = ("model", "optimizer", "scheduler", "rng", "data", "counters", "ema", "scaler", "other")
#: components only some jobs have: a checkpoint without them is not missing anything
OPTIONAL = ("ema", "scaler", "other")

_MODEL = frozenset({
    "model", "models", "state_dict", "model_state_dict", "model_state", "module", "net", "network",
    "weights", "params", "parameters",
})
# an average of the weights: ``ema``, ``ema_model``, ``model_ema``, ``ema_state_dict``, torch's
# AveragedModel (``averaged_model``, ``n_averaged``), ``swa_model``, ``shadow``
_EMA = re.compile(r"(?:^|_)ema(?:$|_)|^(?:averaged_model|n_averaged|swa_model|swa_state|shadow(?:_params)?)$")
# torch.amp.GradScaler's state (``scale``, ``growth_factor``, ``_growth_tracker``, ...) under its key
_SCALER = re.compile(r"(?:^|_)scaler(?:$|_)|^_?growth_tracker$")
_OPTIMIZER = frozenset({
    "optimizer", "optimizers", "optimizer_states", "optimizer_state", "optimizer_state_dict",
    "optim", "optim_state", "optim_state_dict", "opt", "opt_state", "exp_avg", "exp_avg_sq",
    "max_exp_avg_sq", "momentum_buffer", "param_groups", "square_avg", "acc_delta", "exp_inf",
})
_SCHEDULER = frozenset({
    "lr_scheduler", "lr_schedulers", "scheduler", "schedulers", "sched", "scheduler_state",
    "scheduler_state_dict", "lr_scheduler_state", "last_epoch", "_step_count", "base_lrs", "_last_lr",
})
_RNG = re.compile(r"rng|^random(_states?)?$|^generators?(_states?)?$|random_state|^cpu_rng|^cuda_rng")
_DATA = re.compile(r"sampler|loader|dataset|datamodule|fetcher|consumed|samples_seen|data_position"
                   r"|epoch_iter|batch_in_epoch|batches_seen|^data(_state)?$")
_COUNTERS = frozenset({
    "step", "steps", "global_step", "global_steps", "epoch", "epochs", "current_epoch", "iteration",
    "iterations", "iter", "iter_num", "iters", "num_steps", "step_count", "completed_steps",
    "total_steps", "train_step", "_batches_that_stepped", "num_input_tokens_seen", "tokens_seen",
})
#: containers whose contents are configuration or logs, whatever their keys are called
_OPAQUE = frozenset({
    "log_history", "hparams", "hyper_parameters", "args", "config", "model_args", "training_args",
    "cfg", "stateful_callbacks",
})
_PARAM_LEAF = re.compile(r"(weight|bias|running_mean|running_var|num_batches_tracked|_proj|embeddings?)$")

# metadata: a key whose last name is about time or place, a value that is a path or a time
_META_TOKENS = frozenset({
    "time", "times", "timestamp", "datetime", "date", "runtime", "elapsed", "duration", "wall",
    "walltime", "clock", "path", "paths", "dirpath", "dir", "dirs", "directory", "filename",
    "filepath", "file", "hostname", "host", "pid", "uuid", "cwd",
})
_META_NAMES = frozenset({"best_model_checkpoint", "last_model_checkpoint"})
_ABS_PATH = re.compile(r"^(?:/|~/|[A-Za-z]:[\\/])\S*[\\/]")
_DATETIME = re.compile(r"\d{4}-\d{2}-\d{2}[T _]\d{2}:\d{2}")


@dataclass(frozen=True)
class Entry:
    """One value of a checkpoint: the part it is in ("" for a one-file checkpoint), its path of
    keys, the value, and whether it is metadata (a path or a time)."""

    part: str
    segments: tuple[str, ...]
    value: Any
    metadata: bool = False

    @property
    def key(self) -> str:
        return render_key(self.part, self.segments)


def render_key(part: str, segments: tuple[str, ...]) -> str:
    """``optimizer.pt:state.0.exp_avg``; without a part ``optimizer.state.0.exp_avg``."""
    dotted = ".".join(segments)
    if not part:
        return dotted
    return f"{part}:{dotted}" if dotted else part


def _looks_like_path(text: str, roots: tuple[str, ...]) -> bool:
    if _ABS_PATH.match(text) or any(root and root in text for root in roots):
        return True
    last = text.rstrip("/\\").rsplit("/", 1)[-1]
    return "/" in text and (Path(last).suffix in FILE_SUFFIXES or last.startswith("checkpoint-"))


def _meta_name(name: str) -> bool:
    lower = name.lower()
    if lower in _META_NAMES or "per_second" in lower or lower.endswith("_at"):
        return True
    return bool(_META_TOKENS.intersection(re.split(r"[_\-. ]+", lower)))


def _is_metadata(segments: tuple[str, ...], value: Any, roots: tuple[str, ...]) -> bool:
    if _is_tensor(value):
        return False
    if isinstance(value, str) and (_looks_like_path(value, roots) or _DATETIME.search(value)):
        return True
    names = [s for s in segments if not s.isdigit()]
    return bool(names) and _meta_name(names[-1])


def _is_tensor(value: Any) -> bool:
    return type(value).__module__.startswith("torch") and hasattr(value, "shape")


def _plain(value: Any) -> Any:
    """numpy arrays as tensors and numpy scalars as Python numbers, so they compare alike."""
    module = type(value).__module__
    if module.startswith("numpy"):
        import numpy as np
        import torch

        if isinstance(value, np.ndarray):
            if value.dtype == object:
                return value.tolist()
            return torch.from_numpy(np.ascontiguousarray(value).copy())
        if isinstance(value, np.generic):
            return value.item()
    return value


#: the deepest nesting of a checkpoint's values that is read (a real state dict nests < 10 deep)
MAX_DEPTH = 100
#: the most values one part of a checkpoint is flattened to
MAX_ENTRIES = 5_000_000


def flatten_state(state: Any, part: str = "", roots: tuple[str, ...] = ()) -> list[Entry]:
    """Every value of a loaded checkpoint part, in order: tensors, numbers, strings and empty
    containers are leaves. A mapping keyed by paths (Lightning's ``best_k_models``) is one
    metadata leaf. ``roots``: directories whose appearance in a string makes it metadata.
    Unreadable past :data:`MAX_DEPTH` levels, OverLimit past :data:`MAX_ENTRIES` values."""
    out: list[Entry] = []

    def walk(value: Any, segments: tuple[str, ...]) -> None:
        if len(segments) > MAX_DEPTH:
            raise Unreadable(f"{part or 'the checkpoint'} nests deeper than {MAX_DEPTH} levels; not read")
        if len(out) > MAX_ENTRIES:  # shared references can make a small pickle a huge tree
            raise OverLimit(f"{part or 'the checkpoint'} holds more than {MAX_ENTRIES} values, over the limit")
        value = _plain(value)
        if isinstance(value, dict):
            keys = [str(k) for k in value]
            if any(_looks_like_path(k, roots) for k in keys):
                out.append(Entry(part, segments, value, True))
                return
            if not value:
                out.append(Entry(part, segments, {}, _is_metadata(segments, {}, roots)))
            for key, child in value.items():
                walk(child, (*segments, str(key)))
            return
        if isinstance(value, (list, tuple)) and not _is_tensor(value):
            if not value:
                out.append(Entry(part, segments, type(value)(), _is_metadata(segments, value, roots)))
            for i, child in enumerate(value):
                walk(child, (*segments, str(i)))
            return
        out.append(Entry(part, segments, value, _is_metadata(segments, value, roots)))

    walk(state, ())
    if _RUN_SUMMARY_FILE.search(part):  # a report of the process's own run, not state
        return [dataclasses.replace(e, metadata=True) for e in out]
    return [dataclasses.replace(e, metadata=True) if not e.metadata and _run_summary(e.segments, e.value) else e
            for e in out]


#: files a trainer writes to report a run (the Trainer's ``all_results.json``, ``train_results.json``)
_RUN_SUMMARY_FILE = re.compile(r"(?:^|[/:])(?:all|train|eval|test|predict)_results\.json$")


#: containers of the run's configuration as saved with the state (nanoGPT's ``config``)
_CONFIG = frozenset({"config", "args", "hparams", "hyper_parameters", "hyperparameters", "cfg", "training_args"})


def _run_summary(segments: tuple[str, ...], value: Any = None) -> bool:
    """The average loss of the process's own run in a log (a resumed run averages only the steps
    it trained), or a string/flag of the saved configuration (the resume itself changes some:
    nanoGPT's ``config.init_from`` is "resume" in the resumed run): they differ after any
    resume, exact or not."""
    if "log_history" in segments and segments[-1] == "train_loss":
        return True
    return bool(segments) and segments[0] in _CONFIG and isinstance(value, (str, bool))


def _file_hint(part: str) -> str | None:
    name = part.rsplit("/", 1)[-1].lower()
    if not name:
        return None
    if "optim" in name:
        return "optimizer"
    if "sched" in name:
        return "scheduler"
    if "rng" in name or "random" in name:
        return "rng"
    if "scaler" in name:
        return "scaler"
    if _EMA.search(name.split(".", 1)[0]):
        return "ema"
    if re.search(r"sampler|dataloader|data_state", name):
        return "data"
    if name.endswith(".safetensors") or name.startswith(
        ("model", "pytorch_model", "adapter_model", "consolidated", "diffusion_pytorch_model")
    ):
        return "model"
    return None


def _segment_component(segment: str) -> str | None:
    lower = segment.lower()
    if lower in _OPAQUE:
        return "other"
    if _RNG.search(lower):
        return "rng"
    if _DATA.search(lower):
        return "data"
    if _EMA.search(lower):
        return "ema"
    if _SCALER.search(lower):
        return "scaler"
    for component, names in (("optimizer", _OPTIMIZER), ("scheduler", _SCHEDULER),
                             ("model", _MODEL), ("counters", _COUNTERS)):
        if lower in names:
            return component
    return None


def classify_path(part: str, segments: tuple[str, ...]) -> tuple[str, int]:
    """``(component, i)``: the component of the key and the index of the segment that decided
    it (-1 when the file's name or the fallback did)."""
    if segments and segments[0] == "loops":  # Lightning's loop progress: counters, but data state
        for i, segment in enumerate(segments):
            if _DATA.search(segment.lower()):
                return "data", i
        return "counters", 0
    hint = _file_hint(part)
    if hint in ("optimizer", "scheduler", "rng", "ema", "scaler"):  # a file of its own: all of it (Adam's `step` too)
        return hint, -1
    for i, segment in enumerate(segments):
        component = _segment_component(segment)
        if component is not None:
            return component, i
    if hint is not None:
        return hint, -1
    if segments and _PARAM_LEAF.search(segments[-1]):
        return "model", -1
    return "other", -1


def classify_key(key: str) -> str:
    """The component (one of :data:`COMPONENTS`) of a checkpoint key: a dotted path, in a
    directory prefixed with its file (``optimizer.pt:state.0.exp_avg`` -> optimizer,
    ``state_dict.fc.weight`` -> model, ``lr_schedulers.0.last_epoch`` -> scheduler,
    ``rng_state.pth:cpu`` -> rng, ``loops.fit_loop.epoch_loop.batch_progress.total.ready`` ->
    counters, ``sampler.start_index`` -> data, ``global_step`` -> counters)."""
    part, sep, dotted = key.partition(":")
    if sep and Path(part).suffix in (*FILE_SUFFIXES, ".json"):
        segments = tuple(dotted.split(".")) if dotted else ()
    else:  # no file prefix (a colon inside a key is part of the key)
        part, segments = "", tuple(key.split("."))
    return classify_path(part, segments)[0]


def _param_state(entry: Entry) -> tuple[tuple[str, ...], str] | None:
    """(parameter id, state name) of an optimizer key ``...state.<param>.<name>``."""
    segments = entry.segments
    for i in range(len(segments) - 2):
        if segments[i] == "state":
            return (entry.part, *segments[: i + 2]), segments[i + 2]
    return None


def _distinct(items: list[str], limit: int) -> str:
    seen = list(dict.fromkeys(items))
    return ", ".join(seen[:limit]) + (", ..." if len(seen) > limit else "")


def describe_keys(component: str, entries: list[tuple[Entry, int]]) -> str:
    """A short account of ``entries`` of one component: the keys themselves when there are at
    most three (``last_epoch, _step_count``), else how many and of what (``12 keys: exp_avg,
    exp_avg_sq of 6 params``)."""
    short = []
    for entry, index in entries:
        tail = entry.segments[index + 1:] if index >= 0 and len(entry.segments) > index + 1 else entry.segments
        while len(tail) > 1 and tail[0].isdigit():  # lr_schedulers.0.last_epoch: one of a list
            tail = tail[1:]
        short.append(".".join(tail) or entry.part or ".".join(entry.segments))
    if len(entries) <= 3:
        return ", ".join(short)
    if component == "optimizer":
        states = [s for s in (_param_state(e) for e, _ in entries) if s is not None]
        if states:
            params = {p for p, _ in states}
            return (f"{len(entries)} keys: {_distinct([n for _, n in states], 4)} of "
                    f"{len(params)} param{'s' if len(params) != 1 else ''}")
    names = [next((s for s in reversed(e.segments) if not s.isdigit()), e.part) for e, _ in entries]
    return f"{len(entries)} keys: {_distinct(names, 3)}"


@dataclass
class CheckpointInventory:
    """What one checkpoint holds, by component.

    ``files``: the parts read; ``skipped``: file -> why it was not read; ``components``:
    component -> keys present; ``details``: component -> a line such as "state for 12
    parameters (exp_avg, exp_avg_sq, step)" or "param_groups only, no per-parameter state";
    ``metadata``: keys whose values are paths or times; ``counts``: component -> (tensors,
    parameters with per-parameter state) for the comparisons that weigh one against another."""

    path: Path
    files: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    components: dict[str, list[str]] = field(default_factory=dict)
    details: dict[str, str] = field(default_factory=dict)
    metadata: list[str] = field(default_factory=list)
    counts: dict[str, tuple[int, int]] = field(default_factory=dict)
    #: torch CPU generator states it holds (``torch.get_rng_state()``: 5056 bytes), one per rank
    #: whose draws it can restore
    torch_rng_states: int = 0
    #: CUDA generator states it holds (``torch.cuda.get_rng_state()``: 16 bytes, or any RNG key
    #: naming cuda): 0 for a GPU job means its GPU draws (dropout) restart from the seed
    cuda_rng_states: int = 0

    def has(self, component: str) -> bool:
        """Whether the checkpoint holds any key of ``component``."""
        if component not in COMPONENTS:
            raise ValueError(f"unknown component {component!r}; one of {', '.join(COMPONENTS)}")
        return bool(self.components.get(component))

    @property
    def missing(self) -> list[str]:
        """The components of a full training state it lacks (all but :data:`OPTIONAL`)."""
        return [c for c in COMPONENTS if c not in OPTIONAL and not self.has(c)]

    def tensors(self, component: str) -> int:
        """How many tensors of ``component`` it holds (0 when the count is unknown)."""
        return self.counts.get(component, (0, 0))[0]

    def parameters_with_state(self) -> int:
        """How many parameters the optimizer holds per-parameter state for."""
        return self.counts.get("optimizer", (0, 0))[1]

    def summary(self) -> str:
        """``holds model (6 tensors), optimizer (state for 6 parameters ...); lacks rng, data``."""
        held = [f"{c} ({self.details[c]})" if c in self.details else c
                for c in COMPONENTS if c != "other" and self.has(c)]
        text = "holds " + (", ".join(held) or "no training state")
        if self.missing:
            text += "; lacks " + ", ".join(self.missing)
        if self.skipped:
            text += "; not read: " + ", ".join(self.skipped)
        return text

    def as_evidence(self) -> InventoryEvidence:
        return InventoryEvidence(
            str(self.path), self.files, self.skipped, {c: len(keys) for c, keys in self.components.items()},
            self.details, self.missing, self.metadata[:20], {c: n for c, (n, _) in self.counts.items() if n})


@dataclass
class InventoryEvidence(Evidence):
    """What a checkpoint holds, in the report (:meth:`CheckpointInventory.as_evidence`)."""

    path: str
    files: list[str]
    skipped: dict[str, str]
    #: component -> how many keys
    components: dict[str, int]
    details: dict[str, str]
    missing: list[str]
    metadata: list[str]
    #: component -> how many tensors
    tensors: dict[str, int]
    #: in words (:meth:`CheckpointInventory.summary`), where a diagnosis reports it
    summary: str | Unset = UNSET


_BUFFER = re.compile(r"^(?:running_mean|running_var|num_batches_tracked|inv_freq|freqs_cis|mask|causal_mask)$")


def _storage(value: Any) -> tuple[int, tuple[int, ...]] | None:
    """Where a tensor's data start and its shape: one tensor saved under two names (a tied
    weight) shares both; tensors in one flat buffer share only the storage."""
    try:
        ptr = int(value.data_ptr())
        return (ptr, tuple(value.shape)) if ptr else None
    except (AttributeError, RuntimeError, TypeError):  # a DTensor shard, a meta tensor
        return None


def _counts(by_component: dict[str, list[tuple[Entry, int]]]) -> dict[str, tuple[int, int]]:
    """component -> (tensors, parameters with optimizer state). The model's and the EMA's tensors
    count what an optimizer would hold state for: no buffers (BatchNorm statistics, rotary
    tables), and a weight tied to another (GPT's ``lm_head`` and ``wte``, one storage) once."""
    counts = {}
    for component, entries in by_component.items():
        tensors = [e.value for e, _ in entries if _is_tensor(e.value)
                   and not (component in ("model", "ema") and _BUFFER.match(e.segments[-1].rsplit(".", 1)[-1] if e.segments else ""))]
        if component in ("model", "ema"):
            storages = [_storage(t) for t in tensors]
            shared = len(storages) - len({s for s in storages if s is not None}) - storages.count(None)
            n = len(tensors) - shared
        else:
            n = len(tensors)
        params = {p for p, _ in filter(None, (_param_state(e) for e, _ in entries))} if component == "optimizer" else ()
        counts[component] = (n, len(params))
    return counts


def _details(by_component: dict[str, list[tuple[Entry, int]]]) -> dict[str, str]:
    details: dict[str, str] = {}
    for component in ("model", "ema"):
        entries = by_component.get(component, [])
        tensors = [e for e, _ in entries if _is_tensor(e.value)]
        if entries:
            elements = sum(int(e.value.numel()) for e in tensors)
            details[component] = f"{len(tensors)} tensors, {elements} elements"
    optimizer = by_component.get("optimizer", [])
    if optimizer:
        states = [s for s in (_param_state(e) for e, _ in optimizer) if s is not None]
        if states:
            params = {p for p, _ in states}
            details["optimizer"] = (f"state for {len(params)} parameters "
                                    f"({_distinct([n for _, n in states], 5)})")
        elif any("param_groups" in e.segments for e, _ in optimizer):
            details["optimizer"] = "param_groups only, no per-parameter state"
        else:
            details["optimizer"] = f"{len(optimizer)} keys, no per-parameter state"
    for component in ("scheduler", "counters", "scaler"):
        scalars = [(e, i) for e, i in by_component.get(component, [])
                   if isinstance(e.value, (int, float)) and not isinstance(e.value, bool)
                   and (component != "scheduler" or e.segments[-1:] in (("last_epoch",), ("_step_count",)))]
        if scalars:
            details[component] = ", ".join(f"{e.key}={e.value}" for e, _ in scalars[:4])
    rng = by_component.get("rng", [])
    if rng:
        names = [(e.segments[i + 1] if 0 <= i < len(e.segments) - 1 else (e.segments[0] if e.segments else e.part))
                 for e, i in rng]
        details["rng"] = _distinct(names, 6)
    data = by_component.get("data", [])
    if data:
        details["data"] = _distinct([e.key for e, _ in data], 3)
    return details


def flatten_parts(contents: CheckpointContents, roots: tuple[str, ...]) -> dict[str, list[Entry]]:
    """:func:`flatten_state` of every part of ``contents``; a part too deep or too large is
    moved to ``contents.skipped`` (and ``over_limit``) instead, the rest still flattened."""
    flat: dict[str, list[Entry]] = {}
    for part, state in list(contents.parts.items()):
        try:
            flat[part] = flatten_state(state, part, roots)
        except (Unreadable, RecursionError) as exc:
            del contents.parts[part]
            contents.refuse(part or shown_name(contents.path.name),
                            exc if isinstance(exc, Unreadable) else Unreadable(f"{part} nests too deep"))
    return flat


def checkpoint_inventory(path: Path) -> CheckpointInventory:
    """What the checkpoint at ``path`` holds: a file, a checkpoint directory, or a folder of
    checkpoints (then its newest complete one). Nothing found: an inventory with no files and
    the reason under ``skipped``."""
    path = Path(path)
    resolved = resolve_checkpoint(path)
    if resolved is None:
        return CheckpointInventory(path, skipped={str(path): "no complete checkpoint there"})
    contents = read_checkpoint(resolved)
    roots = tuple(str(p) for p in {resolved.parent, resolved.parent.parent} if len(str(p)) > 1)
    parts = flatten_parts(contents, roots)
    inventory = CheckpointInventory(resolved, contents.files, dict(contents.skipped))
    by_component: dict[str, list[tuple[Entry, int]]] = {}
    for entries in parts.values():
        for entry in entries:
            if entry.metadata:
                inventory.metadata.append(entry.key)
                continue
            component, index = classify_path(entry.part, entry.segments)
            by_component.setdefault(component, []).append((entry, index))
    inventory.components = {c: [e.key for e, _ in by_component[c]] for c in COMPONENTS if c in by_component}
    inventory.details = _details(by_component)
    inventory.counts = _counts(by_component)
    rng = [e for e, _ in by_component.get("rng", [])]
    inventory.torch_rng_states = sum(1 for e in rng if _is_cpu_generator_state(e.value))
    inventory.cuda_rng_states = sum(1 for e in rng if _is_cuda_generator_state(e))
    return inventory


def _is_cpu_generator_state(value: Any) -> bool:
    return _is_tensor(value) and str(getattr(value, "dtype", "")) == "torch.uint8" and tuple(value.shape) == (5056,)


def _is_cuda_generator_state(entry: Entry) -> bool:
    """A CUDA (Philox) generator state: 16 bytes, seed and offset; or a value under a key naming
    cuda (``torch.cuda.get_rng_state_all()`` saved as a list under "cuda")."""
    value = entry.value
    if _is_tensor(value) and str(getattr(value, "dtype", "")) == "torch.uint8" and tuple(value.shape) == (16,):
        return True
    return any("cuda" in segment.lower() for segment in (entry.part, *entry.segments))
