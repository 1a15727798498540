"""Tests for the unit assertions (trainguard.unit.outputs, gradients, batches, training,
equivalence): each check catches its planted defect and passes clean code."""

from __future__ import annotations

import copy
import dataclasses
from collections import namedtuple

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from trainguard.errors import TrainguardAssertionError, UsageError
from trainguard.unit import seeding
from trainguard.unit.batches import assert_batch_independent
from trainguard.unit.equivalence import assert_close_tree, assert_equivalent
from trainguard.unit.gradients import assert_grads_flow, assert_loss_connected
from trainguard.unit.outputs import assert_finite, assert_tensor_meta
from trainguard.unit.training import assert_can_overfit, assert_step_updates


@pytest.fixture(autouse=True)
def _seeded(monkeypatch: pytest.MonkeyPatch):
    """Each test starts from seed 0, and messages name seed 0 for reproduction."""
    monkeypatch.setattr(seeding, "_current_seed", 0)
    torch.manual_seed(0)


def _mlp(features: int = 4, hidden: int = 8, out: int = 3) -> nn.Sequential:
    return nn.Sequential(nn.Linear(features, hidden), nn.Tanh(), nn.Linear(hidden, out))


# ---------------------------------------------------------------------------------------------
# messages


def test_failure_message_tells_how_to_reproduce_with_the_seed():
    with pytest.raises(TrainguardAssertionError) as info:
        assert_finite(torch.tensor([float("nan")]))
    assert str(info.value).splitlines()[-1].startswith("reproduce: seed_everything(0)")
    assert isinstance(info.value, AssertionError)  # pytest shows it as a test failure


def test_failure_message_without_a_seed_says_how_to_get_one(monkeypatch):
    monkeypatch.setattr(seeding, "_current_seed", None)
    with pytest.raises(TrainguardAssertionError, match=r"no seed was set.*seed_everything"):
        assert_finite(torch.tensor([float("inf")]))


# ---------------------------------------------------------------------------------------------
# assert_finite

Out = namedtuple("Out", ["logits", "aux"])


@dataclasses.dataclass
class StepOut:
    loss: torch.Tensor
    extras: dict


def test_finite_accepts_clean_nested_structures():
    assert_finite(torch.randn(3))
    assert_finite({"a": [torch.ones(2), (torch.zeros(1), 3.0)], "name": "x", "n": None})
    assert_finite(Out(torch.randn(2, 2), torch.tensor(1.0)))
    assert_finite(StepOut(torch.tensor(0.5), {"ids": torch.arange(3)}))


def test_finite_names_path_counts_and_first_index():
    logits = torch.zeros(4, 6)
    logits[0, 2] = float("nan")
    logits[1, 1] = float("nan")
    logits[3, 5] = float("inf")
    output = {"logits": [torch.ones(2), logits], "aux": torch.ones(1)}
    with pytest.raises(TrainguardAssertionError) as info:
        assert_finite(output)
    message = str(info.value)
    assert "output['logits'][1] is not finite" in message
    assert "2 nan, 1 +inf, 0 -inf of 24 elements" in message
    assert "first non-finite element at index (0, 2) = nan" in message


def test_finite_reports_every_offender_and_custom_name():
    with pytest.raises(TrainguardAssertionError) as info:
        assert_finite(Out(logits=torch.tensor([1.0, -float("inf")]), aux=float("nan")), name="step")
    message = str(info.value)
    assert "step.logits is not finite: 0 nan, 0 +inf, 1 -inf" in message
    assert "also not finite: step.aux" in message


def test_finite_checks_dataclass_fields():
    with pytest.raises(TrainguardAssertionError, match=r"out\.extras\['z'\] is not finite"):
        assert_finite(StepOut(torch.tensor(1.0), {"z": torch.tensor([float("nan")])}), "out")


def test_finite_without_tensors_is_a_usage_error():
    with pytest.raises(UsageError, match="found no tensor or number"):
        assert_finite({"a": "text"})


# ---------------------------------------------------------------------------------------------
# assert_tensor_meta


def test_tensor_meta_accepts_matching_and_wildcards():
    t = torch.zeros(5, 3, dtype=torch.float16)
    assert_tensor_meta(t, shape=(None, 3), dtype=torch.float16, device="cpu")
    assert_tensor_meta(t, shape=(-1, -1))
    assert_tensor_meta(t, device=torch.device("cpu"))


