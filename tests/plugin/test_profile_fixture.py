"""``tg_profile`` and ``@pytest.mark.profile(max_data_wait=..., min_throughput=...)`` in a user's
test run: a clean loop passes, a planted slow input pipeline fails with the numbers, a bad
marker argument is a usage error."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")

LOOPS = """
import time, torch, pytest
from torch.utils.data import DataLoader, TensorDataset, default_collate

def make(slow):
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(128 * 16, 64, generator=g), torch.randint(0, 10, (128 * 16,), generator=g)
    h = 128 if slow else 1024  # the stalled loop's own steps stay short even on a loaded machine
    if slow:  # on one thread: 2 spinning OpenMP threads on 2 loaded cores made its steps 100x longer
        torch.set_num_threads(1)
    model = torch.nn.Sequential(torch.nn.Linear(64, h), torch.nn.ReLU(), torch.nn.Linear(h, h),
                                torch.nn.ReLU(), torch.nn.Linear(h, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    def collate(items):
        time.sleep(0.05)
        return default_collate(items)
    loader = DataLoader(TensorDataset(x, y), batch_size=128, collate_fn=collate if slow else None)
    def epoch(loader):
        for xb, yb in loader:
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(xb), yb).backward()
            opt.step()
    return epoch, loader
"""


def test_tg_profile_passes_a_clean_loop_and_fails_a_stalled_one(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        loops=LOOPS,
        test_loops="""
        import pytest
        from loops import make

        @pytest.mark.profile(max_data_wait=0.25)
        def test_clean(tg_profile):
            prof = tg_profile(*make(False), samples_per_step=128)
            assert prof.step.count > 0

        @pytest.mark.profile(max_data_wait=0.25)
        def test_slow_collate(tg_profile):
            tg_profile(*make(True), samples_per_step=128)
        """,
    )
    result = pytester.runpytest_subprocess("-p", "no:hypothesispytest", "-p", "no:randomly",
                                           "--junitxml=out.xml")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines([
        "*trainguard profile: input pipeline stall: the loop waited for its batches *% of the step time (limit 25%*",
        "*measured: * steps timed, p50 * ms*samples/s, waiting for input *",
    ])
    xml = (pytester.path / "out.xml").read_text()
    assert xml.count('name="trainguard_loop_profile"') == 2
    prop = xml.split('name="trainguard_loop_profile" value="')[1].split('"')[0]
    assert json.loads(prop.replace("&quot;", '"'))["data_wait_share"] < 0.25


def test_bad_profile_marker_argument_is_a_usage_error(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_bad="""
        import pytest

        @pytest.mark.profile(max_data_wait=20)
        def test_x(tg_profile):
            pass
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:hypothesispytest")
    assert result.ret != 0
    result.stdout.fnmatch_lines(["*max_data_wait is a share of the step time (0-1)*"])
