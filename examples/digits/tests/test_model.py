"""Seeded unit tests of the digits MLP and its loss, written with trainguard's toolkit.

Every test is seeded (``tg_seed``), so a failure reproduces with the seed its report shows.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from trainguard import (
    assert_batch_independent,
    assert_can_overfit,
    assert_equivalent,
    assert_finite,
    assert_grads_flow,
    assert_loss_connected,
    assert_step_updates,
    assert_tensor_meta,
    seed_everything,
)
from trainguard.unit.strategies import classification_batches

from digits.model import DigitsMLP

PIXELS = 64
CLASSES = 10
BATCH = 16


@pytest.fixture
def model(tg_seed: int) -> DigitsMLP:
    """The model as train.py builds it by default (dropout on), freshly initialised from the seed."""
    return DigitsMLP(dropout=0.1)


@pytest.fixture
def batch(tg_generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of standardised-looking images and labels, drawn from the test's generator."""
    images = torch.randn(BATCH, PIXELS, generator=tg_generator)
    labels = torch.randint(0, CLASSES, (BATCH,), generator=tg_generator)
    return images, labels


@pytest.mark.seeded(seed=0)
def test_logits_have_the_expected_shape_and_are_finite(model, batch):
    images, _ = batch
    logits = model(images)
    assert_tensor_meta(
        logits, shape=(BATCH, CLASSES), dtype=torch.float32, device="cpu", name="logits"
    )
    assert_finite(logits, name="logits")
    # The model also takes the images unflattened, as [batch, 8, 8].
    assert_tensor_meta(
        model.eval()(images.view(BATCH, 8, 8)), shape=(BATCH, CLASSES), name="logits"
    )


def test_every_parameter_gets_a_gradient(model, batch):
    images, labels = batch
    assert_grads_flow(model, F.cross_entropy(model(images), labels))


def test_loss_depends_on_the_logits(model, batch):
    images, labels = batch
    logits = model(images)
    assert_loss_connected(F.cross_entropy(logits, labels), logits)


def test_samples_do_not_leak_into_each_other(model, batch):
    images, _ = batch
    # LayerNorm, not BatchNorm: in train mode too (dropout masks are per element).
    assert_batch_independent(model.eval(), images, sample=3)
    assert_batch_independent(model.train(), images, sample=3)


def test_can_overfit_one_batch(tg_seed, tg_deterministic, batch):
    model = DigitsMLP(dropout=0.0)
    # 16 random images with random labels: memorising them takes well under 50 AdamW steps.
    assert_can_overfit(
        model, batch, F.cross_entropy, steps=50, lr=1e-2, optimizer="adamw", min_relative_drop=0.99
    )


def test_one_adamw_step_updates_every_parameter(model, batch):
    images, labels = batch
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    assert_step_updates(model, lambda: F.cross_entropy(model(images), labels), optimizer)


def test_eval_mode_only_switches_dropout_off(model, batch):
    images, _ = batch
    # The same weights with dropout disabled, left in train mode: eval mode must match it exactly
    # (no running statistics, nothing else that behaves differently in eval).
    no_dropout = copy.deepcopy(model)
    for module in no_dropout.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    with torch.no_grad():
        assert_equivalent(
            model.eval(), no_dropout.train(), images, rtol=0.0, atol=0.0, names=("eval", "p=0")
        )
        # ... and eval mode is repeatable call to call.
        assert_equivalent(model, model, images, rtol=0.0, atol=0.0)


@functools.cache
def _shared_model() -> DigitsMLP:
    seed_everything(0)
    return DigitsMLP(dropout=0.1)


@settings(max_examples=25, deadline=None)
@given(data=classification_batches((PIXELS,), CLASSES))
def test_any_batch_gives_finite_logits_and_a_nonnegative_loss(data):
    # Hypothesis runs the body once per example, which a function-scoped fixture would not see:
    # the model is built once for all examples, and each example reseeds dropout.
    images, labels = data
    model = _shared_model()
    seed_everything(0)
    with torch.no_grad():
        logits = model(images)
    loss = F.cross_entropy(logits, labels)
    assert_finite({"logits": logits, "loss": loss})
    assert loss.item() >= 0.0
