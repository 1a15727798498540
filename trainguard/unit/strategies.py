"""Hypothesis strategies that generate torch tensors and batches for property tests.

Built on ``hypothesis.extra.numpy.arrays`` (so shrinking and the example database work as usual)
and converted with ``torch.from_numpy``. Float elements are drawn at the width of the target dtype,
so every value is exactly representable and within ``[min_value, max_value]``; bfloat16 (which
NumPy lacks) is drawn as float32 inside the bf16-representable bounds, then cast.

Example::

    from hypothesis import given, settings
    from trainguard.unit.strategies import batches

    @settings(max_examples=20, deadline=None)
    @given(x=batches((16,), max_batch=4))
    def test_output_shape(x):
        assert model(x).shape == (x.shape[0], 10)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

import numpy as np
import torch
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from hypothesis.strategies import SearchStrategy

from trainguard.errors import UsageError

__all__ = [
    "batch_shapes",
    "batches",
    "classification_batches",
    "tensors",
    "token_batches",
]

_NUMPY_DTYPES: dict[torch.dtype, type[np.generic]] = {
    torch.bool: np.bool_,
    torch.uint8: np.uint8,
    torch.int8: np.int8,
    torch.int16: np.int16,
    torch.int32: np.int32,
    torch.int64: np.int64,
    torch.float16: np.float16,
    torch.bfloat16: np.float32,  # drawn as float32, cast after conversion
    torch.float32: np.float32,
    torch.float64: np.float64,
}
_FLOAT_WIDTHS: dict[torch.dtype, Literal[16, 32, 64]] = {
    torch.float16: 16,
    torch.bfloat16: 32,
    torch.float32: 32,
    torch.float64: 64,
}
_DEFAULT_RANGE = (-10, 10)


def _fail_type(argname: str, expected: str, value: object) -> UsageError:
    return UsageError(
        f"Expected {expected} for {argname}, got {argname}={value!r} (type={type(value).__name__})"
    )


def _check_int(value: object, argname: str, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise _fail_type(argname, f"an int >= {minimum}", value)
    return value


def _check_shape(shape: object, argname: str) -> tuple[int, ...]:
    if isinstance(shape, int) and not isinstance(shape, bool):
        shape = (shape,)
    if not isinstance(shape, (tuple, list)) or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
    ):
        raise _fail_type(argname, "a tuple of non-negative ints", shape)
    return tuple(shape)


def _check_dtype(dtype: object) -> torch.dtype:
    if not isinstance(dtype, torch.dtype) or dtype not in _NUMPY_DTYPES:
        supported = ", ".join(str(d) for d in _NUMPY_DTYPES)
        raise _fail_type("dtype", f"one of {supported}", dtype)
    return dtype


def _check_batch_range(min_batch: object, max_batch: object) -> tuple[int, int]:
    lo = _check_int(min_batch, "min_batch", minimum=0)
    hi = _check_int(max_batch, "max_batch", minimum=0)
    if lo > hi:
        raise UsageError(
            f"Cannot have min_batch={lo} greater than max_batch={hi}; swap them or widen the range"
        )
    return lo, hi


def _check_bound(value: object, argname: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _fail_type(argname, "a finite number", value)
    return value


def _representable(x: float, dtype: torch.dtype, *, upward: bool) -> float:
    """The nearest ``dtype`` value to ``x`` on the inside of the range (upward for a minimum)."""
    t = torch.tensor(x, dtype=torch.float64).to(dtype)
    if (upward and float(t) < x) or (not upward and float(t) > x):
        t = torch.nextafter(t, torch.tensor(math.inf if upward else -math.inf, dtype=dtype))
    return float(t)


def _elements(
    dtype: torch.dtype,
    min_value: float | None,
    max_value: float | None,
    allow_nan: bool,
    allow_infinity: bool,
) -> SearchStrategy[object]:
    if dtype == torch.bool:
        if min_value is not None or max_value is not None:
            raise UsageError("min_value and max_value do not apply to dtype=torch.bool; drop them")
        return st.booleans()
    if dtype.is_floating_point:
        lo = _check_bound(_DEFAULT_RANGE[0] if min_value is None else min_value, "min_value")
        hi = _check_bound(_DEFAULT_RANGE[1] if max_value is None else max_value, "max_value")
        if lo > hi:
            raise UsageError(f"Cannot have min_value={lo} greater than max_value={hi}")
        # Hypothesis needs bounds exactly representable at the element width; round inward.
        lo_r = _representable(lo, dtype, upward=True)
        hi_r = _representable(hi, dtype, upward=False)
        if lo_r > hi_r:
            raise UsageError(
                f"No {dtype} value lies in [min_value={lo}, max_value={hi}]; widen the range"
            )
        elements: SearchStrategy[object] = st.floats(
            min_value=lo_r, max_value=hi_r, width=_FLOAT_WIDTHS[dtype]
        )
        if allow_nan:
            elements = elements | st.just(math.nan)
        if allow_infinity:
            elements = elements | st.sampled_from([math.inf, -math.inf])
        return elements
    if allow_nan or allow_infinity:
        raise UsageError(f"allow_nan and allow_infinity only apply to float dtypes, not {dtype}")
    info = torch.iinfo(dtype)
    lo_default = max(_DEFAULT_RANGE[0], info.min)
    lo = _check_bound(lo_default if min_value is None else min_value, "min_value")
    hi = _check_bound(_DEFAULT_RANGE[1] if max_value is None else max_value, "max_value")
    lo_i, hi_i = math.ceil(lo), math.floor(hi)
    if not info.min <= lo_i <= hi_i <= info.max:
        raise UsageError(
            f"Expected integer bounds with {info.min} <= min_value <= max_value <= {info.max} "
            f"for dtype={dtype}, got min_value={min_value!r}, max_value={max_value!r}"
        )
    return st.integers(min_value=lo_i, max_value=hi_i)


def tensors(
    shape: int | Sequence[int] | SearchStrategy[tuple[int, ...]],
    *,
    dtype: torch.dtype = torch.float32,
    min_value: float | None = None,
    max_value: float | None = None,
    allow_nan: bool = False,
    allow_infinity: bool = False,
) -> SearchStrategy[torch.Tensor]:
    """Tensors of ``shape`` (a tuple of ints, or a strategy drawing one) and ``dtype``.

    Values lie in ``[min_value, max_value]``, by default ``[-10, 10]`` clipped to the dtype's range
    (``[0, 10]`` for uint8); integer bounds are rounded inward. ``allow_nan`` / ``allow_infinity``
    mix nan / +-inf into float tensors. Supported dtypes: bool, uint8, int8/16/32/64, float16,
    bfloat16, float32, float64. The tensors are on the CPU and own their memory.

    Example::

        @given(t=tensors((2, 3), dtype=torch.float16, min_value=0, max_value=1))
        def test_sigmoid_inverse(t): ...
    """
    dtype = _check_dtype(dtype)
    if not isinstance(shape, SearchStrategy):
        shape = _check_shape(shape, "shape")
    elements = _elements(dtype, min_value, max_value, bool(allow_nan), bool(allow_infinity))
    arrays = hnp.arrays(_NUMPY_DTYPES[dtype], shape, elements=elements)

    def to_tensor(array: np.ndarray) -> torch.Tensor:
        # A fresh, writable, contiguous copy: torch.from_numpy shares memory and warns on
        # read-only arrays.
        return torch.from_numpy(np.array(array, copy=True, order="C")).to(dtype)

    return arrays.map(to_tensor)


def batch_shapes(
    feature_shape: int | Sequence[int], *, min_batch: int = 1, max_batch: int = 8
) -> SearchStrategy[tuple[int, ...]]:
    """Shapes ``(batch, *feature_shape)`` with ``min_batch <= batch <= max_batch``.

    Example::

        @given(shape=batch_shapes((3, 32, 32), max_batch=4))
        def test_conv_shapes(shape): ...
    """
    features = _check_shape(feature_shape, "feature_shape")
    lo, hi = _check_batch_range(min_batch, max_batch)
    return st.integers(min_value=lo, max_value=hi).map(lambda b: (b, *features))


def batches(
    feature_shape: int | Sequence[int],
    *,
    min_batch: int = 1,
    max_batch: int = 8,
    dtype: torch.dtype = torch.float32,
    min_value: float | None = None,
    max_value: float | None = None,
    allow_nan: bool = False,
    allow_infinity: bool = False,
) -> SearchStrategy[torch.Tensor]:
    """Input batches: tensors of shape ``(batch, *feature_shape)`` (see ``tensors``).

    Example::

        @given(x=batches((16,), max_batch=4))
        def test_forward_finite(x):
            assert_finite(model(x))
    """
    return tensors(
        batch_shapes(feature_shape, min_batch=min_batch, max_batch=max_batch),
        dtype=dtype,
        min_value=min_value,
        max_value=max_value,
        allow_nan=allow_nan,
        allow_infinity=allow_infinity,
    )


def classification_batches(
    feature_shape: int | Sequence[int],
    num_classes: int,
    *,
    min_batch: int = 1,
    max_batch: int = 8,
    dtype: torch.dtype = torch.float32,
    min_value: float | None = None,
    max_value: float | None = None,
) -> SearchStrategy[tuple[torch.Tensor, torch.Tensor]]:
    """``(x, y)`` pairs: ``x`` of shape ``(batch, *feature_shape)``, int64 labels ``y`` of shape
    ``(batch,)`` in ``[0, num_classes)``.

    Example::

        @given(batch=classification_batches((8,), num_classes=3))
        def test_loss_finite(batch):
            x, y = batch
            assert_finite(F.cross_entropy(model(x), y))
    """
    features = _check_shape(feature_shape, "feature_shape")
    classes = _check_int(num_classes, "num_classes", minimum=1)
    lo, hi = _check_batch_range(min_batch, max_batch)
    # Validate the element arguments now rather than at the first draw.
    tensors((0, *features), dtype=dtype, min_value=min_value, max_value=max_value)

    def pair(size: int) -> SearchStrategy[tuple[torch.Tensor, torch.Tensor]]:
        inputs = tensors((size, *features), dtype=dtype, min_value=min_value, max_value=max_value)
        labels = tensors((size,), dtype=torch.int64, min_value=0, max_value=classes - 1)
        return st.tuples(inputs, labels)

    return st.integers(min_value=lo, max_value=hi).flatmap(pair)


def token_batches(
    seq_len: int, vocab_size: int, *, min_batch: int = 1, max_batch: int = 8
) -> SearchStrategy[torch.Tensor]:
    """Token id batches: int64 tensors of shape ``(batch, seq_len)`` in ``[0, vocab_size)``.

    Example::

        @given(ids=token_batches(seq_len=16, vocab_size=100))
        def test_lm_logits_shape(ids):
            assert lm(ids).shape == (*ids.shape, 100)
    """
    length = _check_int(seq_len, "seq_len", minimum=1)
    vocab = _check_int(vocab_size, "vocab_size", minimum=1)
    return tensors(
        batch_shapes((length,), min_batch=min_batch, max_batch=max_batch),
        dtype=torch.int64,
        min_value=0,
        max_value=vocab - 1,
    )