def test_tensor_meta_reports_every_mismatch_with_the_name():
    t = torch.zeros(5, 4)
    with pytest.raises(TrainguardAssertionError) as info:
        assert_tensor_meta(t, shape=(None, 3), dtype=torch.int64, device="cuda", name="logits")
    message = str(info.value)
    assert "logits has shape (5, 4), expected (*, 3) (* = any size)" in message
    assert "dtype torch.float32, expected torch.int64" in message
    assert "device cpu, expected cuda" in message


def test_tensor_meta_rank_mismatch():
    with pytest.raises(TrainguardAssertionError, match="shape \\(2, 3\\), expected"):
        assert_tensor_meta(torch.zeros(2, 3), shape=(2, 3, 1))


def test_tensor_meta_rejects_bad_specs_and_non_tensors():
    with pytest.raises(UsageError, match="for shape"):
        assert_tensor_meta(torch.zeros(1), shape=(1.5,))
    with pytest.raises(UsageError, match="for dtype"):
        assert_tensor_meta(torch.zeros(1), dtype="float32")  # type: ignore[arg-type]
    with pytest.raises(TrainguardAssertionError, match=r"x is a list, not a torch\.Tensor"):
        assert_tensor_meta([1, 2], shape=(2,), name="x")


# ---------------------------------------------------------------------------------------------
# assert_grads_flow


class TwoHeads(nn.Module):
    """A trunk plus heads; ``defect`` plants a gradient-flow bug."""

    def __init__(self, defect: str | None = None) -> None:
        super().__init__()
        self.defect = defect
        self.trunk = nn.Linear(4, 8)
        self.head = nn.Linear(8, 2)
        self.head2 = nn.Linear(8, 2)
        self.dead = nn.Linear(4, 8)
        self.dead_head = nn.Linear(8, 2)
        self.scale = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.trunk(x))
        out = self.head(h) * self.scale
        if self.defect == "unused":
            return out + self.dead_head(torch.relu(self.dead(x)))  # head2 never used
        if self.defect == "detached":
            return out + self.head2(h).detach() + self.dead_head(torch.relu(self.dead(x)))
        if self.defect == "dead_relu":
            with torch.no_grad():
                self.dead.bias.fill_(-100.0)  # every pre-activation negative: ReLU is dead
            return out + self.head2(h) + self.dead_head(torch.relu(self.dead(x)))
        if self.defect == "sqrt0":
            return (
                self.head(h) * torch.sqrt(self.scale - 1)
                + self.head2(h)
                + self.dead_head(torch.relu(self.dead(x)))
            )
        return out + self.head2(h) + self.dead_head(torch.relu(self.dead(x)))


def test_grads_flow_passes_a_healthy_model():
    model = TwoHeads()
    loss = model(torch.randn(6, 4)).pow(2).mean()
    magnitudes = assert_grads_flow(model, loss)
    assert set(magnitudes) == {name for name, _ in model.named_parameters()}
    assert all(m > 0 for m in magnitudes.values())


def test_grads_flow_names_unused_layer():
    model = TwoHeads("unused")
    with pytest.raises(TrainguardAssertionError) as info:
        assert_grads_flow(model, model(torch.randn(6, 4)).sum())
    message = str(info.value)
    assert "2 of 11 trainable parameters of TwoHeads" in message
    assert "grad is None (the loss never reached it" in message
    assert "  - head2.weight\n  - head2.bias" in message
    assert "trunk.weight" not in message


def test_grads_flow_names_detached_branch():
    model = TwoHeads("detached")
    with pytest.raises(TrainguardAssertionError, match=r"detach\(\)[\s\S]*- head2\.weight"):
        assert_grads_flow(model, model(torch.randn(6, 4)).sum())


def test_grads_flow_names_dead_relu_layer_as_zero():
    model = TwoHeads("dead_relu")
    with pytest.raises(TrainguardAssertionError) as info:
        assert_grads_flow(model, model(torch.randn(6, 4)).sum())
    message = str(info.value)
    zero_section = message.split("grad is all zero")[1]
    assert "dead.weight" in zero_section
    assert "dead.bias" in zero_section
    assert "dead_head.weight" in zero_section  # its input is all zero too
    assert "dead_head.bias" not in message
    assert "grad is None" not in message


