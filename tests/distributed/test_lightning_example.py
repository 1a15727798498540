"""examples/lightning, a Lightning Trainer job, under trainguard: the usual script, its fix, and
planted defects.

The usual script (a shuffled DataLoader, ModelCheckpoint with last.ckpt, fit(ckpt_path="last"))
does not resume exactly: Lightning restores model, optimizer, scheduler and loop counters, but
neither the RNG nor a plain DataLoader's position, so a run resumed mid-epoch draws the epoch's
order again from the start. trainguard must fail its resume check and say why: the resumed steps
trained on the samples of the epoch's first steps. With ``--resumable-data`` (a checkpointed
sampler position and every rank's RNG state) the resume is exact and must pass; each planted
defect (examples/lightning/litdigits/plants.py) then breaks it alone and must be named first.

A run costs ~5-10 s of start-up on 2 CPU cores (importing Lightning imports torchmetrics and,
through it, transformers), a resume check three runs: the default run has the one test of the
usual script's failing resume; the fixed job, the defects and the shipped job files' full check
lists are ``slow``.
"""

from __future__ import annotations

import shutil
from importlib.util import find_spec
from pathlib import Path

import pytest

from tests.helpers import only_check, report_evidence
from trainguard.launch.samples import read_samples
from trainguard.session import check

# find_spec, not importorskip: importing the framework here would cost seconds of collection
pytestmark = [
    pytest.mark.timeout(600),
    pytest.mark.skipif(
        any(find_spec(name) is None for name in ("lightning", "sklearn")),
        reason="examples/lightning needs the [lightning] extra",
    ),
]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "lightning"

# An epoch is 23 steps of 64 samples, checkpoints every 5: a kill after step 7 resumes mid-epoch
# from step 5, or from a later checkpoint when the kill lands late (a step takes ~2 ms here).
JOB_FILE = """\
job:
  name: lightning-test
  command: "python train.py --steps {{steps}} --ckpt-dir {{checkpoint_dir}} --seed {{seed}}{args}"
  resume_args: "--resume"
  env: {{OMP_NUM_THREADS: "1"}}
  metrics:
    loss: {{trainer: lightning}}
  timeout: 150
  stall_timeout: 60
checks:
{checks}
"""

RESUME = "  resume: {steps: 30, after_step: 7}\n"


def example_copy(tmp_path: Path, checks: str, args: str = "") -> Path:
    """A private copy of the example with a job file of the test's own."""
    root = Path(shutil.copytree(EXAMPLE, tmp_path / "lightning",
                                ignore=shutil.ignore_patterns(".trainguard", "__pycache__")))
    (root / "trainguard.yaml").write_text(JOB_FILE.format(args=args, checks=checks))
    return root


@pytest.mark.resume
def test_usual_lightning_script_fails_resume_on_data_order_and_rng(tmp_path: Path) -> None:
    result = only_check(example_copy(tmp_path, RESUME), "resume")
    assert result.status == "failed", result.summary
    evidence = report_evidence(result)
    resumed_from = evidence["resumed_from_step"]
    # state missing at the boundary: the very first resumed step already differs
    assert evidence["trajectory"]["first_divergent_step"] == resumed_from + 1, evidence["trajectory"]
    # the reason, from the runs themselves: the resumed run's first batch is the uninterrupted
    # run's first batch of epoch 0 (step 1), not that of step resumed_from + 1
    runs = evidence["run_dirs"]
    reference = [b for b in read_samples(Path(runs["reference"]))[0] if b.loader == 0]
    resumed = [b for b in read_samples(Path(runs["resumed"]))[0] if b.loader == 0]
    assert resumed[0].indices == reference[0].indices
    assert resumed[0].indices != reference[resumed_from].indices
    # Lightning said so on stderr
    stderr = (Path(runs["resumed"]) / "rank0.stderr.log").read_text()
    assert "your dataloader is not resumable" in stderr.replace("\n", " ")
    # and the report names data order / RNG first, not the optimizer
    first = str(evidence["likely_causes"][0]).lower()
    assert "data position" in first or "rng" in first, evidence["likely_causes"]


