"""karpathy/nanoGPT's train.py, unmodified, under the resume check (issue 44's "Done when").

From a temporary folder: train.py, model.py and configurator.py as cloned (a local mirror,
``TRAINGUARD_NANOGPT_MIRROR``; skipped without one), random uint16 tokens as its data, the job file
``trainguard init train.py --yes`` writes with a tiny CPU model (tests/benchmarks/cause_table.py's
``nanogpt_job``). nanoGPT's checkpoint holds model, optimizer, iter_num and config, no RNG state,
and its resume sets none: its batches (``torch.randint``) start again from the seed, so the resume
fails at the first resumed step, and the cause named first must be the RNG. ~10 s, ``slow``.
"""

from __future__ import annotations

import re

import pytest

from tests.benchmarks.cause_table import NANOGPT_MIRROR, nanogpt_job
from tests.helpers import report_evidence
from trainguard.report import CheckResult
from trainguard.session import check

pytestmark = [
    pytest.mark.slow,
    pytest.mark.resume,
    pytest.mark.timeout(400),
    pytest.mark.skipif(not (NANOGPT_MIRROR / "HEAD").exists(), reason=f"no nanoGPT mirror at {NANOGPT_MIRROR}"),
]


@pytest.fixture(scope="module")
def resume(tmp_path_factory: pytest.TempPathFactory) -> CheckResult:
    tmp = tmp_path_factory.mktemp("nanogpt")
    report = check(nanogpt_job(tmp), only=["resume"], report_json=str(tmp / "report.json"))
    (result,) = report.checks
    return result


def test_nanogpts_resume_fails_at_the_first_resumed_step_naming_the_rng(resume: CheckResult) -> None:
    assert resume.status == "failed", resume.summary
    evidence = report_evidence(resume)
    assert evidence["trajectory"]["first_divergent_step"] == evidence["resumed_from_step"] + 1, evidence["trajectory"]
    first = evidence["diagnosis"][0]
    assert first["key"] == "rng", evidence["diagnosis"]
    assert any("no RNG state" in e for e in first["evidence"]), first


def test_the_rng_cause_cites_that_the_resume_set_no_rng_state(resume: CheckResult) -> None:
    first = report_evidence(resume)["diagnosis"][0]
    said = " ".join(first["evidence"])
    assert re.search(r"\b(sets|set|called|restored|ran) (no|none|nothing)\b|never (set|called|restored)", said,
                     re.IGNORECASE), first