def test_grads_flow_names_non_finite_grad():
    model = TwoHeads("sqrt0")  # d sqrt(s - 1)/ds at s = 1 is inf
    with pytest.raises(TrainguardAssertionError, match=r"not finite[\s\S]*- scale"):
        assert_grads_flow(model, model(torch.randn(6, 4)).sum())


def test_grads_flow_allow_unused_patterns():
    model = TwoHeads("unused")
    assert_grads_flow(model, model(torch.randn(6, 4)).sum(), allow_unused=["head2.*"])
    assert_grads_flow(model, model(torch.randn(6, 4)).sum(), allow_unused="head2.*")
    with pytest.raises(
        UsageError, match=r"allow_unused pattern \'haed2\.\*\' matches no parameter"
    ):
        assert_grads_flow(model, model(torch.randn(6, 4)).sum(), allow_unused=["haed2.*"])


def test_grads_flow_atol_counts_tiny_grads_as_zero():
    model = nn.Linear(2, 1)
    loss = 1e-9 * model(torch.randn(3, 2)).sum()
    with pytest.raises(TrainguardAssertionError, match="weight"):
        assert_grads_flow(model, loss, atol=1e-6)


def test_grads_flow_checks_existing_grads_without_loss():
    model = TwoHeads("unused")
    model(torch.randn(6, 4)).sum().backward()
    with pytest.raises(TrainguardAssertionError, match=r"head2\.weight"):
        assert_grads_flow(model)


def test_grads_flow_rejects_loss_rebuilt_from_item():
    model = TwoHeads()
    loss = model(torch.randn(6, 4)).sum()
    with pytest.raises(TrainguardAssertionError, match=r"a float, not a torch.Tensor.*\.item\(\)"):
        assert_grads_flow(model, loss.item())  # type: ignore[arg-type]
    with pytest.raises(TrainguardAssertionError, match="does not require grad"):
        assert_grads_flow(model, torch.tensor(loss.item()))


def test_grads_flow_all_frozen_model_fails():
    model = nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(TrainguardAssertionError, match="no parameter with requires_grad=True"):
        assert_grads_flow(model)


# ---------------------------------------------------------------------------------------------
# assert_loss_connected


def _two_outputs() -> tuple[nn.Module, dict]:
    model = nn.Linear(4, 3)
    x = torch.randn(5, 4)
    h = model(x)
    return model, {"logits": h, "aux": h.tanh()}


def test_loss_connected_passes_and_keeps_graph():
    model, out = _two_outputs()
    loss = out["logits"].pow(2).mean() + out["aux"].mean()
    assert_loss_connected(loss, out)
    loss.backward()  # graph retained
    assert model.weight.grad is not None


def test_loss_connected_names_unused_output():
    _, out = _two_outputs()
    loss = out["logits"].pow(2).mean()
    with pytest.raises(TrainguardAssertionError) as info:
        assert_loss_connected(loss, out)
    message = str(info.value)
    assert "disconnected from 1 of 2 outputs" in message
    assert "outputs['aux'] is not used by the loss" in message
    assert "outputs['logits']" not in message


def test_loss_connected_catches_loss_from_detached_outputs():
    _, out = _two_outputs()
    loss = out["logits"].detach().pow(2).mean()
    with pytest.raises(TrainguardAssertionError, match=r"does not require grad.*detach\(\)"):
        assert_loss_connected(loss, out)


def test_loss_connected_catches_loss_rebuilt_from_item():
    _, out = _two_outputs()
    value = out["logits"].pow(2).mean().item()
    rebuilt = torch.tensor(value, requires_grad=True) * 1.0  # a fresh leaf: no path to outputs
    with pytest.raises(TrainguardAssertionError, match=r"outputs\['logits'\] is not used"):
        assert_loss_connected(rebuilt, out)


def test_loss_connected_catches_zeroed_output_and_non_scalar_loss():
    _, out = _two_outputs()
    with pytest.raises(TrainguardAssertionError, match=r"outputs\['aux'\] gets an all-zero"):
        assert_loss_connected(out["logits"].sum() + 0.0 * out["aux"].sum(), out)
    with pytest.raises(TrainguardAssertionError, match=r"shape \(5, 3\), expected a scalar"):
        assert_loss_connected(out["logits"].pow(2), out)


