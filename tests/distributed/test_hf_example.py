"""examples/hf_clm, a Hugging Face Trainer job, under trainguard: clean, and with planted defects.

The job file uses only what a Trainer script offers (its own flags, ``{latest_checkpoint}`` for
``--resume_from_checkpoint``, the loss recorded by the start-up hook), so these tests check that
trainguard needs no edit of a Trainer script. The Trainer's resume is exact (it saves every
rank's RNG state and skips the batches the epoch already trained on): any failure of the clean job
is a false alarm. Each planted defect (examples/hf_clm/tinyclm/plants.py, or the real
``--ignore_data_skip`` option) must fail its check with its cause named first.

Every run starts Python, torch and transformers (~5-10 s on 2 CPU cores), and a resume check takes
three runs, so the default run has the determinism and resume of the clean job and one planted
defect (RNG state not saved); the other defects, the parallel check and the shipped job file's
full check list are ``slow``.
"""

from __future__ import annotations

import shutil
from importlib.util import find_spec
from pathlib import Path

import pytest

from tests.helpers import only_check, report_evidence
from trainguard.session import check

# find_spec, not importorskip: importing the framework here would cost seconds of collection
pytestmark = [
    pytest.mark.timeout(600),
    pytest.mark.skipif(
        any(find_spec(name) is None for name in ("transformers", "accelerate", "tokenizers")),
        reason="examples/hf_clm needs the [hf] extra",
    ),
]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "hf_clm"

# Few steps: an epoch is 37 steps, checkpoints every 5, so a kill after step 7 resumes mid-epoch
# from checkpoint-5 (or checkpoint-10 when the kill lands late on a loaded machine).
JOB_FILE = """\
job:
  name: hf-clm-test
  command: >-
    python train.py --output_dir {{checkpoint_dir}} --max_steps {{steps}} --seed {{seed}}
    --save_steps 5 --logging_steps 5{args}
  resume_args: "--resume_from_checkpoint {{latest_checkpoint}}{resume_args}"
  env: {{OMP_NUM_THREADS: "1", HF_HUB_OFFLINE: "1", TOKENIZERS_PARALLELISM: "false"}}
  metrics:
    loss: {{trainer: huggingface}}
  timeout: 150
  stall_timeout: 60
checks:
{checks}
"""

RESUME = "  resume: {steps: 12, after_step: 7}\n"


def example_copy(tmp_path: Path, checks: str, args: str = "", resume_args: str = "") -> Path:
    """A private copy of the example with a job file of the test's own (the shipped files stay
    as they are)."""
    root = Path(shutil.copytree(EXAMPLE, tmp_path / "hf_clm",
                                ignore=shutil.ignore_patterns(".trainguard", "__pycache__")))
    (root / "trainguard.yaml").write_text(
        JOB_FILE.format(args=args, resume_args=resume_args, checks=checks)
    )
    return root


@pytest.mark.resume
@pytest.mark.determinism
def test_clean_trainer_job_is_deterministic_and_resumes_exactly(tmp_path: Path) -> None:
    # 13 steps after the kill: a Trainer step takes ~60 ms here, and the loss read from the hook's
    # file lags on a loaded machine (5 steps left, the kill once came after the last one)
    root = example_copy(tmp_path, "  determinism: {steps: 12}\n  resume: {steps: 20, after_step: 7}\n")
    report = check(root, report_json=str(tmp_path / "report.json"))
    by_name = {c.name: c for c in report.checks}
    assert report.status == "passed", [(c.name, c.summary) for c in report.checks]
    resume = report_evidence(by_name["resume"])
    # {latest_checkpoint} named the newest checkpoint-N the killed run completed
    assert resume["resumed_from_step"] in (5, 10, 15), resume
    assert resume["trajectory"]["max_abs_diff"] == 0.0
    # the final checkpoint directories (model.safetensors, optimizer.pt, scheduler.pt,
    # rng_state.pth, trainer_state.json) were compared, not given up on
    assert resume["state"]["compared"] is True and resume["state"]["differing_keys"] == []


# plant -> (extra args of every run, extra resume_args, what the first likely cause must name)
RESUME_DEFECTS = {
    "rng_not_saved": (" --plant rng_not_saved", "", "rng"),
    # a real TrainingArguments option: the resumed epoch starts again from its first batch
    "ignore_data_skip": ("", " --ignore_data_skip true", "data position"),
    "optimizer_not_restored": (" --plant optimizer_not_restored", "", "optimizer"),
    "scheduler_not_restored": (" --plant scheduler_not_restored", "", "scheduler"),
    "checkpoint_only_at_exit": (" --plant checkpoint_only_at_exit", "", "no checkpoint"),
}


@pytest.mark.resume
@pytest.mark.parametrize("defect", [
    # one defect in the default run (the cheapest, ~25 s); the rest are slow
    pytest.param(d, marks=() if d == "rng_not_saved" else pytest.mark.slow) for d in sorted(RESUME_DEFECTS)
])
def test_resume_check_names_the_planted_defect_first(tmp_path: Path, defect: str) -> None:
    args, resume_args, cause = RESUME_DEFECTS[defect]
    root = example_copy(tmp_path, RESUME, args=args, resume_args=resume_args)
    result = only_check(root, "resume")
    assert result.status == "failed", result.summary
    causes = report_evidence(result)["likely_causes"]
    assert cause in str(causes[0]).lower(), causes
    if defect == "ignore_data_skip":
        # the Trainer re-read the epoch from its start: the resumed steps trained on the samples
        # of steps 1, 2, ... again, and the report says so
        assert "samples of step 1" in result.summary + str(causes[0]), result.summary


#: the disk fills up after step 22: a checkpoint written in place is torn
DISK_FULL = (
    "  drills:\n"
    "    - {name: disk-full, fault: disk_full, rank: 0, world_size: 1, steps: 60,"
    " after_step: 22, expect: fail_clean, deadline: 30}\n"
)


@pytest.mark.slow
def test_disk_full_tears_a_checkpoint_written_in_place(tmp_path: Path) -> None:
    root = example_copy(tmp_path, DISK_FULL, args=" --plant checkpoint_in_place")
    result = only_check(root, "drill:disk-full")
    assert result.status == "failed", result.summary
    # the save that hit the full disk had already truncated checkpoint-last/config.json
    assert "the checkpoint is not usable" in result.summary, result.summary
    assert "in place" in str(report_evidence(result)["likely_causes"][0]), report_evidence(result)["likely_causes"]


@pytest.mark.slow
def test_the_shipped_job_file_passes_every_check_and_drill(tmp_path: Path) -> None:
    """examples/hf_clm/trainguard.yaml as shipped: smoke, canary, determinism, resume, parallel
    (2 ranks over gloo, split_batches) and the kill_rank and disk_full drills."""
    root = Path(shutil.copytree(EXAMPLE, tmp_path / "hf_clm",
                                ignore=shutil.ignore_patterns(".trainguard", "__pycache__")))
    report = check(root, report_json=str(tmp_path / "report.json"))
    assert [c.name for c in report.checks] == [
        "smoke", "canary", "determinism", "resume", "parallel", "drill:kill-rank1", "drill:disk-full"
    ]
    assert report.status == "passed", [(c.name, c.summary) for c in report.checks]
