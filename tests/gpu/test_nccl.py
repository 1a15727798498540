"""NCCL paths: the gradient-sync check inside an NCCL process group (``@pytest.mark.ddp`` with
``backend="nccl"``), and a job that joins an NCCL group under DDP, at world size 1 on one GPU
and at 2 where two devices exist (skipped, saying why, elsewhere)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from trainguard.errors import TrainguardAssertionError
from trainguard.session import check
from trainguard.unit.ddp import assert_ddp_gradients_match

HERE = Path(__file__).resolve().parent

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(240)]


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)


def allreduce_mean(model: torch.nn.Module) -> None:
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()


def allreduce_over_eight(model: torch.nn.Module) -> None:
    """Planted: the world size is hard-coded (the job was written for 8 GPUs)."""
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= 8


def _runs_on_the_gpu() -> None:
    assert dist.get_backend() == "nccl", dist.get_backend()
    assert torch.cuda.current_device() == int(__import__("os").environ.get("LOCAL_RANK", "0"))


@pytest.mark.ddp(world_size=1, backend="nccl")
def test_ddp_and_a_hand_written_sync_match_one_process_over_nccl() -> None:
    _runs_on_the_gpu()
    assert_ddp_gradients_match(_model, F.mse_loss, _batch())
    assert_ddp_gradients_match(_model, F.mse_loss, _batch(), grad_sync=allreduce_mean)


@pytest.mark.ddp(world_size=1, backend="nccl")
def test_a_sync_with_a_hard_coded_world_size_is_caught_over_nccl() -> None:
    _runs_on_the_gpu()
    with pytest.raises(TrainguardAssertionError, match=r"norm ratio synced/reference 0\.125"):
        assert_ddp_gradients_match(_model, F.mse_loss, _batch(), grad_sync=allreduce_over_eight)


@pytest.mark.gpu(count=2)
@pytest.mark.ddp(world_size=2, backend="nccl")
def test_ddp_over_nccl_on_two_gpus() -> None:
    _runs_on_the_gpu()
    assert_ddp_gradients_match(_model, F.mse_loss, _batch(), grad_sync=allreduce_mean)
    with pytest.raises(TrainguardAssertionError):
        assert_ddp_gradients_match(_model, F.mse_loss, _batch(), grad_sync=allreduce_over_eight)


JOB_FILE = """\
job:
  name: cuda-mlp-nccl
  command: "python cuda_train.py --steps {steps} --ckpt-dir {checkpoint_dir} --seed {seed} --dist --dropout 0"
  resume_args: "--resume"
  world_size: 1
  env: {CUBLAS_WORKSPACE_CONFIG: ":4096:8", OMP_NUM_THREADS: "2"}
  metrics:
    loss: 'step (?P<step>\\d+) loss (?P<value>\\S+)'
  timeout: 120
  stall_timeout: 60
checks:
"""


def _job(tmp: Path, checks: str) -> Path:
    root = tmp / "nccl-job"
    root.mkdir()
    shutil.copy(HERE / "cuda_train.py", root / "cuda_train.py")
    (root / "trainguard.yaml").write_text(JOB_FILE + checks)
    return root


def test_a_job_in_an_nccl_group_at_world_size_1_passes_smoke_and_resume(tmp_path: Path) -> None:
    root = _job(tmp_path, "  smoke: {steps: 5}\n  resume: {steps: 20, after_step: 12}\n")
    report = check(root, only=["smoke", "resume"], report_json=str(tmp_path / "report.json"))
    for result in report.checks:
        assert result.status == "passed", (result.name, result.summary)


@pytest.mark.gpu(count=2)
def test_the_parallel_check_over_nccl_on_two_gpus(tmp_path: Path) -> None:
    root = _job(tmp_path, "  parallel: {steps: 20, world_size: 2}\n")
    report = check(root, only=["parallel"], report_json=str(tmp_path / "report.json"))
    assert report.checks[0].status == "passed", report.checks[0].summary
