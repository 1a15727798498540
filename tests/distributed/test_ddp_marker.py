"""@pytest.mark.ddp runs a test on N real ranks (gloo) and reports per-rank failures and hangs."""

from __future__ import annotations

import re
from pathlib import Path

import psutil
import pytest

pytest_plugins = ["pytester"]

DDP_TESTS = '''
import time
import pytest
import torch
import torch.distributed as dist

@pytest.fixture
def marker_file(tmp_path):
    return tmp_path / "ran"

@pytest.mark.ddp(world_size=2)
def test_allreduce_sums_ranks(marker_file):
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    assert t.item() == 3.0
    assert dist.get_world_size() == 2
    marker_file.write_text("ok")  # fixtures work inside ranks

@pytest.mark.ddp(world_size=2)
def test_fails_only_on_rank1():
    assert dist.get_rank() == 0, f"planted failure on rank {dist.get_rank()}"

@pytest.mark.ddp(world_size=2)
def test_rank1_hangs():
    if dist.get_rank() == 1:
        time.sleep(600)  # TG-HANG-MARKER
    dist.barrier()

@pytest.mark.ddp(world_size=2, backend="nccl")
def test_needs_gpus():
    pass

def test_session_goes_on():
    pass
'''


def _hang_sleepers() -> list[psutil.Process]:
    out = []
    for proc in psutil.process_iter(["cmdline"]):
        cmd = " ".join(proc.info["cmdline"] or [])
        if "test_rank1_hangs" in cmd and "-m pytest" in cmd:
            out.append(proc)
    return out


@pytest.mark.timeout(240)
def test_ddp_marker_end_to_end(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_ddp=DDP_TESTS)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--trainguard-ddp-timeout=25", "-rA")
    result.assert_outcomes(passed=2, failed=2, skipped=1)
    result.stdout.fnmatch_lines(
        [
            "*rank 1 failed*",
            "*--- rank 1 ---*",
            "*planted failure on rank 1*",
            "*did not finish within 25 s*torn down*",
            "*--- rank 1 stack ---*",
            "*test_rank1_hangs*",
            "PASSED test_ddp.py::test_session_goes_on",
            "*needs 2 GPU(s), found 0*",
        ]
    )
    # the rank-0 failure text must not be blamed on rank 0
    assert "rank 0 failed" not in result.stdout.str()
    # each launch's logs live in a numbered ddp<N> directory under the session's basetemp
    # (pytester passes --basetemp=<pytester.path>/runpytest-<N>)
    # (a failure's text appears twice when the short summary is not cut to the terminal width)
    logs = sorted({Path(p) for p in re.findall(r"^logs: (\S+)$", result.stdout.str(), re.M)})
    assert len(logs) == 2, logs
    for log in logs:
        assert re.fullmatch(r"ddp\d+", log.name) and log.parent.parent == pytester.path, log
    assert _hang_sleepers() == [], "a hung rank outlived its test"