def test_loss_connected_names_output_computed_without_grad():
    model = nn.Linear(4, 3)
    x = torch.randn(2, 4)
    logits = model(x)
    with torch.no_grad():
        aux = model(x)
    with pytest.raises(TrainguardAssertionError, match=r"outputs\[1\] does not require grad"):
        assert_loss_connected(logits.sum() + aux.sum(), [logits, aux])


# ---------------------------------------------------------------------------------------------
# assert_batch_independent


class MeanCentered(nn.Module):
    """Planted defect: centers features with the batch mean."""

    def __init__(self) -> None:
        super().__init__()
        self.net = _mlp()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x - x.mean(0))


class BadReshape(nn.Module):
    """Planted defect: a transpose + reshape that shuffles samples into features."""

    def __init__(self) -> None:
        super().__init__()
        self.net = _mlp()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, features = x.shape
        return self.net(x.t().reshape(batch, features))


class TokenModel(nn.Module):
    def __init__(self, mix: bool = False) -> None:
        super().__init__()
        self.mix = mix
        self.embed = nn.Embedding(20, 8)
        self.drop = nn.Dropout(0.5)
        self.out = nn.Linear(8, 5)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.drop(self.embed(ids))  # dropout in train mode: both passes must share masks
        if self.mix:
            h = h + h.mean(dim=0, keepdim=True)
        return self.out(h)


def test_batch_independent_passes_clean_mlp_both_methods():
    model = _mlp()
    x = torch.randn(4, 4)
    assert_batch_independent(model, x)
    assert_batch_independent(model, x, method="perturb", sample=2)
    assert x.grad is None and not x.requires_grad
    assert all(p.grad is None for p in model.parameters())


def test_batch_independent_catches_batch_mean():
    with pytest.raises(TrainguardAssertionError) as info:
        assert_batch_independent(MeanCentered(), torch.randn(4, 4))
    message = str(info.value)
    assert "the output of sample 0 depends on input samples [1, 2, 3]" in message
    assert "sample 1 via input" in message
    assert "x.mean(0)" in message


def test_batch_independent_catches_bad_reshape():
    with pytest.raises(TrainguardAssertionError, match=r"sample 1 depends on input samples"):
        assert_batch_independent(BadReshape(), torch.randn(4, 4), sample=1)
    with pytest.raises(TrainguardAssertionError, match=r"changing input sample 1 changed"):
        assert_batch_independent(BadReshape(), torch.randn(4, 4), sample=1, method="perturb")


def test_batch_independent_perturb_on_token_ids():
    ids = torch.randint(0, 20, (4, 6))
    model = TokenModel()
    rng = torch.get_rng_state()
    assert_batch_independent(model, ids, method="perturb")
    assert torch.equal(torch.get_rng_state(), rng)  # the caller's RNG is left alone
    with pytest.raises(
        TrainguardAssertionError, match=r"changed the outputs of samples \[1, 2, 3\]"
    ):
        assert_batch_independent(TokenModel(mix=True), ids, method="perturb")
    with pytest.raises(UsageError, match="use method='perturb'"):
        assert_batch_independent(model, ids, method="grad")


def test_batch_independent_batchnorm_in_train_mode():
    model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 2))
    x = torch.randn(5, 4)
    with pytest.raises(TrainguardAssertionError) as info:
        assert_batch_independent(model, x)
    message = str(info.value)
    assert "1 (BatchNorm1d)" in message
    assert "allow_batchnorm_train=True" in message and "model.eval()" in message

    running_mean = model[1].running_mean.clone()
    assert_batch_independent(model, x, allow_batchnorm_train=True)
    assert model.training and model[1].training  # modes restored
    assert torch.equal(model[1].running_mean, running_mean)  # no running-stat update leaked
    assert int(model[1].num_batches_tracked) == 0

    model.eval()
    assert_batch_independent(model, x)
    assert not model.training


def test_batch_independent_batchnorm_without_running_stats_always_mixes():
    model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6, track_running_stats=False)).eval()
    with pytest.raises(TrainguardAssertionError, match="track_running_stats=False"):
        assert_batch_independent(model, torch.randn(5, 4), allow_batchnorm_train=True)


