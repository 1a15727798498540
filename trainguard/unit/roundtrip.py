"""Training-state round trip: does a checkpoint hold the whole training state?

``assert_state_roundtrip`` trains a few steps in a fresh process, saves, and loads the checkpoint
in another fresh process, then compares every component (model, optimizer, scheduler,
GradScaler, data position, global RNGs) and the next step of both processes. A component the
checkpoint forgets is named with its differing keys (``scheduler.last_epoch``).

Example::

    def test_checkpoint_is_complete():
        assert_state_roundtrip("mytrain.job:build", save="mytrain.job:save",
                               load="mytrain.job:load", pythonpath=[str(SRC)])
"""

from __future__ import annotations

import importlib
import io
import json
import os
import re
import sys
import tempfile
import traceback
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, TypedDict, runtime_checkable

import torch

from trainguard._internal.atomic import atomic_write_bytes, atomic_write_text
from trainguard._internal.tensors import map_tensors
from trainguard.errors import TrainguardAssertionError, UsageError
from trainguard.launch import Launcher, LaunchSpec
from trainguard.unit.checkpoints import load_checkpoint
from trainguard.unit.equivalence import tree_differences
from trainguard.unit.seeding import check_seed, rng_state, seed_everything, set_rng_state
from trainguard.unit.support import check_tolerance

__all__ = ["RNG", "assert_state_roundtrip", "roundtrip_child"]

#: The component key that stands for the global RNGs (Python, NumPy, torch, CUDA) in
#: ``assert_state_roundtrip``: ``build()`` returns ``{..., RNG: None}``.
RNG = "rng"


@runtime_checkable
class Stateful(Protocol):
    """A component of ``build()``: a model, an optimizer, a scheduler, anything with both."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state_dict: Any, /) -> Any: ...


#: ``build()``'s components by name; None only under :data:`RNG` (the global RNGs)
Components = dict[str, Stateful | None]


class RoleSpec(TypedDict):
    """What both processes do (the JSON spec the parent writes): the refs, seed, steps and the
    checkpoint's path."""

    build: str
    step: str
    save: str | None
    load: str | None
    steps: int
    seed: int
    checkpoint: str


class ChildSpec(RoleSpec):
    """One process's spec: its role and where it writes its result or its error."""

    role: str
    result: str
    error: str


class PortableRng(TypedDict):
    """``rng_state()`` as one process records it: Python's 625 ints as one tensor."""

    python: torch.Tensor
    python_gauss_next: float | None
    python_version: int
    numpy: Any
    torch: torch.Tensor
    cuda: list[torch.Tensor]

_MAX_LISTED = 12  # differing keys listed per block of a failure message

_REF = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")

# What the fresh processes run: the spec file says which role (original or restored).
_CHILD_CODE = (
    "import sys\n"
    "from trainguard.unit.roundtrip import roundtrip_child\n"
    "sys.exit(roundtrip_child(sys.argv[1]))\n"
)


def _check_ref(value: object, argname: str, *, optional: bool) -> str | None:
    if value is None and optional:
        return None
    if not isinstance(value, str) or not _REF.match(value):
        raise UsageError(
            f"Expected an importable 'module:function' string for {argname}, got "
            f"{argname}={value!r} (type={type(value).__name__}); e.g. {argname}='mytrain.job:"
            f"{argname}' (the module must be importable in a fresh Python process: add its "
            "directory with pythonpath=[...])"
        )
    return value


def _resolve_ref(ref: str, argname: str) -> Callable[..., Any]:
    module_name, _, attr_path = ref.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise UsageError(
            f"{argname}={ref!r}: cannot import module {module_name!r} in the fresh process "
            f"({type(exc).__name__}: {exc}); add the directory that holds it with "
            f"pythonpath=[...] (sys.path there: {sys.path[:4]} ...)"
        ) from None
    for part in attr_path.split("."):
        if not hasattr(obj, part):
            raise UsageError(
                f"{argname}={ref!r}: module {module_name!r} has no attribute {attr_path!r}; "
                f"define it there or point {argname} at the right function"
            )
        obj = getattr(obj, part)
    if not callable(obj):
        raise UsageError(f"{argname}={ref!r} is a {type(obj).__name__}, not a function")
    return obj  # type: ignore[no-any-return]


