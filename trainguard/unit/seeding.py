"""Seeding and deterministic mode: make a test's randomness and kernels repeatable.

``seed_everything(seed)`` seeds every generator a training step touches (Python ``random``, the
legacy global NumPy generator, torch on the CPU and every CUDA device) and remembers the seed, so
that a failing assertion can say ``reproduce: seed_everything(1234)``.
``deterministic_mode()`` switches torch to deterministic kernels for a block and restores every
setting it touched on exit.

Importing this module does not import torch or NumPy (the pytest plugin asks for
``current_seed()`` and must stay fast); the functions that need them import them on first call.

Example::

    seed_everything(1234)
    with deterministic_mode():
        loss_a = train_step(model, batch)
"""

from __future__ import annotations

import contextlib
import os
import random
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypedDict

from trainguard.errors import UsageError

if TYPE_CHECKING:  # pragma: no cover - for type checkers only
    import torch

__all__ = [
    "CUBLAS_WORKSPACE_CONFIG",
    "DeterministicState",
    "check_seed",
    "current_seed",
    "deterministic_mode",
    "make_generator",
    "rng_state",
    "seed_everything",
    "seed_worker",
    "set_deterministic",
    "set_rng_state",
]

# cuBLAS needs a fixed workspace to pick deterministic GEMM algorithms on CUDA >= 10.2; without it
# torch.use_deterministic_algorithms(True) raises on the first CUDA matmul.
# https://docs.nvidia.com/cuda/cublas/index.html#results-reproducibility
CUBLAS_WORKSPACE_CONFIG = ":4096:8"

_MAX_SEED = 2**32 - 1
_RNG_STATE_KEYS = ("python", "numpy", "torch", "cuda")

# The fine-grained TF32 switches of torch >= 2.9 (``fp32_precision``), parents before children:
# setting a parent can rewrite its children, so restoring walks them in this order. Absent on older
# torch, where the legacy ``allow_tf32`` flags are the whole story.
_FP32_PRECISION_PATHS = (
    "fp32_precision",
    "cuda.matmul.fp32_precision",
    "cudnn.fp32_precision",
    "cudnn.conv.fp32_precision",
    "cudnn.rnn.fp32_precision",
    "mkldnn.fp32_precision",
    "mkldnn.matmul.fp32_precision",
    "mkldnn.conv.fp32_precision",
    "mkldnn.rnn.fp32_precision",
)

_current_seed: int | None = None


def check_seed(seed: object, argname: str = "seed") -> int:
    """``seed`` if it is an int in ``[0, 2**32)`` (what every RNG accepts), else ``UsageError``."""
    # bool is an int subclass; seed=True is always a mistake.
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= _MAX_SEED:
        raise UsageError(
            f"Expected a non-negative int below 2**32 for {argname}, "
            f"got {argname}={seed!r} (type={type(seed).__name__})"
        )
    return seed


def current_seed() -> int | None:
    """The seed of the last ``seed_everything`` call in this process, or None if never seeded.

    Assertion messages use it to tell how to reproduce a failure::

        >>> seed_everything(7)
        7
        >>> current_seed()
        7
    """
    return _current_seed


def seed_everything(seed: int, *, deterministic: bool = False) -> int:
    """Seed Python ``random``, NumPy's global generator, torch (CPU and all CUDA devices).

    Also sets ``PYTHONHASHSEED`` in ``os.environ`` so that child processes (DataLoader workers
    started with spawn, launched ranks) hash strings the same way; the running interpreter's own
    hash seed cannot be changed after start-up. With ``deterministic=True`` the process also
    switches to deterministic kernels for good (see ``set_deterministic``; use the
    ``deterministic_mode()`` context manager to switch back afterwards).

    Returns the seed, and remembers it for ``current_seed()``.

    Example::

        seed = seed_everything(1234)
        x = torch.randn(4, 3)  # the same tensor on every run
    """
    import numpy as np
    import torch

    global _current_seed
    check_seed(seed)
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # seeds the CPU generator and, lazily, every CUDA device
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)
    os.environ["PYTHONHASHSEED"] = str(seed)
    _current_seed = seed
    if deterministic:
        set_deterministic(True)
    return seed