def test_batch_independent_instance_norm_is_per_sample():
    # InstanceNorm normalizes each sample with its own statistics, even in train mode with
    # running stats (those are only updated from the batch), so it must not be flagged.
    model = nn.Sequential(nn.Conv1d(2, 3, 3), nn.InstanceNorm1d(3, track_running_stats=True))
    before = model[1].running_mean.clone()
    assert_batch_independent(model, torch.randn(4, 2, 7))
    assert torch.equal(model[1].running_mean, before)


def test_batch_independent_tuple_and_dict_batches_and_batch_dim():
    class Pair(nn.Module):
        def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return a * b.mean(dim=0, keepdim=True)  # leaks through b

    with pytest.raises(TrainguardAssertionError, match=r"via input\[1\]"):
        assert_batch_independent(Pair(), (torch.randn(3, 2), torch.randn(3, 2)))
    with pytest.raises(TrainguardAssertionError, match=r"via input\['b'\]"):
        assert_batch_independent(Pair(), {"a": torch.randn(3, 2), "b": torch.randn(3, 2)})

    seq_first = nn.GRU(3, 4)  # (seq, batch, features): batch_dim=1
    assert_batch_independent(seq_first, torch.randn(5, 3, 3), batch_dim=1)


def test_batch_independent_usage_errors():
    with pytest.raises(UsageError, match="at least 2 samples"):
        assert_batch_independent(_mlp(), torch.randn(1, 4))
    with pytest.raises(UsageError, match="for method"):
        assert_batch_independent(_mlp(), torch.randn(2, 4), method="jacobian")
    with pytest.raises(UsageError, match="for sample"):
        assert_batch_independent(_mlp(), torch.randn(2, 4), sample=2)


# ---------------------------------------------------------------------------------------------
# assert_can_overfit


def _regression_batch() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(8, 4), torch.randn(8, 3)


def test_can_overfit_clean_model_and_copy_semantics():
    model = _mlp(hidden=16)
    before = copy.deepcopy(model.state_dict())
    losses = assert_can_overfit(model, _regression_batch(), F.mse_loss, steps=60, lr=3e-2)
    assert len(losses) == 61
    assert losses[-1] <= 0.1 * losses[0]
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key])  # copy=True trained a copy


def test_can_overfit_copy_false_trains_the_model():
    model = _mlp(hidden=16)
    before = model[0].weight.detach().clone()
    assert_can_overfit(model, _regression_batch(), F.mse_loss, steps=60, lr=3e-2, copy=False)
    assert not torch.equal(model[0].weight, before)


def test_can_overfit_catches_zero_learning_rate():
    with pytest.raises(TrainguardAssertionError) as info:
        assert_can_overfit(
            _mlp(),
            _regression_batch(),
            F.mse_loss,
            steps=20,
            optimizer=lambda params: torch.optim.SGD(params, lr=0.0),
        )
    message = str(info.value)
    assert "did not overfit one batch in 20 steps" in message
    assert "a drop of 0.0% (required: a drop of 90%)" in message
    assert "loss by step: 0: " in message and ", 20: " in message
    assert "did not move at all" in message


def test_can_overfit_catches_params_frozen_by_accident():
    model = _mlp(hidden=16)
    for name, param in model.named_parameters():
        param.requires_grad_(name == "2.bias")  # only the output bias trains
    with pytest.raises(TrainguardAssertionError, match=r"1 of 4 parameter tensors trainable"):
        assert_can_overfit(model, _regression_batch(), F.mse_loss, steps=40, lr=3e-2)
    model.requires_grad_(False)
    with pytest.raises(TrainguardAssertionError, match="every parameter is frozen"):
        assert_can_overfit(model, _regression_batch(), F.mse_loss, steps=5)


def test_can_overfit_max_final_loss_and_classification():
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    losses = assert_can_overfit(
        _mlp(hidden=16), (x, y), F.cross_entropy, steps=60, lr=3e-2, max_final_loss=0.2
    )
    assert losses[-1] <= 0.2
    with pytest.raises(TrainguardAssertionError, match=r"required: final loss <= 1e-09"):
        assert_can_overfit(_mlp(), (x, y), F.cross_entropy, steps=3, max_final_loss=1e-9)


