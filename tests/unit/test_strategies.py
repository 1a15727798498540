"""Property tests for trainguard.unit.strategies: shapes, dtypes and ranges are honoured."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trainguard.errors import UsageError
from trainguard.unit.batches import assert_batch_independent
from trainguard.unit.outputs import assert_finite
from trainguard.unit.strategies import (
    batch_shapes,
    batches,
    classification_batches,
    tensors,
    token_batches,
)

FEW = settings(max_examples=15, deadline=None)

FLOAT_DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
INT_DTYPES = [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64]


def _in_range(t: torch.Tensor, lo: float, hi: float) -> bool:
    return bool(((t >= lo) & (t <= hi)).all())


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_float_tensors_honour_shape_dtype_and_range(dtype):
    # 0.1 and 0.3 are not representable in any of these dtypes: bounds are rounded inward.
    @FEW
    @given(t=tensors((3, 2), dtype=dtype, min_value=0.1, max_value=0.3))
    def check(t: torch.Tensor) -> None:
        assert t.shape == (3, 2)
        assert t.dtype == dtype
        assert _in_range(t, 0.1, 0.3)
        assert t.is_contiguous()

    check()


@pytest.mark.parametrize("dtype", INT_DTYPES)
def test_int_tensors_default_range_is_clipped_to_dtype(dtype):
    lo = 0 if dtype == torch.uint8 else -10

    @FEW
    @given(t=tensors(4, dtype=dtype))
    def check(t: torch.Tensor) -> None:
        assert t.shape == (4,) and t.dtype == dtype
        assert _in_range(t, lo, 10)

    check()


@FEW
@given(t=tensors((5,), dtype=torch.bool))
def test_bool_tensors(t):
    assert t.dtype == torch.bool and t.shape == (5,)


@FEW
@given(t=tensors(st.tuples(st.integers(0, 3), st.integers(1, 3)), min_value=-1, max_value=1))
def test_shape_may_be_a_strategy(t):
    assert t.dim() == 2 and 0 <= t.shape[0] <= 3 and 1 <= t.shape[1] <= 3
    assert _in_range(t, -1, 1)


@FEW
@given(t=tensors((8,)))
def test_defaults_are_finite_float32_in_minus_ten_to_ten(t):
    assert t.dtype == torch.float32
    assert_finite(t)
    assert _in_range(t, -10, 10)


def test_nan_and_inf_can_be_drawn_when_allowed():
    seen = {"nan": False, "inf": False}

    @settings(max_examples=60, deadline=None)
    @given(t=tensors((6,), dtype=torch.bfloat16, allow_nan=True, allow_infinity=True))
    def check(t: torch.Tensor) -> None:
        seen["nan"] |= bool(t.isnan().any())
        seen["inf"] |= bool(t.isinf().any())
        finite = t[torch.isfinite(t)]
        assert _in_range(finite, -10, 10)

    check()
    assert seen == {"nan": True, "inf": True}


@FEW
@given(shape=batch_shapes((3, 4), min_batch=2, max_batch=5))
def test_batch_shapes(shape):
    assert len(shape) == 3 and 2 <= shape[0] <= 5 and shape[1:] == (3, 4)


@FEW
@given(x=batches(6, max_batch=4, dtype=torch.float64, min_value=0, max_value=1))
def test_batches(x):
    assert x.dtype == torch.float64 and x.shape[1:] == (6,) and 1 <= x.shape[0] <= 4
    assert _in_range(x, 0, 1)


@FEW
@given(batch=classification_batches((2, 3), num_classes=4, min_batch=2, max_batch=6))
def test_classification_batches(batch):
    x, y = batch
    assert x.shape[1:] == (2, 3) and x.dtype == torch.float32
    assert y.shape == (x.shape[0],) and y.dtype == torch.int64
    assert 2 <= x.shape[0] <= 6
    assert _in_range(y, 0, 3)


@FEW
@given(ids=token_batches(seq_len=7, vocab_size=11, max_batch=3))
def test_token_batches(ids):
    assert ids.dtype == torch.int64 and ids.shape[1] == 7 and 1 <= ids.shape[0] <= 3
    assert _in_range(ids, 0, 10)


# The classic use: a property that must hold for every generated batch.
_model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


@settings(max_examples=10, deadline=None)
@given(x=batches((4,), min_batch=2, max_batch=6))
def test_property_mlp_is_finite_and_batch_independent(x):
    out = _model(x)
    assert out.shape == (x.shape[0], 2)
    assert_finite(out)
    assert_batch_independent(_model, x)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: tensors((2,), dtype="float32"), r"for dtype, got dtype='float32' \(type=str\)"),
        (lambda: tensors((2,), dtype=torch.complex64), "for dtype"),
        (lambda: tensors((-1, 2)), r"non-negative ints for shape, got shape=\(-1, 2\)"),
        (lambda: tensors((2,), min_value=3, max_value=1), "min_value=3 greater than max_value=1"),
        (lambda: tensors((2,), min_value=float("nan")), "finite number for min_value"),
        (lambda: tensors((2,), dtype=torch.uint8, min_value=-1), "min_value <= max_value <= 255"),
        (lambda: tensors((2,), dtype=torch.int8, allow_nan=True), "only apply to float dtypes"),
        (lambda: tensors((2,), dtype=torch.bool, max_value=1), "do not apply to dtype=torch.bool"),
        (lambda: tensors((2,), dtype=torch.float16, min_value=1e-9, max_value=2e-9), "No torch"),
        (lambda: batch_shapes((2,), min_batch=5, max_batch=2), "min_batch=5 greater than"),
        (lambda: batch_shapes((2,), min_batch=True), "int >= 0 for min_batch"),
        (lambda: classification_batches((2,), num_classes=0), "int >= 1 for num_classes"),
        (lambda: classification_batches((2,), 3, min_value=2, max_value=1), "greater than"),
        (lambda: token_batches(0, 10), "int >= 1 for seq_len"),
        (lambda: token_batches(4, "10"), r"vocab_size='10' \(type=str\)"),
    ],
)
def test_bad_arguments_raise_usage_error_eagerly(call, match):
    with pytest.raises(UsageError, match=match):
        call()