def _resolve(path: str) -> tuple[Any, str]:
    import torch

    obj: Any = torch.backends
    *parents, attr = path.split(".")
    for name in parents:
        obj = getattr(obj, name)
    return obj, attr


def _capture_fp32_precision() -> dict[str, str]:
    values: dict[str, str] = {}
    for path in _FP32_PRECISION_PATHS:
        try:
            obj, attr = _resolve(path)
            values[path] = getattr(obj, attr)
        except (AttributeError, RuntimeError):
            continue  # an older torch without this switch
    return values


def _inductor_deterministic() -> bool | None:
    # Only read when torch.compile's config is already loaded: importing it takes seconds, and
    # until it is loaded it holds its default, which use_deterministic_algorithms keeps in step.
    config = sys.modules.get("torch._inductor.config")
    value = getattr(config, "deterministic", None)
    return value if isinstance(value, bool) else None


def _legacy_or_none(getter: Any) -> Any:
    # torch >= 2.9 raises when the legacy TF32 getters are read after a user mixed the legacy and
    # the fp32_precision APIs; that state cannot be read, only preserved via the fine-grained
    # switches (which _capture_fp32_precision records).
    try:
        return getter()
    except RuntimeError:
        return None


@dataclass
class DeterministicState:
    """A snapshot of every global setting ``deterministic_mode`` touches.

    ``capture()`` reads them; ``restore()`` writes them back exactly, including unsetting
    ``CUBLAS_WORKSPACE_CONFIG`` when it was unset. ``None`` in a field means "could not be read"
    (and is left alone on restore).

    Example::

        state = DeterministicState.capture()
        torch.use_deterministic_algorithms(True)
        ...
        state.restore()
    """

    deterministic_algorithms: bool
    warn_only: bool
    cublas_workspace_config: str | None
    cudnn_deterministic: bool
    cudnn_benchmark: bool
    cudnn_allow_tf32: bool | None
    float32_matmul_precision: str | None
    fp32_precision: dict[str, str] = field(default_factory=dict)
    inductor_deterministic: bool | None = None

    @classmethod
    def capture(cls) -> DeterministicState:
        """Read the current settings."""
        import torch

        return cls(
            deterministic_algorithms=torch.are_deterministic_algorithms_enabled(),
            warn_only=torch.is_deterministic_algorithms_warn_only_enabled(),
            cublas_workspace_config=os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
            cudnn_deterministic=bool(torch.backends.cudnn.deterministic),
            cudnn_benchmark=bool(torch.backends.cudnn.benchmark),
            cudnn_allow_tf32=_legacy_or_none(lambda: bool(torch.backends.cudnn.allow_tf32)),
            float32_matmul_precision=_legacy_or_none(torch.get_float32_matmul_precision),
            fp32_precision=_capture_fp32_precision(),
            inductor_deterministic=_inductor_deterministic(),
        )

    def restore(self) -> None:
        """Write the captured settings back."""
        import torch

        torch.use_deterministic_algorithms(self.deterministic_algorithms, warn_only=self.warn_only)
        # use_deterministic_algorithms also sets torch.compile's flag to the same value; a value
        # the user set on its own is put back after it.
        if self.inductor_deterministic is not None:
            inductor_config: Any = sys.modules["torch._inductor.config"]
            inductor_config.deterministic = self.inductor_deterministic
        if self.cublas_workspace_config is None:
            os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
        else:
            os.environ["CUBLAS_WORKSPACE_CONFIG"] = self.cublas_workspace_config
        torch.backends.cudnn.deterministic = self.cudnn_deterministic
        torch.backends.cudnn.benchmark = self.cudnn_benchmark
        # Legacy switches first: they rewrite the fine-grained ones, which then get their exact
        # values back. Two passes, because a parent switch can rewrite a child set before it.
        if self.float32_matmul_precision is not None:
            torch.set_float32_matmul_precision(self.float32_matmul_precision)
        if self.cudnn_allow_tf32 is not None:
            torch.backends.cudnn.allow_tf32 = self.cudnn_allow_tf32
        for _ in range(2):
            for path, value in self.fp32_precision.items():
                obj, attr = _resolve(path)
                if getattr(obj, attr) != value:
                    setattr(obj, attr, value)


