"""checks.reshard without launching anything: its config and the comparison of samples and causes.

The check itself, on real jobs at two world sizes, is in tests/distributed/test_reshard.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from trainguard.checks.accounting import global_batches, sample_agreement
from trainguard.checks.diagnosis import DECISIVE, RULED_OUT
from trainguard.checks.reshard import PairFacts, rank_reshard_causes
from trainguard.config import ReshardCheck, parse_config
from trainguard.config.settings import Settings
from trainguard.errors import ConfigError
from trainguard.launch.samples import SampleBatch
from trainguard.session.plan import make_plan
from trainguard.unit.checkpoints import CheckpointInventory

JOB: dict[str, Any] = {
    "name": "m",
    "command": "python t.py --steps {steps} --ckpt-dir {checkpoint_dir}",
    "resume_args": "--resume",
    "metrics": {"loss": r"step (?P<step>\d+) loss (?P<value>\S+)"},
}


def _doc(reshard: Any, **job: Any) -> str:
    body = {k: v for k, v in {**JOB, **job}.items() if v is not None}
    return yaml.safe_dump({"job": body, "checks": {"reshard": reshard}})


def test_bare_reshard_means_the_defaults() -> None:
    spec = parse_config(_doc(None)).checks.reshard
    assert spec == ReshardCheck.model_validate({})
    assert (spec.steps, spec.after_step, spec.world_size_pairs) == (20, 10, [(2, 1), (1, 2)])
    assert (spec.rtol, spec.atol) == (1e-4, 1e-5)  # the parallel check's: world sizes differ by rounding


@pytest.mark.parametrize(("reshard", "job", "needles"), [
    ({"pairs": [[2, 2]]}, {}, ["checks.reshard", "pairs[0] resumes at the world size it checkpointed at",
                              "that is checks.resume", "`[2, 1]`"]),
    ({"pairs": [[0, 1]]}, {}, ["pairs[0] must be [N, M]", "each 1..1024", "got [0, 1]"]),
    ({"pairs": [[2, 2000]]}, {}, ["each 1..1024", "got [2, 2000]"]),
    ({"pairs": [[2, 1, 4]]}, {}, ["pairs[0] must be [N, M]"]),
    ({"pairs": [[2, "1"]]}, {}, ["pairs[0] must be [N, M]"]),
    ({"pairs": [[2, 1], [2, 1]]}, {}, ["pairs[1] [2, 1] is listed twice"]),
    ({"pairs": []}, {}, ["checks.reshard.pairs"]),
    ({"steps": 6, "after_step": 6}, {}, ["after_step (6) must be smaller than steps (6)"]),
    (None, {"resume_args": None}, ["job.resume_args", "checks.reshard resumes the job at another world size",
                                   "Fix: set job.resume_args"]),
    (None, {"command": "python t.py --steps {steps}"}, ["job.command", "Fix: pass {checkpoint_dir}"]),
    (None, {"distributed_env": False}, ["checks.reshard.pairs", "runs as one process", "asks for 2 ranks"]),
    ({"pairs": [[2, 3], [4, 1]]}, {"batch_size": 64, "command": "python t.py --steps {steps} --ckpt-dir "
                                   "{checkpoint_dir} --batch-size {batch_size}"},
     ["checks.reshard.pairs", "(job.batch_size 64)", "but 3 rank(s) cannot split it evenly",
      "a multiple of 12"]),
], ids=["equal-pair", "zero-size", "too-large", "three-sizes", "string-size", "duplicate", "empty",
        "after-step-at-end", "no-resume-args", "no-checkpoint-dir", "one-process-job", "uneven-batch"])
def test_bad_reshard_config_names_the_key_and_the_fix(reshard: Any, job: dict[str, Any], needles: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(_doc(reshard, **job))
    for needle in needles:
        assert needle in str(info.value)


def test_a_batch_every_world_size_splits_is_accepted() -> None:
    command = "python t.py --steps {steps} --ckpt-dir {checkpoint_dir} --batch-size {batch_size}"
    spec = parse_config(_doc({"pairs": [[4, 2], [2, 1]]}, batch_size=64, command=command)).checks.reshard
    assert spec is not None and spec.world_size_pairs == [(4, 2), (2, 1)]


def test_validate_plans_two_runs_per_pair(tmp_path: Any) -> None:
    # the N-rank uninterrupted run, and the M-rank run resumed from the checkpoint kept from it
    # after after_step (issue 29: no killed run)
    path = tmp_path / "trainguard.yaml"
    path.write_text(_doc({"steps": 8, "after_step": 4, "pairs": [[2, 1], [1, 3]]}))
    (tmp_path / "t.py").write_text("")
    plan = make_plan(path, Settings())
    (check,) = plan.checks
    assert check.name == "reshard"
    assert [r.world_size for r in check.runs] == [2, 1, 1, 3]
    assert "kept after step 4 of the 2-rank run" in check.runs[1].label
    assert plan.launches == 4


def _batches(*per_step: list[int], dataset: str = "TensorDataset(64)") -> list[SampleBatch]:
    return [SampleBatch(0, dataset, 0, i, list(ix)) for i, ix in enumerate(per_step)]


def test_global_batches_join_the_ranks_and_skip_other_datasets() -> None:
    two_ranks = {0: _batches([1, 2], [5, 6]), 1: _batches([3, 4], [7, 8])}
    two_ranks[0].insert(1, SampleBatch(1, "Val(8)", 0, 0, [0, 1]))  # an eval loader in between
    assert global_batches(two_ranks, first_step=1, steps=2) == {1: (1, 2, 3, 4), 2: (5, 6, 7, 8)}
    one_rank = {0: _batches([7, 8, 5, 6])}
    assert global_batches(one_rank, first_step=2, steps=2) == {2: (5, 6, 7, 8)}
    assert global_batches({}, first_step=1, steps=2) == {}


def test_sample_agreement_says_same_shifted_or_other() -> None:
    reference = {1: (1, 2), 2: (3, 4), 3: (5, 6)}
    same = sample_agreement(reference, {2: (3, 4), 3: (5, 6)})
    assert same is not None and same.same and "drew the same samples" in same.sentence(2, 1)
    shifted = sample_agreement(reference, {2: (1, 2), 3: (3, 4)})
    assert shifted is not None and (shifted.first_different_step, shifted.matched_step) == (2, 1)
    assert "the samples of the reference's step 1" in shifted.sentence(2, 1)
    other = sample_agreement(reference, {2: (1, 3), 3: (5, 6)})
    assert other is not None and other.matched_step is None
    assert "data order depends on the world size" in other.sentence(2, 1)
    smaller = sample_agreement(reference, {2: (3,)})
    assert smaller is not None and "the global batch changed" in smaller.sentence(1, 2)


def test_causes_rank_the_evidence() -> None:
    shifted = sample_agreement({1: (1, 2), 2: (3, 4)}, {2: (1, 2)})
    causes = rank_reshard_causes(PairFacts(1, 2, shifted, None))
    assert causes[0].key == "sampler_offset" and causes[0].strength == DECISIVE
    shard = CheckpointInventory(path=Path("x"), counts={"model": (4, 0), "optimizer": (4, 2)})
    same = sample_agreement({1: (1, 2), 2: (3, 4)}, {2: (3, 4)})
    causes = rank_reshard_causes(PairFacts(1, 3, same, shard, ["optimizer"]))
    assert causes[0].key == "optimizer_shard" and causes[0].strength == DECISIVE
    assert "2 of its 4 model tensors" in causes[0].phrase()
    ruled = {c.key for c in causes if c.strength == RULED_OUT}
    assert ruled == {"sampler_offset", "data_order", "batch"}  # the same samples: not the data


def test_the_jobs_own_rng_warning_outranks_a_boundary_divergence() -> None:
    full = CheckpointInventory(path=Path("x"), counts={"model": (4, 0), "optimizer": (8, 4)})
    same = sample_agreement({1: (1, 2), 2: (3, 4)}, {2: (3, 4)})
    causes = rank_reshard_causes(PairFacts(1, 2, same, full, ["model", "optimizer"], rng_warning=True))
    assert [c.key for c in causes[:2]] == ["rng", "optimizer_shard"]
    assert "for all 4 parameters" in causes[1].phrase()


def test_the_gate_can_require_reshard_but_does_not_by_default() -> None:
    from trainguard.config import GatePolicy
    from trainguard.gate.policy import Capabilities, decide
    from trainguard.report import CheckResult, Report

    assert "reshard" not in GatePolicy.model_validate({}).require
    policy = GatePolicy.model_validate({"require": ["smoke", "reshard"]})
    failing = CheckResult("reshard", "failed", "2->1: loss diverges at step 6")
    decision = decide(Report(job="toy", checks=[CheckResult("smoke", "passed", "ok"), failing]), policy,
                      Capabilities(gpus=0, root=True, ray=True))
    assert decision.verdict == "block" and decision.reasons == ["reshard failed: 2->1: loss diverges at step 6"]
