"""assert_ddp_gradients_match on real ranks (gloo): a sum all-reduce is caught, mean and DDP pass."""

from __future__ import annotations

import pytest
import torch

from trainguard.errors import UsageError
from trainguard.unit.ddp import ddp_gradient_diff

pytest_plugins = ["pytester"]

# One pytester run holds every rank case: each @pytest.mark.ddp test starts 2 fresh pytest
# processes that import torch, so sharing the outer run's start-up keeps this file fast.
DDP_GRADIENT_TESTS = '''
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from trainguard.unit.ddp import assert_ddp_gradients_match, ddp_gradient_diff
from trainguard.errors import TrainguardAssertionError, UsageError


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Linear(4, 8)
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        return self.head(torch.tanh(self.encoder(x)))


def global_batch():
    g = torch.Generator().manual_seed(7)
    return torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)


def allreduce_sum(model):
    """The planted defect: summed, never divided by the world size."""
    for p in model.parameters():
        dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)


def allreduce_mean(model):
    for p in model.parameters():
        dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
        p.grad /= dist.get_world_size()


@pytest.mark.ddp(world_size=2)
def test_sum_allreduce():
    assert_ddp_gradients_match(Net, F.mse_loss, global_batch(), grad_sync=allreduce_sum)


def allreduce_all_but_head_bias(model):
    for name, p in model.named_parameters():
        if name != "head.bias":
            dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)


# The refusals ride along with the passing case: every ddp test costs two fresh rank processes.
@pytest.mark.ddp(world_size=2)
def test_mean_and_ddp_match_and_bad_setups_are_refused():
    assert_ddp_gradients_match(Net, F.mse_loss, global_batch(), grad_sync=allreduce_mean)
    assert_ddp_gradients_match(Net, F.mse_loss, global_batch())  # torch DDP
    diffs = ddp_gradient_diff(Net, F.mse_loss, global_batch(), grad_sync=allreduce_mean)
    assert list(diffs) == ["encoder.weight", "encoder.bias", "head.weight", "head.bias"]
    assert max(diffs.values()) < 1e-6

    with pytest.raises(TrainguardAssertionError, match=r"(?s)1 of 4 parameters.*ranks still hold different gradients for head.bias"):
        assert_ddp_gradients_match(Net, F.mse_loss, global_batch(), grad_sync=allreduce_all_but_head_bias)

    x, y = global_batch()
    with pytest.raises(UsageError, match="7 samples along dim 0.*2 equal shards"):
        assert_ddp_gradients_match(Net, F.mse_loss, (x[:7], y[:7]))

    def per_rank_init():
        torch.manual_seed(dist.get_rank())
        return Net()

    with pytest.raises(TrainguardAssertionError, match="initial weights; first differing: parameter encoder.weight"):
        assert_ddp_gradients_match(per_rank_init, F.mse_loss, (x, y), grad_sync=allreduce_mean)
'''


@pytest.mark.timeout(240)
def test_ddp_gradient_cases(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_grads=DDP_GRADIENT_TESTS)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--trainguard-ddp-timeout=60", "-rA")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(
        [
            "*rank 0 failed, rank 1 failed*",
            "*4 of 4 parameters get a different gradient after the cross-rank sync (allreduce_sum, world_size=2)*",
            "*encoder.weight: max abs diff * norm ratio synced/reference 2 *",
            "*encoder.bias: max abs diff*",
            "*head.weight: max abs diff*",
            "*head.bias: max abs diff*",
            "*likely cause: the norm ratio is ~2 = world_size*gradients summed instead of averaged across ranks*",
            "*reproduce: pytest 'test_grads.py::test_sum_allreduce' (on 2 ranks, backend gloo*",
        ]
    )


def test_outside_a_process_group_is_a_usage_error() -> None:
    def model_factory() -> torch.nn.Module:
        return torch.nn.Linear(2, 1)

    batch = (torch.zeros(4, 2), torch.zeros(4, 1))
    with pytest.raises(UsageError, match=r"initialized torch.distributed process group.*@pytest.mark.ddp"):
        ddp_gradient_diff(model_factory, torch.nn.functional.mse_loss, batch)