def _disable_tf32() -> None:
    import torch

    # "highest" turns TF32 off for cuBLAS and oneDNN matmuls (== cuda.matmul.allow_tf32 = False).
    torch.set_float32_matmul_precision("highest")
    torch.backends.cudnn.allow_tf32 = False
    # A switch set explicitly through the fine-grained API overrides the legacy flags above.
    for path, value in _capture_fp32_precision().items():
        if value not in ("none", "ieee"):
            obj, attr = _resolve(path)
            setattr(obj, attr, "ieee")


def set_deterministic(enabled: bool = True, *, warn_only: bool = False) -> DeterministicState:
    """Switch deterministic mode on (or off) for the rest of the process.

    Enabling sets ``torch.use_deterministic_algorithms(True, warn_only=warn_only)`` (ops without a
    deterministic kernel raise, or only warn; torch also sets the flag of the same name in
    ``torch._inductor.config`` for compiled code, importing that config the first time, which takes
    a few seconds),
    ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` when unset,
    ``cudnn.deterministic = True``, ``cudnn.benchmark = False`` (autotuning may pick a different
    kernel each run) and TF32 off for matmuls and convolutions. Disabling turns deterministic
    algorithms and ``cudnn.deterministic`` off and leaves the other settings as they are.

    Returns the state before the change; pass it to ``DeterministicState.restore`` to undo.
    Prefer the ``deterministic_mode()`` context manager, which does that for you.
    """
    import torch

    previous = DeterministicState.capture()
    torch.use_deterministic_algorithms(enabled, warn_only=warn_only)
    torch.backends.cudnn.deterministic = enabled
    if enabled:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE_CONFIG)
        torch.backends.cudnn.benchmark = False
        _disable_tf32()
    return previous


@contextlib.contextmanager
def deterministic_mode(enabled: bool = True, *, warn_only: bool = False) -> Iterator[None]:
    """Deterministic kernels inside the block; every touched setting restored on exit.

    See ``set_deterministic`` for what is switched. The settings are process-global: threads
    running meanwhile see them too. On CUDA, ``CUBLAS_WORKSPACE_CONFIG`` only takes effect if it is
    set before the first cuBLAS call of the process, so set it in the environment of the test run
    (or call ``seed_everything(..., deterministic=True)`` early) when testing on GPUs.

    Nests, and works as a decorator::

        with deterministic_mode():
            out = model(x)
            with deterministic_mode(warn_only=True):
                out = op_without_deterministic_kernel(x)

        @deterministic_mode()
        def test_step(): ...
    """
    previous = set_deterministic(enabled, warn_only=warn_only)
    try:
        yield
    finally:
        previous.restore()


def seed_worker(worker_id: int) -> None:
    """DataLoader ``worker_init_fn`` seeding NumPy and ``random`` in each worker.

    torch already gives every worker its own seed (``base_seed + worker_id``) but leaves NumPy and
    ``random`` alone, so with the fork start method all workers would draw the same NumPy numbers.
    This is the recipe of the PyTorch reproducibility notes::

        loader = DataLoader(ds, num_workers=2, worker_init_fn=seed_worker,
                            generator=make_generator(1234))
    """
    import numpy as np
    import torch

    del worker_id  # torch.initial_seed() already differs per worker
    worker_seed = torch.initial_seed() % 2**32
    np.random.seed(worker_seed)
    random.seed(worker_seed)