@pytest.mark.slow
@pytest.mark.resume
@pytest.mark.determinism
def test_resumable_data_makes_the_resume_exact(tmp_path: Path) -> None:
    root = example_copy(tmp_path, "  determinism: {steps: 30}\n" + RESUME, args=" --resumable-data")
    report = check(root, report_json=str(tmp_path / "report.json"))
    assert report.status == "passed", [(c.name, c.summary) for c in report.checks]
    resume = {c.name: c for c in report.checks}["resume"].evidence
    assert resume["trajectory"]["max_abs_diff"] == 0.0
    # last.ckpt of both runs compared: model, optimizer, scheduler, loops, the loader's position
    # and every rank's RNG state; dirpath / last_model_path differ only as paths
    assert resume["state"]["compared"] is True and resume["state"]["differing_keys"] == []


# plant -> what the first likely cause must name
RESUME_DEFECTS = {
    "rng_not_saved": "rng",
    "data_position_not_saved": "data position",
    "optimizer_not_restored": "optimizer",
    "scheduler_not_restored": "scheduler",
    "checkpoint_only_at_exit": "no checkpoint",
}


@pytest.mark.slow
@pytest.mark.resume
@pytest.mark.parametrize("defect", sorted(RESUME_DEFECTS))
def test_resume_check_names_the_planted_defect_first(tmp_path: Path, defect: str) -> None:
    root = example_copy(tmp_path, RESUME, args=f" --resumable-data --plant {defect}")
    result = only_check(root, "resume")
    assert result.status == "failed", result.summary
    causes = report_evidence(result)["likely_causes"]
    assert RESUME_DEFECTS[defect] in str(causes[0]).lower(), causes
    if defect == "data_position_not_saved":
        assert "samples of step 1" in result.summary + str(causes[0]), result.summary


#: the disk fills up after step 22: a checkpoint written in place is torn
DISK_FULL = (
    "  drills:\n"
    "    - {name: disk-full, fault: disk_full, rank: 0, world_size: 1, steps: 60,"
    " after_step: 22, expect: fail_clean, deadline: 30}\n"
)


@pytest.mark.slow
def test_disk_full_tears_a_checkpoint_written_in_place(tmp_path: Path) -> None:
    root = example_copy(tmp_path, DISK_FULL, args=" --resumable-data --plant checkpoint_in_place")
    result = only_check(root, "drill:disk-full")
    assert result.status == "failed", result.summary
    assert "the checkpoint is not usable" in result.summary, result.summary
    assert "in place" in str(report_evidence(result)["likely_causes"][0]), report_evidence(result)["likely_causes"]


@pytest.mark.slow
def test_the_shipped_job_files(tmp_path: Path) -> None:
    """trainguard.yaml (the usual script): everything passes but resume, which fails as its
    comments say; resumable.trainguard.yaml: every check and drill passes (parallel on 2 ranks
    over gloo, kill_rank on 2 ranks, disk_full)."""
    root = Path(shutil.copytree(EXAMPLE, tmp_path / "lightning",
                                ignore=shutil.ignore_patterns(".trainguard", "__pycache__")))
    usual = check(root / "trainguard.yaml", report_json=str(tmp_path / "usual.json"))
    statuses = {c.name: c.status for c in usual.checks}
    assert statuses == {"smoke": "passed", "canary": "passed", "determinism": "passed",
                        "resume": "failed"}, [(c.name, c.summary) for c in usual.checks]
    fixed = check(root / "resumable.trainguard.yaml", report_json=str(tmp_path / "fixed.json"))
    assert [c.name for c in fixed.checks] == [
        "determinism", "resume", "parallel", "drill:kill-rank1", "drill:disk-full"
    ]
    assert fixed.status == "passed", [(c.name, c.summary) for c in fixed.checks]