def _check_components(components: object, build: str) -> Components:
    if not isinstance(components, Mapping) or not components:
        raise UsageError(
            f"build={build!r} must return a non-empty dict of components "
            f"({{'model': model, 'optimizer': opt, ..., {RNG!r}: None}}), got "
            f"{type(components).__name__}"
        )
    for name, value in components.items():
        if not isinstance(name, str):
            raise UsageError(f"build={build!r}: component names must be strings, got {name!r}")
        if name == RNG and value is None:
            continue
        if not isinstance(value, Stateful):
            raise UsageError(
                f"build={build!r}: component {name!r} is a {type(value).__name__} without "
                "state_dict()/load_state_dict(); wrap it in an object that has both, or use the "
                f"key {RNG!r} with the value None for the global RNGs"
            )
    return {str(name): value for name, value in components.items()}


def _portable_rng() -> PortableRng:
    """rng_state() with Python's 625 ints as one tensor, so a difference is one entry."""
    state = rng_state()
    version, internal, gauss_next = state["python"]
    return {
        "python": torch.tensor(internal, dtype=torch.int64),
        "python_gauss_next": gauss_next,
        "python_version": version,
        "numpy": state["numpy"],
        "torch": state["torch"],
        "cuda": list(state["cuda"]),
    }


def _detached(value: Any) -> Any:
    return map_tensors(value, lambda t: t.detach().cpu().clone())


def _snapshot(components: Components) -> dict[str, Any]:
    """Each component's state now, as copies (a module's state_dict aliases its parameters)."""
    return {
        name: _portable_rng() if obj is None else _detached(obj.state_dict())
        for name, obj in components.items()
    }


def _default_save(components: Components, path: str) -> None:
    """``{name: state_dict()}`` plus ``rng_state()`` under "rng", written atomically."""
    state = {
        name: rng_state() if obj is None else obj.state_dict()
        for name, obj in components.items()
    }
    buffer = io.BytesIO()
    torch.save(state, buffer)
    atomic_write_bytes(path, buffer.getvalue())


def _default_load(components: Components, path: str) -> None:
    """``load_state_dict`` per component, then ``set_rng_state`` (last: loading may draw)."""
    state = torch.load(path, map_location="cpu", weights_only=True)
    for name, obj in components.items():
        if obj is None:  # the RNG component
            continue
        if name not in state:
            raise UsageError(
                f"the checkpoint at {path} has no entry {name!r} (it has {sorted(state)})"
            )
        obj.load_state_dict(state[name])
    if RNG in components and components[RNG] is None:
        set_rng_state(state[RNG])


def roundtrip_child(spec_path: str) -> int:
    """Entry point of the fresh processes of ``assert_state_roundtrip`` (one role each).

    ``spec_path`` is the JSON spec the parent wrote (role, refs, seed, steps and where to write
    the result or the error). Returns the process exit status: 0, or 1 after writing the error
    file. Not meant to be called directly: ``assert_state_roundtrip`` runs it in a new Python.
    """
    spec = json.loads(Path(spec_path).read_text())
    try:
        _run_role(spec)
        return 0
    except BaseException as exc:  # reported to the parent, which raises it there
        kind = "usage" if isinstance(exc, UsageError) else "error"
        atomic_write_text(
            spec["error"],
            json.dumps(
                {
                    "kind": kind,
                    "type": type(exc).__name__,
                    "message": str(exc),
                    "traceback": traceback.format_exc(),
                }
            ),
        )
        return 1


