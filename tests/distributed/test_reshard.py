"""checks.reshard on real jobs: checkpoint at N ranks, resume at M, compare with N uninterrupted.

The shipped digits example must pass 2 -> 1 and 1 -> 2 (slow) with the parallel check's args
(dropout off). tests/data/jobs/reshard_train.py plants the defects that show only at another world size:
a per-rank data offset saved as a global one, and a ZeroRedundancyOptimizer job whose rank 0
saves only its own shard of the optimizer state. Its clean form (ZeRO with the shards gathered)
passes both ways (slow).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from tests.helpers import report_evidence
from trainguard.session import check

if TYPE_CHECKING:
    from conftest import PatchedExample

JOBS = Path(__file__).resolve().parents[1] / "data" / "jobs"

# The epoch is 23 steps and train.py checkpoints every 5: a kill after step 7 resumes from the
# checkpoint of step 5, mid-epoch, so the data position must be carried across world sizes.
DIGITS = """\
job:
  name: digits-reshard
  command: "python train.py --steps {steps} --ckpt-dir {checkpoint_dir} --seed {seed}"
  resume_args: "--resume"
  env: {OMP_NUM_THREADS: "1"}
  metrics:
    loss: 'step (?P<step>\\d+) loss (?P<value>\\S+)'
  timeout: 120
  stall_timeout: 60
checks:
  reshard: {steps: 12, after_step: 7, pairs: PAIRS, args: "ARGS"}
"""


def toy_job(tmp_path: Path, args: str, pairs: str) -> Path:
    """A job file for reshard_train.py: 16 steps (8 per epoch), a checkpoint every 2 steps."""
    path = tmp_path / "trainguard.yaml"
    path.write_text(f"""\
job:
  name: reshard-toy
  command: "python reshard_train.py --steps {{steps}} --seed {{seed}} --ckpt-dir {{checkpoint_dir}} --sleep 0.05 {args}"
  resume_args: "--resume"
  cwd: {JOBS}
  env: {{OMP_NUM_THREADS: "1"}}
  metrics:
    loss: 'step (?P<step>\\d+) loss (?P<value>\\S+)'
  timeout: 60
  stall_timeout: 30
checks:
  reshard: {{steps: 16, after_step: 5, pairs: {pairs}}}
""")
    return path


def _run(path: Path, tmp_path: Path) -> tuple[Any, dict[str, Any]]:
    report = check(path, report_json=str(tmp_path / "report.json"))
    (result,) = report.checks
    return result, report_evidence(result)["pairs"]


# the default run resumes 2 -> 1 (the planted defects below cover both directions on the toy
# job); 1 -> 2 of the example is slow
@pytest.mark.parametrize("name", ["2->1", pytest.param("1->2", marks=pytest.mark.slow)])
def test_digits_example_resumes_at_another_world_size(
    tmp_path: Path, patched_example: PatchedExample, name: str
) -> None:
    n, m = name.split("->")
    root = patched_example({}, DIGITS.replace("PAIRS", f"[[{n}, {m}]]").replace("ARGS", "--dropout 0"))
    result, pairs = _run(root, tmp_path)
    assert result.status == "passed", result.summary
    assert list(pairs) == [name]
    for pair in pairs.values():
        assert pair["resumed_from_step"] in (5, 10), pair  # a loaded machine may let a step through
        assert pair["trajectory"]["first_divergent_step"] is None
        assert pair["trajectory"]["max_abs_diff"] < 1e-5  # float rounding of 1 vs 2 ranks, no more
        assert "drew the same samples per step" in pair["samples"]
        # the final checkpoints were compared key by key: model, optimizer, scheduler equal; the
        # per-rank RNG states and the recorded world size differ, as they must
        assert pair["state"]["compared"] is True
        assert not {"model", "optimizer", "scheduler"} & set(pair["state"]["by_component"])


def test_per_rank_data_offset_saved_as_a_global_one_fails(tmp_path: Path) -> None:
    result, pairs = _run(toy_job(tmp_path, "--defect offset", "[[1, 2]]"), tmp_path)
    assert result.status == "failed", result.summary
    pair = pairs["1->2"]
    resumed = pair["resumed_from_step"]
    assert pair["trajectory"]["first_divergent_step"] == resumed + 1
    # 2 ranks read the 1-rank count as their own: each skips ahead to twice the position
    assert f"drew the samples of the reference's step {2 * resumed + 1}" in result.summary
    assert report_evidence(result)["likely_causes"][0].startswith("a sampler offset counted per rank")


def test_zero_optimizer_saving_only_rank0_shard_fails(tmp_path: Path) -> None:
    result, pairs = _run(toy_job(tmp_path, "--zero --defect zero-shard", "[[2, 1]]"), tmp_path)
    assert result.status == "failed", result.summary
    pair = pairs["2->1"]
    assert "drew the same samples per step" in pair["samples"]  # not the data
    assert pair["trajectory"]["first_divergent_step"] is not None
    assert "optimizer" in pair["state"]["by_component"]
    assert report_evidence(result)["likely_causes"][0].startswith("optimizer state sharded")
    assert "optimizer state for 1 of its 4 model tensors" in result.summary or \
        "optimizer state for 2 of its 4 model tensors" in result.summary


@pytest.mark.slow
def test_zero_job_with_its_shards_gathered_passes_both_ways(tmp_path: Path) -> None:
    result, pairs = _run(toy_job(tmp_path, "--zero", "[[2, 1], [1, 2]]"), tmp_path)
    assert result.status == "passed", result.summary
    assert all("drew the same samples per step" in p["samples"] for p in pairs.values())


@pytest.mark.slow
def test_per_rank_offset_fails_two_to_one_too(tmp_path: Path) -> None:
    result, pairs = _run(toy_job(tmp_path, "--defect offset", "[[2, 1]]"), tmp_path)
    assert result.status == "failed", result.summary
    resumed = pairs["2->1"]["resumed_from_step"]
    assert f"drew the samples of the reference's step {resumed // 2 + 1}" in result.summary


@pytest.mark.slow
def test_digits_with_dropout_fails_and_names_the_rng(tmp_path: Path, patched_example: PatchedExample) -> None:
    # dropout masks are drawn per rank and the RNG states of 2 ranks cannot be restored on 1:
    # the check must fail here (why the example's check passes "--dropout 0", as parallel does)
    root = patched_example({}, DIGITS.replace("PAIRS", "[[2, 1]]").replace(' args: "ARGS"', ""))
    result, _ = _run(root, tmp_path)
    assert result.status == "failed", result.summary
    assert report_evidence(result)["likely_causes"][0].startswith("RNG states saved per rank")
    assert "Most likely RNG states saved per rank cannot be restored at another world size:" in result.summary
