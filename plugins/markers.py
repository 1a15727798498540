"""trainguard's markers: one signature function per marker, used three ways.

The function's signature is what ``pytest --markers`` shows, binding a marker's args to it
validates them (a clear message instead of a confusing failure later), and its docstring is the
marker's description.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from trainguard.config.faults import FAULTS
from trainguard.errors import UsageError

__all__ = ["MARKERS", "MarkerSpec", "validate_marker"]

_BACKENDS = (None, "gloo", "nccl", "mpi", "ucc")


def _expect_int(marker: str, arg: str, value: Any, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise UsageError(
            f"@pytest.mark.{marker}: expected an int for {arg}, got {arg}={value!r} "
            f"(type={type(value).__name__})"
        )
    if value < minimum:
        raise UsageError(f"@pytest.mark.{marker}: {arg} must be >= {minimum}, got {arg}={value!r}")


def seeded(seed: int | None = None) -> None:
    """seed everything (python, numpy, torch CPU+CUDA) before the test; without a seed, the
    --trainguard-seed setting (default 0). Failures print the seed to reproduce with."""
    if seed is not None:
        _expect_int("seeded", "seed", seed, minimum=0)
        if seed > 2**32 - 1:
            raise UsageError(f"@pytest.mark.seeded: seed must be < 2**32, got seed={seed!r}")


def smoke() -> None:
    """a smoke run: the job end to end for a few steps."""


def canary() -> None:
    """a canary run: learns on real data within strict limits (`pytest -m canary` in CI)."""


def determinism() -> None:
    """same seed twice gives the same run."""


def resume() -> None:
    """a run killed mid-way and resumed in new processes matches the uninterrupted run."""


def parallel() -> None:
    """N ranks train like 1 rank on the same global batch."""


def reshard() -> None:
    """a run checkpointed at N ranks and resumed at M matches the uninterrupted N-rank run."""


def ddp(world_size: int = 2, backend: str | None = None) -> None:
    """run the test on world_size ranks with an initialized process group (gloo on CPU,
    nccl with GPUs when backend is None)."""
    _expect_int("ddp", "world_size", world_size, minimum=1)
    if backend not in _BACKENDS:
        raise UsageError(
            f"@pytest.mark.ddp: backend must be one of {', '.join(map(repr, _BACKENDS))}, "
            f"got backend={backend!r}"
        )


def fault(kind: str, **params: Any) -> None:
    """a fault-injection drill: kind is a fault kind of docs/drills.md ({kinds});
    params as in the job file's checks.drills entries."""
    if kind not in FAULTS:
        raise UsageError(
            f"@pytest.mark.fault: unknown kind {kind!r}; expected one of {', '.join(FAULTS)}"
        )
    for key in ("rank", "after_step"):
        if key in params:
            _expect_int("fault", key, params[key], minimum=0)


def profile(max_data_wait: float | None = None, min_throughput: float | None = None) -> None:
    """a throughput/scaling profile: `checks.profile` items carry it, `pytest -m profile` selects
    them; on a test using `tg_profile`, the limits its in-process loop profile must meet (share
    of step time waiting for input, samples/s) (docs/profiling.md)."""
    for arg, value in (("max_data_wait", max_data_wait), ("min_throughput", min_throughput)):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise UsageError(f"@pytest.mark.profile: {arg} must be a number >= 0, got {arg}={value!r}")
    if max_data_wait is not None and max_data_wait > 1:
        raise UsageError(f"@pytest.mark.profile: max_data_wait is a share of the step time (0-1), "
                         f"got max_data_wait={max_data_wait!r}")


def gpu(count: int = 1) -> None:
    """needs at least `count` CUDA devices; skipped with the reason when fewer are visible."""
    _expect_int("gpu", "count", count, minimum=1)


def ray() -> None:
    """needs Ray (`pip install trainguard[ray]`) and starts a real local Ray head or fit; select
    with `-m ray` (docs/ray-train.md)."""


def slow() -> None:
    """long-running: long matrices, repeated drills, benchmarks (deselect with -m 'not slow')."""


def _plain_signature(fn: Callable[..., None]) -> str:
    """``(world_size=2, backend=None)``: the signature without annotations, as users write it."""
    parts = []
    for param in inspect.signature(fn).parameters.values():
        if param.kind is param.VAR_KEYWORD:
            parts.append(f"**{param.name}")
        elif param.default is param.empty:
            parts.append(param.name)
        else:
            parts.append(f"{param.name}={param.default!r}")
    return f"({', '.join(parts)})"


@dataclass(frozen=True)
class MarkerSpec:
    name: str
    signature_fn: Callable[..., None]

    @property
    def line(self) -> str:
        """The ``config.addinivalue_line("markers", ...)`` text (``{kinds}`` in a docstring: the
        registered fault kinds, :data:`trainguard.config.faults.FAULTS`)."""
        sig = _plain_signature(self.signature_fn)
        *most, last = FAULTS.names()
        doc = " ".join((self.signature_fn.__doc__ or "").split()).replace("{kinds}", f"{', '.join(most)}, or {last}")
        return f"{self.name}{sig}: {doc}" if sig != "()" else f"{self.name}: {doc}"


MARKERS: dict[str, MarkerSpec] = {
    fn.__name__: MarkerSpec(fn.__name__, fn)
    for fn in (seeded, smoke, canary, determinism, resume, parallel, reshard, ddp, fault, profile, gpu, ray, slow)
}


def validate_marker(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> inspect.BoundArguments:
    """Bind a marker's arguments to its signature and validate them; UsageError if wrong."""
    fn = MARKERS[name].signature_fn
    sig = inspect.signature(fn)
    try:
        bound = sig.bind(*args, **kwargs)
    except TypeError as exc:
        shown = _plain_signature(fn)
        raise UsageError(f"@pytest.mark.{name}{shown}: {exc}") from None
    bound.apply_defaults()
    fn(*bound.args, **bound.kwargs)
    return bound
