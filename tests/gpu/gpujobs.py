"""The CUDA job's job file and the assertions tests/gpu shares."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from tests.helpers import report_evidence
from trainguard.report import CheckResult, Report
from trainguard.session import check

HERE = Path(__file__).resolve().parent

JOB_FILE = """\
job:
  name: cuda-mlp
  command: "python cuda_train.py --steps {steps} --ckpt-dir {checkpoint_dir} --seed {seed}%(extra)s"
  resume_args: "--resume"
  world_size: %(world_size)s
  env: {CUBLAS_WORKSPACE_CONFIG: ":4096:8", OMP_NUM_THREADS: "2"}
  metrics:
    loss: 'step (?P<step>\\d+) loss (?P<value>\\S+)'
  timeout: 120
  stall_timeout: 60
%(job_extra)schecks:
%(checks)s"""


def make_job(tmp: Path, checks: str, *, extra: str = "", job_extra: str = "", world_size: int = 1) -> Path:
    root = tmp / "cuda-job"
    root.mkdir()
    shutil.copy(HERE / "cuda_train.py", root / "cuda_train.py")
    (root / "trainguard.yaml").write_text(JOB_FILE % {
        "extra": extra, "job_extra": job_extra, "world_size": world_size, "checks": checks})
    return root


def results(root: Path, tmp: Path, only: list[str]) -> dict[str, CheckResult]:
    report = check(root, only=only, report_json=str(tmp / "report.json"))
    return {r.name: r for r in report.checks}


def first_cause(result: CheckResult) -> dict:
    assert result.status == "failed", result.summary
    diagnosis = report_evidence(result).get("diagnosis") or []
    assert diagnosis, report_evidence(result)
    return diagnosis[0]


def assert_cuda_oom_drill_passed(report: Report, name: str) -> None:
    """The drill ``name`` passed on a real CUDA out-of-memory error."""
    by_name = {r.name.split(":")[-1]: r for r in report.checks}
    assert name in by_name, list(by_name)
    result = by_name[name]
    assert result.status == "passed", (name, result.summary)
    text = json.dumps(report_evidence(result))
    assert "CUDA out of memory" in text or "CUDA OOM" in text, (name, text[:3000])