def make_generator(seed: int) -> torch.Generator:
    """A CPU ``torch.Generator`` seeded with ``seed`` (for DataLoader shuffling and sampling).

    Example::

        g = make_generator(0)
        torch.randn(3, generator=g)  # the same on every run, independent of the global RNG
    """
    import torch

    check_seed(seed)
    generator = torch.Generator()
    generator.manual_seed(seed)
    return generator


# rng_state() holds only tuples, ints, floats, strings and tensors, so a checkpoint containing it
# loads with torch.load(weights_only=True) (the default since torch 2.6); NumPy's state is a
# tuple around a uint32 array, which that loader refuses.
class _PortableNumpyState(TypedDict):
    """NumPy's legacy RNG state (``np.random.get_state()``) as ``rng_state()["numpy"]``."""

    bit_generator: str
    keys: torch.Tensor
    pos: int
    has_gauss: int
    cached_gaussian: float


def _numpy_state_to_portable(state: Any) -> _PortableNumpyState:
    import numpy as np
    import torch

    name, keys, pos, has_gauss, cached_gaussian = state
    return {
        "bit_generator": str(name),
        "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
        "pos": int(pos),
        "has_gauss": int(has_gauss),
        "cached_gaussian": float(cached_gaussian),
    }


def _numpy_state_from_portable(state: Any) -> Any:
    import numpy as np

    if not isinstance(state, Mapping):
        return state  # a tuple straight from np.random.get_state()
    keys = state["keys"]
    keys = keys.numpy() if hasattr(keys, "numpy") else np.asarray(keys)
    return (
        state["bit_generator"],
        keys.astype(np.uint32),
        state["pos"],
        state["has_gauss"],
        state["cached_gaussian"],
    )


def _python_state_from_portable(state: Any) -> Any:
    # random.setstate wants tuples; a state that went through JSON or YAML comes back as lists.
    version, internal, gauss_next = state
    return (version, tuple(internal), gauss_next)


def rng_state() -> dict[str, Any]:
    """The state of every global RNG: ``{"python", "numpy", "torch", "cuda"}``.

    ``"cuda"`` is a list with one state per CUDA device (empty without CUDA). Restore it with
    ``set_rng_state``. It holds only tuples, numbers, strings and tensors, so it can go into a
    checkpoint that ``torch.load(..., weights_only=True)`` reads back::

        state = rng_state()
        a = torch.rand(2)
        set_rng_state(state)
        assert torch.equal(a, torch.rand(2))
    """
    import numpy as np
    import torch

    return {
        "python": random.getstate(),
        "numpy": _numpy_state_to_portable(np.random.get_state()),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Restore the global RNGs from a ``rng_state()`` dict.

    CUDA states are restored when CUDA is available; a state captured on a machine with CUDA
    can be restored on a CPU-only one (the CUDA part is then ignored), but not on a machine with
    a different number of CUDA devices.
    """
    import numpy as np
    import torch

    if not isinstance(state, Mapping) or any(key not in state for key in _RNG_STATE_KEYS):
        got = sorted(state) if isinstance(state, Mapping) else type(state).__name__
        raise UsageError(
            f"Expected a dict from rng_state() with keys {list(_RNG_STATE_KEYS)} for state, "
            f"got {got}"
        )
    cuda_states = list(state["cuda"])
    if cuda_states and torch.cuda.is_available():
        if len(cuda_states) != torch.cuda.device_count():
            raise UsageError(
                f"state holds RNG states for {len(cuda_states)} CUDA devices but this process "
                f"sees {torch.cuda.device_count()}; restore it with the same CUDA_VISIBLE_DEVICES"
            )
        torch.cuda.set_rng_state_all(cuda_states)
    random.setstate(_python_state_from_portable(state["python"]))
    np.random.set_state(_numpy_state_from_portable(state["numpy"]))
    torch.set_rng_state(state["torch"])
