"""tests/data/jobs/sched_train.py under the resume and determinism checks: a plain DDP loop whose
LambdaLR changes the lr every step. Clean, it resumes exactly; each planted defect (``--plant``)
must fail the resume with its cause named first, from what the checks observe in the job (the lr
is not printed: no ``--print-lr``).

``scheduler_not_saved`` is issue 44's case: the checkpoint holds model, optimizer, RNG and data
position, not the scheduler. The first resumed step matches (the optimizer restored its lr) and
the second differs; the final checkpoints hold no scheduler to differ in.

Each run starts torch (~3 s on 2 cores); the clean job's determinism and resume share their
uninterrupted run. The default run has the clean job and ``scheduler_not_saved`` (~20 s together
on a quiet machine); ``rng_not_restored`` is ``slow``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import report_evidence
from trainguard.report import CheckResult
from trainguard.session import check

JOBS = Path(__file__).resolve().parents[1] / "data" / "jobs"

#: the checks of sched.trainguard.yaml (its own job file), at 2 ranks, with the plant's args
JOB_FILE = (JOBS / "sched.trainguard.yaml").read_text()


def job_file(tmp_path: Path, args: str = "", checks: str | None = None) -> Path:
    """sched.trainguard.yaml with ``cwd`` the jobs folder, ``args`` added to every run."""
    text = JOB_FILE.replace("  resume_args:", f"  cwd: {JOBS}\n  resume_args:")
    if args:
        text = text.replace("--ckpt-dir {checkpoint_dir}", "--ckpt-dir {checkpoint_dir} " + args)
    if checks is not None:
        text = text.split("checks:\n")[0] + "checks:\n" + checks
    path = tmp_path / "trainguard.yaml"
    path.write_text(text)
    return path


#: plant -> the cause the resume check must name first (issue 44's "Done when")
PLANTS = {
    "scheduler_not_saved": "scheduler",
    "rng_not_restored": "rng",
}

#: the plants today's diagnosis gets wrong, expected to flip when issue 44's step records land
def resume_of(path: Path, tmp_path: Path) -> CheckResult:
    report = check(path, only=["resume"], report_json=str(tmp_path / "report.json"))
    (result,) = report.checks
    return result


@pytest.mark.slow  # the default run's clean resumes are the examples' (digits, HF, FSDP2, Lightning)
@pytest.mark.resume
@pytest.mark.determinism
def test_the_clean_job_is_deterministic_and_resumes_exactly(tmp_path: Path) -> None:
    report = check(job_file(tmp_path), report_json=str(tmp_path / "report.json"))
    by_name = {c.name: c for c in report.checks}
    assert report.status == "passed", [(c.name, c.summary) for c in report.checks]
    resume = report_evidence(by_name["resume"])
    assert resume["resumed_from_step"] % 4 == 0 and resume["resumed_from_step"] >= 8, resume
    assert resume["trajectory"]["max_abs_diff"] == 0.0, resume["trajectory"]
    # the final checkpoints compared key by key: model, optimizer, scheduler, RNG, data position
    assert resume["state"]["compared"] is True and resume["state"]["differing_keys"] == [], resume["state"]
    # issue 45: the invariants read determinism's first run (no launch of their own), 2 epochs of it
    invariants = report_evidence(by_name["invariants"])
    assert invariants["run_dir"] == report_evidence(by_name["determinism"])["run_dirs"][0], invariants
    compared = {c["invariant"]: c["compared"] for c in invariants["coverage"]}
    assert invariants["findings"] == [] and compared == {"replicas": 144, "trains": 12, "scaler": 0, "data": 4}, compared


#: what the observed cause says, per plant: the restore the resumed run never made
OBSERVED = {
    "scheduler_not_saved": "never loaded the scheduler's state",
    "rng_not_restored": "the resume sets no RNG state",
}

#: the plant in the default run (the issue's case); the other is slow (each plant is 3 runs of 2 ranks)
DEFAULT_PLANT = "scheduler_not_saved"


def _plant_param(plant: str) -> object:
    marks = [] if plant == DEFAULT_PLANT else [pytest.mark.slow]
    return pytest.param(plant, marks=marks, id=plant)


@pytest.mark.resume
@pytest.mark.parametrize("plant", [_plant_param(p) for p in PLANTS])
def test_a_planted_resume_defect_fails_naming_its_cause_first(tmp_path: Path, plant: str) -> None:
    result = resume_of(job_file(tmp_path, f"--plant {plant}"), tmp_path)
    assert result.status == "failed", result.summary
    evidence = report_evidence(result)
    boundary = evidence["resumed_from_step"] + 1
    divergent = evidence["trajectory"]["first_divergent_step"]
    if plant == "scheduler_not_saved":
        # the restored optimizer's lr carries the first resumed step's update; the restarted
        # schedule the second's, which the loss printed at the third is the first to show
        assert divergent == boundary + 2, evidence["trajectory"]
    else:
        assert divergent == boundary, evidence["trajectory"]
    first = evidence["diagnosis"][0]
    assert first["key"] == PLANTS[plant] and first["evidence"], evidence["diagnosis"]
    # named from what the ranks recorded (the job prints no lr), citing both runs' values
    assert first.get("observed") is True, first
    said = " ".join(first["evidence"])
    assert OBSERVED[plant] in said, said
    # the restored optimizer's param groups carry the first resumed step's lr; the fresh
    # schedule sets the next one
    at = boundary + 1 if plant == "scheduler_not_saved" else boundary
    assert evidence["first_divergence"]["step"] == at, evidence["first_divergence"]


@pytest.mark.slow
@pytest.mark.parametrize("record_steps", [True, False], ids=["agent-on", "agent-off"])
def test_a_compiled_model_keeps_its_verdicts_with_the_agent_on(tmp_path: Path, record_steps: bool) -> None:
    """The clean job under ``torch.compile`` (aot_eager: dynamo's graphs and AOTAutograd, no
    inductor compile on CPU): determinism and resume pass with the run agent recording every step
    as without it, and its records name the parameters as the model does (no ``_orig_mod.``)."""
    path = job_file(tmp_path, "--compile aot_eager")
    if not record_steps:
        path.write_text(path.read_text().replace("  timeout: 90\n", "  timeout: 90\n  record_steps: false\n"))
    report = check(path, only=["determinism", "resume"])
    assert {c.name: c.status for c in report.checks} == {"determinism": "passed", "resume": "passed"}, [
        (c.name, c.summary) for c in report.checks]
    steps_dirs = sorted(tmp_path.glob(".trainguard/runs/*/trainguard-steps"))
    if not record_steps:
        assert not steps_dirs
        return
    from trainguard.launch.steps import read_steps

    records = read_steps(steps_dirs[0].parent)
    assert sorted(records.ranks) == [0, 1]
    names = set(records.ranks[0].steps[0].param)
    assert names == {"0.weight", "0.bias", "3.weight", "3.bias", "6.weight", "6.bias"}, names
