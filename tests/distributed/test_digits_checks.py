"""The equivalence checks on the shipped example, clean and with realistic planted bugs.

Each planted bug is a textual patch of a private copy of examples/digits (the shipped script
itself stays unmodified): the patch must apply exactly once, so a change to the example that
moves the patched line makes these tests fail loudly instead of silently testing nothing.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.helpers import report_evidence
from trainguard.session import check

if TYPE_CHECKING:
    from conftest import PatchedExample


# Few steps keep the runs short; the epoch is 23 steps, so a kill after step 7 resumes mid-epoch
# from the checkpoint of step 5 (ckpt every 5): lost progress and data position both matter.
# Resume runs 20 steps: trainguard reads the job's output with a lag that a loaded machine
# stretches, and the kill must still land well before the last step (steps take ~20 ms).
JOB_FILE = """\
job:
  name: digits-planted
  command: "python train.py --steps {steps} --ckpt-dir {checkpoint_dir} --seed {seed}"
  resume_args: "--resume"
  env: {OMP_NUM_THREADS: "1"}
  metrics:
    loss: 'step (?P<step>\\d+) loss (?P<value>\\S+)'
  timeout: 120
  stall_timeout: 60
checks:
  determinism: {steps: 6}
  resume: {steps: 20, after_step: 7}
  parallel: {steps: 6, world_size: 2, args: "--dropout 0"}
"""




@pytest.mark.resume
@pytest.mark.parallel
@pytest.mark.determinism
def test_clean_example_passes_determinism_resume_and_parallel(
    tmp_path: Path, patched_example: PatchedExample
) -> None:
    root = patched_example({}, JOB_FILE)
    report = check(root, report_json=str(tmp_path / "report.json"))
    by_name = {c.name: c for c in report.checks}
    assert report.status == "passed", [(c.name, c.summary) for c in report.checks]
    resume = report_evidence(by_name["resume"])
    # killed after step 7 or later (a loaded machine lets steps through before the kill lands):
    # resumed from the last checkpoint (every 5 steps, written before the step is printed, so
    # the kill may land between the save of step N and its line: resumed from N, killed after N-1)
    killed, resumed_from = resume["killed_after_step"], resume["resumed_from_step"]
    assert 7 <= killed < 20, resume
    assert resumed_from % 5 == 0 and killed - 4 <= resumed_from <= killed + 1, resume
    assert resume["steps_lost"] == max(0, killed - resumed_from), resume
    # printed losses are rounded: the state comparison must have run, key by key
    assert resume["state"]["compared"] is True and resume["state"]["differing_keys"] == []
    assert report_evidence(by_name["parallel"])["trajectory"]["max_abs_diff"] < 1e-5


RESUME_BUGS = {
    "optimizer_state_not_restored": (
        {"train.py": ('optimizer.load_state_dict(state["optimizer"])', "pass  # planted")},
        ["final checkpoints differ in", "optimizer (", "Most likely optimizer state"],
        "optimizer",
    ),
    "scheduler_not_restored": (
        {"train.py": ('scheduler.load_state_dict(state["scheduler"])', "pass  # planted")},
        ["scheduler (", "Most likely LR scheduler state"],
        "scheduler",
    ),
    "rng_not_restored": (
        {"train.py": ("    if rng_to_restore is not None:\n", "    if False:  # planted\n")},
        ["diverges", "Most likely RNG states"],
        "rng",
    ),
    "data_position_reset_on_resume": (
        {"train.py": (
            "sampler.set_start_index(batch_in_epoch * local_batch)",
            "sampler.set_start_index(0)  # planted",
        )},
        ["diverges", "Most likely data position", "the samples of step 1"],
        "data_position",
    ),
    "checkpoint_only_at_exit": (
        {"train.py": (
            "(step % args.ckpt_every == 0 or step == args.steps)",
            "(step == args.steps)",
        )},
        ["started again from step 1", "all {killed} steps of progress lost", "Most likely no checkpoint written"],
        "no_checkpoint",
    ),
}


@pytest.mark.resume
@pytest.mark.parametrize("bug", sorted(RESUME_BUGS))
def test_resume_check_catches_planted_bug(
    tmp_path: Path, patched_example: PatchedExample, bug: str
) -> None:
    patches, expected, cause = RESUME_BUGS[bug]
    root = patched_example(patches, JOB_FILE)
    report = check(root, only=["resume"], report_json=str(tmp_path / "report.json"))
    result = report.checks[0]
    assert result.status == "failed", result.summary
    # the step the kill landed after is the report's own (a loaded machine lands it a step or two
    # past after_step); the summary must count the progress lost from that step
    killed = report_evidence(result)["killed_after_step"]
    assert killed >= report_evidence(result)["after_step"], report_evidence(result)
    for text in expected:
        assert text.format(killed=killed) in result.summary, result.summary
    assert result.reproduce and "--resume" in result.reproduce
    # the cause the evidence shows is named first, with that evidence
    first = report_evidence(result)["diagnosis"][0]
    assert first["key"] == cause and first["evidence"], report_evidence(result)["diagnosis"]


#: every rank's sampler told it is the only one: each trains on the whole data set
SAME_SHARD = {"train.py": (
    "train_set, num_replicas=world_size, rank=rank, shuffle=True",
    "train_set, num_replicas=1, rank=0, shuffle=True  # planted",
)}


@pytest.mark.parallel
def test_parallel_check_catches_ranks_reading_the_same_shard(
    tmp_path: Path, patched_example: PatchedExample
) -> None:
    root = patched_example(SAME_SHARD, JOB_FILE)
    report = check(root, only=["parallel"], report_json=str(tmp_path / "report.json"))
    result = report.checks[0]
    assert result.status == "failed", result.summary
    assert "2 ranks diverge from 1 rank at step 1" in result.summary
    assert "same shard" in report_evidence(result)["likely_causes"][0]
    assert "trained on the same first batch" in report_evidence(result)["samples"]
    # the step records, compared as whole runs: at step 1 the weights agree and the gradients of
    # the 2 ranks (each on the same half of the 1-rank batch) are another sum of squares
    divergence = report_evidence(result)["first_divergence"]
    assert (divergence["step"], divergence["kind"]) == (1, "gradient"), divergence
    assert divergence["steps"][0]["kind"] == "gradient" and "default" in divergence["compared_by"]


@pytest.mark.determinism
def test_determinism_names_an_unseeded_data_order_with_the_samples(
    tmp_path: Path, patched_example: PatchedExample
) -> None:
    root = patched_example(
        {"train.py": (
            "shuffle=True, seed=args.seed, drop_last=True",
            "shuffle=True, seed=int.from_bytes(os.urandom(4), 'little'), drop_last=True  # planted",
        )},
        JOB_FILE,
    )
    report = check(root, only=["determinism"], report_json=str(tmp_path / "report.json"))
    result = report.checks[0]
    assert result.status == "failed", result.summary
    assert "Most likely the data order: the two runs drew different samples from batch 1 on" in result.summary
    assert report_evidence(result)["likely_causes"][0].startswith("data order from an unordered source")
