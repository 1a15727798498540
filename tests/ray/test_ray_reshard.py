"""checks.reshard on the Ray Train version of the digits example: 2 workers checkpoint, 1 worker
resumes (and 1 -> 2), each a new fit on the same RunConfig with another ``num_workers``.

Slow (6 fits, 92-119 s on 2 shared cores). Measured: both pairs pass, max abs diff 2.4e-07 (2 -> 1)
and 1.2e-07 (1 -> 2) over steps 6-20; a ray_train job has no sample records.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.helpers import report_evidence
from trainguard.raytrain.local_ray import running_ray_processes, stopped_head_processes
from trainguard.session import check

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(900)]
pytest.importorskip("ray.train", reason="needs ray[train] (pip install trainguard[ray])")

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_ray_train_digits_resumes_with_another_num_workers_both_ways(tmp_path: Path) -> None:
    ignore = shutil.ignore_patterns(".trainguard", "__pycache__")
    for name in ("digits", "digits_ray"):  # the Ray one imports the digits package by a relative path
        shutil.copytree(EXAMPLES / name, tmp_path / name, ignore=ignore)
    job = tmp_path / "digits_ray" / "trainguard.yaml"
    text = job.read_text()
    job.write_text(text[: text.index("checks:")] + "checks:\n  reshard: {steps: 20, after_step: 6, pairs: [[2, 1], [1, 2]]}\n")
    before = {p.pid for p in running_ray_processes()}
    report = check(job, report_json=str(tmp_path / "report.json"))
    (result,) = report.checks
    assert result.status == "passed", result.summary
    for pair in report_evidence(result)["pairs"].values():
        assert pair["trajectory"]["first_divergent_step"] is None and pair["trajectory"]["compared_steps"] >= 10
        assert pair["trajectory"]["max_abs_diff"] < 1e-5
    assert not stopped_head_processes(before), f"Ray processes left behind: {stopped_head_processes(before)}"
