"""The Ray Train version of the digits example under trainguard, on a real local Ray.

``examples/digits_ray/ray_digits.py`` is run unchanged with ``TorchTrainer`` by trainguard's
driver; the checks are the same as for a command job. One embedded Ray head serves all runs of
a check session and is stopped at its end (no Ray process may be left).

Default run: smoke, determinism and resume in one session (6 fits; determinism's first run is
resume's reference). Slow: the planted defect -- a train_func that ignores
``ray.train.get_checkpoint()`` -- must fail the resume check.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from trainguard.checks import check
from trainguard.gate.local_ray import running_ray_processes

pytestmark = [pytest.mark.ray, pytest.mark.timeout(900)]
pytest.importorskip("ray.train", reason="needs ray[train] (pip install trainguard[ray])")

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
CHECKS = """
checks:
  smoke: {steps: 6}
  determinism: {steps: 12}
  resume: {steps: 12, after_step: 6}
"""


def copy_examples(tmp_path: Path) -> Path:
    """Both example folders (the Ray one imports the digits package by a relative path)."""
    ignore = shutil.ignore_patterns(".trainguard", "__pycache__")
    shutil.copytree(EXAMPLES / "digits", tmp_path / "digits", ignore=ignore)
    shutil.copytree(EXAMPLES / "digits_ray", tmp_path / "digits_ray", ignore=ignore)
    job = tmp_path / "digits_ray" / "trainguard.yaml"
    text = job.read_text()
    job.write_text(text[: text.index("checks:")] + CHECKS.lstrip("\n"))
    return job


def ray_pids() -> set[int]:
    return {p.pid for p in running_ray_processes()}


def test_smoke_determinism_and_resume_of_a_ray_train_function(tmp_path: Path) -> None:
    job = copy_examples(tmp_path)
    before = ray_pids()
    report = check(job)
    assert [c.name for c in report.checks] == ["smoke", "determinism", "resume"]
    for result in report.checks:
        assert result.status == "passed", f"{result.name}: {result.summary}"
    assert "resumed from the checkpoint of step 6 at step 7" in report.checks[0].summary
    assert not ray_pids() - before, "Ray processes left behind"


@pytest.mark.slow
def test_a_train_func_that_ignores_its_checkpoint_fails_resume(tmp_path: Path) -> None:
    job = copy_examples(tmp_path)
    code = tmp_path / "digits_ray" / "ray_digits.py"
    text = code.read_text()
    planted = text.replace("checkpoint = ray.train.get_checkpoint()", "checkpoint = None  # planted")
    assert planted != text
    code.write_text(planted)
    report = check(job, only=["resume"])
    (resume,) = report.checks
    assert resume.status == "failed", resume.summary