def test_can_overfit_stops_on_nan_loss():
    def exploding(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return (out - target).pow(2).mean() * float("inf")

    with pytest.raises(TrainguardAssertionError, match="the loss became inf at step 0"):
        assert_can_overfit(_mlp(), _regression_batch(), exploding, steps=5)


def test_can_overfit_usage_errors():
    with pytest.raises(UsageError, match="for optimizer"):
        assert_can_overfit(_mlp(), _regression_batch(), F.mse_loss, optimizer="lion")
    with pytest.raises(UsageError, match=r"\(inputs, targets\)"):
        assert_can_overfit(_mlp(), torch.randn(2, 4), F.mse_loss)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# assert_step_updates


class WithFrozen(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 6)
        self.body = nn.Linear(6, 6)
        self.head = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(torch.tanh(self.embed(x)))))


def _loss_for(model: nn.Module):
    x, y = torch.randn(5, 4), torch.randn(5, 2)
    return lambda: F.mse_loss(model(x), y)


def test_step_updates_passes_and_reports_changes():
    model = WithFrozen()
    model.embed.requires_grad_(False)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    changes = assert_step_updates(model, _loss_for(model), opt)
    assert changes["embed.weight"] == 0.0
    assert changes["head.weight"] > 0


def test_step_updates_accepts_a_function_of_the_model():
    model = WithFrozen()
    x, y = torch.randn(5, 4), torch.randn(5, 2)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    assert_step_updates(model, lambda m: F.mse_loss(m(x), y), opt)


def test_step_updates_names_params_the_optimizer_skips():
    model = WithFrozen()
    opt = torch.optim.SGD(
        [{"params": model.embed.parameters()}, {"params": model.body.parameters(), "lr": 0.0}],
        lr=0.1,
    )  # head forgotten, body with lr=0
    with pytest.raises(TrainguardAssertionError) as info:
        assert_step_updates(model, _loss_for(model), opt)
    message = str(info.value)
    assert "left 4 trainable parameters unchanged" in message
    assert "- head.weight: not in any optimizer param group" in message
    assert "- body.bias: its optimizer param group has lr=0" in message
    assert "embed.weight" not in message


def test_step_updates_names_param_without_grad():
    model = TwoHeads("unused")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TrainguardAssertionError, match=r"- head2\.weight: grad is None"):
        assert_step_updates(model, lambda: model(torch.randn(3, 4)).sum(), opt)


def test_step_updates_catches_frozen_params_that_change():
    model = WithFrozen()
    model.embed.requires_grad_(False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(5, 4)

    def buggy_closure() -> torch.Tensor:
        with torch.no_grad():
            model.embed.weight.mul_(0.9)  # an "EMA" writing into a frozen weight
        return model(x).pow(2).mean()

    with pytest.raises(TrainguardAssertionError) as info:
        assert_step_updates(model, buggy_closure, opt)
    message = str(info.value)
    assert "changed 1 parameters that should stay frozen" in message
    assert "- embed.weight: changed by" in message and "requires_grad=False" in message


def test_step_updates_expect_frozen_pattern():
    model = WithFrozen()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(
        TrainguardAssertionError, match=r"- embed\.weight: changed by .* expect_frozen"
    ):
        assert_step_updates(model, _loss_for(model), opt, expect_frozen=["embed.*"])
    model.embed.requires_grad_(False)
    assert_step_updates(model, _loss_for(model), opt, expect_frozen=["embed.*"])
    with pytest.raises(UsageError, match=r"expect_frozen pattern \'emb\.\*\' matches no parameter"):
        assert_step_updates(model, _loss_for(model), opt, expect_frozen=["emb.*"])


# ---------------------------------------------------------------------------------------------
# assert_equivalent / assert_close_tree


def reference_layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor):
    mean = x.mean(-1, keepdim=True)
    var = x.var(-1, unbiased=False, keepdim=True)
    return {"out": (x - mean) / torch.sqrt(var + 1e-5) * weight + bias, "mean": mean}


def fused_layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor):
    out = F.layer_norm(x, x.shape[-1:], weight, bias, eps=1e-5)
    return {"out": out, "mean": x.mean(-1, keepdim=True)}


def buggy_fused_layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor):
    result = fused_layer_norm(x, weight, bias)
    result["out"] = result["out"] + 1e-3  # planted: off by 1e-3
    return result


def _ln_args():
    return torch.randn(4, 16), torch.randn(16), torch.randn(16)