def _run_role(spec: ChildSpec) -> None:
    build = _resolve_ref(spec["build"], "build")
    step = _resolve_ref(spec["step"], "step")
    save = _resolve_ref(spec["save"], "save") if spec["save"] else _default_save
    load = _resolve_ref(spec["load"], "load") if spec["load"] else _default_load
    checkpoint = spec["checkpoint"]
    seed_everything(spec["seed"])
    components = _check_components(build(), spec["build"])
    if spec["role"] == "original":
        for _ in range(spec["steps"]):
            step(components)
        save(components, checkpoint)
        if not Path(checkpoint).exists():
            raise UsageError(
                f"save={spec['save']!r} returned without writing the checkpoint to the path it "
                f"was given ({checkpoint}); save(components, path) must write to path"
            )
    else:
        load(components, checkpoint)
    state = _snapshot(components)
    output = _detached(step(components))
    after = _snapshot(components)
    buffer = io.BytesIO()
    record = {"order": list(components), "state": state, "output": output, "after": after}
    torch.save(record, buffer)
    atomic_write_bytes(spec["result"], buffer.getvalue())


def _child_pythonpath(extra: Sequence[str]) -> str:
    """Extra paths, then the caller's own sys.path entries (not the interpreter's), then
    PYTHONPATH: with --import-mode=importlib the test directories are not on sys.path."""
    prefixes = {
        os.path.realpath(p)
        for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix)
    }
    entries = [os.path.abspath(p) for p in extra]
    for entry in sys.path:
        path = os.path.realpath(entry or os.getcwd())
        if not os.path.isdir(path) or any(
            path == pre or path.startswith(pre + os.sep) for pre in prefixes
        ):
            continue
        entries.append(path)
    entries += [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return os.pathsep.join(dict.fromkeys(entries))


def _run_process(
    role: str, spec: RoleSpec, workdir: Path, pythonpath: str, timeout: float, what: str
) -> dict[str, Any]:
    child: ChildSpec = {
        **spec,
        "role": role,
        "result": str(workdir / f"{role}.result.pt"),
        "error": str(workdir / f"{role}.error.json"),
    }
    spec_path = workdir / f"{role}.spec.json"
    atomic_write_text(spec_path, json.dumps(child))
    result = Launcher(
        LaunchSpec(
            argv=[sys.executable, "-c", _CHILD_CODE, str(spec_path)],
            run_dir=workdir / role,
            cwd=Path.cwd(),
            env={"PYTHONPATH": pythonpath},
            timeout=timeout,
            stall_timeout=None,
            grace_period=2.0,
            label=f"roundtrip-{role}",
        )
    ).run()
    if result.outcome == "timeout":
        stacks = "\n".join(result.evidence.get("stacks", {}).values())
        raise TrainguardAssertionError(
            f"assert_state_roundtrip: the {role} process ({what}) did not finish within "
            f"{timeout:g} s (timeout=) and was killed.\nits stack:\n{stacks}\n"
            f"its stderr:\n{result.stderr_tail}"
        )
    error_path = Path(child["error"])
    if error_path.exists():
        error = json.loads(error_path.read_text())
        if error["kind"] == "usage":
            raise UsageError(f"assert_state_roundtrip ({role} process): {error['message']}")
        raise TrainguardAssertionError(
            f"assert_state_roundtrip: the {role} process ({what}) raised "
            f"{error['type']}: {error['message']}\n{error['traceback'].rstrip()}"
        )
    # died without recording an error (a signal, a crash in native code): not an assertion
    result.raise_for_ranks(f"assert_state_roundtrip: the {role} process ({what})")
    try:
        loaded = load_checkpoint(Path(child["result"]))
    except ValueError as exc:
        raise UsageError(
            f"assert_state_roundtrip: the state recorded by the {role} process cannot be read "
            f"back: {exc}. Component state_dicts and the step's return value must hold only "
            "tensors, numbers, strings and plain containers"
        ) from None
    return loaded  # type: ignore[no-any-return]


def _listed(prefix: str, differences: list[tuple[str, str]]) -> list[str]:
    lines = [
        f"  {prefix}{'.' + key if key else ''}: {what}"
        for key, what in differences[:_MAX_LISTED]
    ]
    if len(differences) > _MAX_LISTED:
        lines.append(f"  ... and {len(differences) - _MAX_LISTED} more")
    return lines


def _entries(count: int) -> str:
    return "1 entry" if count == 1 else f"{count} entries"


def _fix_for(name: str) -> str:
    if name == RNG:
        return (
            "save trainguard.unit.seeding.rng_state() in the checkpoint and call "
            "set_rng_state() on it "
            "after loading: dropout masks, shuffling and augmentation draw from the global RNGs, "
            "so a resumed run without them trains on different randomness"
        )
    return (
        f"save {name}.state_dict() in the checkpoint and call {name}.load_state_dict() with it "
        "on resume (a component rebuilt from scratch restarts where build() leaves it)"
    )


def assert_state_roundtrip(
    build: str,
    *,
    step: str | None = None,
    save: str | None = None,
    load: str | None = None,
    steps: int = 3,
    seed: int = 0,
    rtol: float = 0.0,
    atol: float = 0.0,
    timeout: float = 120.0,
    pythonpath: Sequence[str] = (),
) -> None:
    """Assert a checkpoint restores the whole training state in a new process.

    ``build``, ``step``, ``save`` and ``load`` are importable ``"module:function"`` strings (the
    processes are fresh Pythons, so no closures):

    * ``build() -> dict`` returns the components, in the order to report them: any object with
      ``state_dict()``/``load_state_dict()`` (model, optimizer, LR scheduler, GradScaler, a
      sampler or data-position object, ...), plus the key ``"rng"`` (:data:`RNG`) with the value
      ``None`` for the global RNGs (Python, NumPy, torch, CUDA);
    * ``step(components)`` advances training by one step (it may draw from the RNGs and consume
      data) and returns something to compare, e.g. the loss; default: ``step`` in build's module;
    * ``save(components, path)`` writes a checkpoint to ``path``; default: ``torch.save`` of
      ``{name: state_dict()}`` with ``rng_state()`` under ``"rng"``;
    * ``load(components, path)`` restores freshly built components from it; default:
      ``load_state_dict`` per component, then ``set_rng_state``.

    Process A seeds ``seed``, builds, runs ``steps`` steps, saves, records every component's
    state (the truth) and runs one more step. Process B seeds ``seed``, builds, loads, records
    every component's state and runs the same one more step. Each is a fresh ``python -c``
    process killed after ``timeout`` seconds; they exchange ``torch.save`` files (loaded with
    ``weights_only=True``) in a temp dir. Components are compared in build's order with
    ``tree_differences`` (exact by default; ``rtol``/``atol`` loosen it). The
    ``TrainguardAssertionError`` names the first component that does not survive save -> load,
    lists its differing keys (``scheduler.last_epoch``, ``optimizer.state.0.exp_avg``), and says
    whether the next step diverges (its return value, or any component's state after it). A
    next step that diverges although every component survived fails too: the step depends on
    state outside the components.

    The processes import the modules from ``pythonpath`` (first), then this process's own
    ``sys.path`` entries outside the interpreter's directories, then ``$PYTHONPATH``; they run
    in the current directory.

    Example::

        # mytrain/job.py
        def build():
            model = Net()
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            return {"model": model, "optimizer": opt,
                    "scheduler": torch.optim.lr_scheduler.StepLR(opt, 2), "rng": None}

        def step(c):
            loss = F.cross_entropy(c["model"](X), Y)
            c["optimizer"].zero_grad(); loss.backward(); c["optimizer"].step()
            c["scheduler"].step()
            return loss.detach()

        # tests/test_checkpoint.py
        def test_checkpoint_is_complete():
            assert_state_roundtrip("mytrain.job:build", save="mytrain.ckpt:save",
                                   load="mytrain.ckpt:load")
    """
    build_ref = _check_ref(build, "build", optional=False)
    assert build_ref is not None
    step_ref = _check_ref(step, "step", optional=True) or f"{build_ref.partition(':')[0]}:step"
    save_ref = _check_ref(save, "save", optional=True)
    load_ref = _check_ref(load, "load", optional=True)
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise UsageError(
            f"Expected an int >= 1 for steps, got steps={steps!r} (type={type(steps).__name__}); "
            "the state must have moved away from what build() makes for the check to mean anything"
        )
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise UsageError(
            f"Expected a positive number of seconds for timeout, got timeout={timeout!r}"
        )
    if isinstance(pythonpath, str):
        pythonpath = [pythonpath]
    rtol_ = check_tolerance(rtol, "rtol", "assert_state_roundtrip")
    atol_ = check_tolerance(atol, "atol", "assert_state_roundtrip")
    seed = check_seed(seed)
    child_path = _child_pythonpath(pythonpath)

    with tempfile.TemporaryDirectory(prefix="trainguard-roundtrip-") as tmp:
        workdir = Path(tmp)
        spec: RoleSpec = {
            "build": build_ref,
            "step": step_ref,
            "save": save_ref,
            "load": load_ref,
            "steps": steps,
            "seed": seed,
            "checkpoint": str(workdir / "checkpoint.pt"),
        }
        original = _run_process(
            "original", spec, workdir, child_path, float(timeout),
            f"build -> {steps} steps -> save -> 1 step",
        )
        restored = _run_process(
            "restored", spec, workdir, child_path, float(timeout), "build -> load -> 1 step"
        )

    order: list[str] = original["order"]
    if restored["order"] != order:
        raise UsageError(
            f"build={build_ref!r} returned different components in the two processes: "
            f"{order} then {restored['order']}; build() must be deterministic"
        )
    labels = ("restored", "original")
    broken = [
        (name, diffs)
        for name in order
        if (
            diffs := tree_differences(
                restored["state"][name],
                original["state"][name],
                rtol=rtol_,
                atol=atol_,
                labels=labels,
            )
        )
    ]
    next_diffs = tree_differences(
        {"output": restored["output"], **restored["after"]},
        {"output": original["output"], **original["after"]},
        rtol=rtol_,
        atol=atol_,
        labels=labels,
    )
    if not broken and not next_diffs:
        return

    call = (
        f"assert_state_roundtrip({build_ref!r}, step={step_ref!r}, save={save_ref!r}, "
        f"load={load_ref!r}, steps={steps}, seed={seed})"
    )
    lines: list[str] = []
    if broken:
        name, diffs = broken[0]
        lines.append(
            f"assert_state_roundtrip: component {name!r} does not survive save -> load: "
            f"after {steps} steps, a new process that loaded the checkpoint holds a different "
            f"{name} state ({_entries(len(diffs))} differ, restored vs original):"
        )
        lines += _listed(name, diffs)
        if broken[1:]:
            lines.append(
                "other components that differ: "
                + ", ".join(f"{n!r} ({_entries(len(d))})" for n, d in broken[1:])
            )
        survived = [n for n in order if n not in {b[0] for b in broken}]
        lines.append(f"components that survive: {', '.join(survived) if survived else '(none)'}")
    else:
        lines.append(
            f"assert_state_roundtrip: every component survives save -> load "
            f"({', '.join(order)}), but the next step diverges: it depends on state outside the "
            f"components (global RNGs without the {RNG!r} component, a module-level counter, a "
            "data iterator, ...)"
        )
    if next_diffs:
        lines.append(
            f"the next step diverges ({_entries(len(next_diffs))} differ: "
            "'output' is step()'s return "
            "value, the others the components' state after the step):"
        )
        lines += _listed("next", next_diffs)
    else:
        lines.append("the next step does not diverge (its output and the state after it match)")
    if broken:
        lines.append(f"fix: {_fix_for(broken[0][0])}")
    lines.append(f"reproduce: {call} with PYTHONPATH={child_path}")
    raise TrainguardAssertionError("\n".join(lines))
