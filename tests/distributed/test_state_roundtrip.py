"""assert_state_roundtrip: a full training state saved in one fresh process, loaded in another.

The job and its planted checkpoint defects live in roundtrip_jobs/roundtrip_job.py. Each case
starts two Python processes that import torch (a few seconds each), so the model is tiny.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from trainguard.errors import TrainguardAssertionError, UsageError
from trainguard.unit.roundtrip import assert_state_roundtrip

JOBS = str(Path(__file__).parent / "roundtrip_jobs")


@pytest.mark.timeout(120)
def test_default_save_and_load_restore_everything() -> None:
    assert_state_roundtrip("roundtrip_job:build", steps=3, pythonpath=[JOBS])


@pytest.mark.timeout(120)
def test_a_checkpoint_without_the_scheduler_is_caught() -> None:
    with pytest.raises(TrainguardAssertionError) as failure:
        assert_state_roundtrip(
            "roundtrip_job:build",
            save="roundtrip_job:save_without_scheduler",
            load="roundtrip_job:load_saved",
            pythonpath=[JOBS],
        )
    message = str(failure.value)
    assert message.startswith(
        "assert_state_roundtrip: component 'scheduler' does not survive save -> load"
    )
    assert "  scheduler.last_epoch: 0 (restored) != 3 (original)" in message
    assert "components that survive: model, optimizer, scaler, data, rng" in message
    # the lost schedule shows in the learning rate the next step leaves behind
    assert "the next step diverges" in message
    assert "next.optimizer.param_groups.0.lr: 0.05 (restored) != 0.025 (original)" in message
    assert "fix: save scheduler.state_dict()" in message
    assert "save='roundtrip_job:save_without_scheduler'" in message


@pytest.mark.slow  # the default run plants the scheduler; the rng plant is the same comparison
@pytest.mark.timeout(120)
def test_a_checkpoint_without_the_rng_is_caught() -> None:
    with pytest.raises(TrainguardAssertionError) as failure:
        assert_state_roundtrip(
            "roundtrip_job:build",
            save="roundtrip_job:save_without_rng",
            load="roundtrip_job:load_saved",
            pythonpath=[JOBS],
        )
    message = str(failure.value)
    assert message.startswith("assert_state_roundtrip: component 'rng' does not survive")
    assert "  rng.torch: " in message
    assert "components that survive: model, optimizer, scheduler, scaler, data" in message
    # dropout draws different masks, so the loss of the next step differs
    assert "  next.output: 1 of 1 elements differ" in message
    assert "fix: save trainguard.unit.seeding.rng_state()" in message


def test_arguments_are_checked_before_any_process_starts() -> None:
    with pytest.raises(UsageError, match="'module:function' string for build"):
        assert_state_roundtrip("roundtrip_job.build")
    with pytest.raises(UsageError, match="an int >= 1 for steps"):
        assert_state_roundtrip("roundtrip_job:build", steps=0)