def test_equivalent_passes_for_matching_implementations():
    assert_equivalent(fused_layer_norm, reference_layer_norm, *_ln_args(), rtol=1e-5, atol=1e-5)


def test_equivalent_names_output_sides_and_differences():
    with pytest.raises(TrainguardAssertionError) as info:
        assert_equivalent(
            buggy_fused_layer_norm,
            reference_layer_norm,
            *_ln_args(),
            rtol=1e-5,
            atol=1e-5,
            names=("fused", "reference"),
        )
    message = str(info.value)
    assert "fused and reference disagree; 1 of 2 entries differ" in message
    assert "output.out: 64 of 64 elements differ; max abs diff 0.001" in message
    assert "max rel diff" in message and "at index (" in message
    assert "output.mean" not in message


def test_equivalent_shares_rng_state_and_forwards_kwargs():
    def with_dropout(x: torch.Tensor, *, p: float) -> torch.Tensor:
        return F.dropout(x, p=p)

    def also_dropout(x: torch.Tensor, *, p: float) -> torch.Tensor:
        return F.dropout(x.clone(), p=p)

    assert_equivalent(with_dropout, also_dropout, torch.ones(100), p=0.5, rtol=0, atol=0)


def test_equivalent_requires_tolerances():
    with pytest.raises(UsageError, match="needs explicit tolerances: pass rtol= and atol="):
        assert_equivalent(torch.sin, torch.sin, torch.ones(2))
    with pytest.raises(UsageError, match="needs explicit tolerances"):
        assert_equivalent(torch.sin, torch.sin, torch.ones(2), rtol=0.0)
    with pytest.raises(UsageError, match="for atol"):
        assert_equivalent(torch.sin, torch.sin, torch.ones(2), rtol=0.0, atol=-1.0)


def _checkpoint() -> dict:
    return {
        "model": {"w": torch.arange(6.0).reshape(2, 3), "b": torch.zeros(3)},
        "optimizer": {
            "state": {3: {"exp_avg": torch.ones(4), "step": 10}},
            "param_groups": [{"lr": 0.1, "betas": (0.9, 0.999)}],
        },
        "epoch": 2,
    }


def test_close_tree_passes_identical_trees():
    assert_close_tree(_checkpoint(), _checkpoint(), rtol=0, atol=0, name="ckpt")


def test_close_tree_reports_all_differing_keys():
    resumed = _checkpoint()
    resumed["optimizer"]["state"][3]["exp_avg"][2] += 0.5
    resumed["model"]["w"][1, 2] = 7.0
    resumed["optimizer"]["param_groups"][0]["lr"] = 0.2
    del resumed["model"]["b"]
    resumed["epoch"] = 3
    with pytest.raises(TrainguardAssertionError) as info:
        assert_close_tree(resumed, _checkpoint(), rtol=0, atol=0, name="ckpt")
    message = str(info.value)
    assert "ckpt differs from the expected value; 5 of" in message
    assert "ckpt.model: keys ['b'] missing in actual" in message
    assert "ckpt.model.w: 1 of 6 elements differ; max abs diff 2 at index (1, 2)" in message
    assert "ckpt.optimizer.state.3.exp_avg: 1 of 4 elements differ" in message
    assert "ckpt.optimizer.param_groups.0.lr: 0.2 (actual) != 0.1 (expected)" in message
    assert "ckpt.epoch: 3 (actual) != 2 (expected)" in message
    assert "step" not in message


def test_close_tree_tolerances_and_meta_mismatches():
    a = torch.tensor([1.0, 2.0])
    assert_close_tree(a + 1e-7, a, rtol=0, atol=1e-6)
    with pytest.raises(TrainguardAssertionError, match=r"value: dtype torch.float64 \(actual\)"):
        assert_close_tree(a.double(), a, rtol=0, atol=0)
    with pytest.raises(TrainguardAssertionError, match=r"value\.x: shape \(3,\) \(actual\)"):
        assert_close_tree({"x": torch.ones(3)}, {"x": torch.ones(2)}, rtol=0, atol=0)
    with pytest.raises(TrainguardAssertionError, match=r"value: Tensor \(actual\) vs float"):
        assert_close_tree(torch.ones(1), 1.0, rtol=0, atol=0)
    with pytest.raises(UsageError, match="needs explicit tolerances"):
        assert_close_tree(a, a)
