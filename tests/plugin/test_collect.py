"""Job files collected by pytest: one item per check, selected by marker, reported in a
``trainguard`` terminal-summary section -- in a real pytest subprocess, with and without xdist.

The plugin is loaded through its ``pytest11`` entry point, as in a user's project.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)

JOBS = Path(__file__).resolve().parents[1] / "data" / "jobs"

#: The inner projects do not use Hypothesis; its plugin alone costs ~2 s per inner run when
#: bytecode is not cached (PYTHONDONTWRITEBYTECODE).
INI = "[pytest]\naddopts = -p no:hypothesispytest\n"


@pytest.fixture
def project(pytester: pytest.Pytester) -> pytest.Pytester:
    """A user project: the toy script, its clean job as ``trainguard.yaml``, its own ini."""
    shutil.copy(JOBS / "toy_train.py", pytester.path / "toy_train.py")
    shutil.copy(JOBS / "toy.trainguard.yaml", pytester.path / "trainguard.yaml")
    pytester.makeini(INI)
    return pytester


def add_job(pytester: pytest.Pytester, name: str) -> Path:
    return Path(
        shutil.copy(JOBS / f"{name}.trainguard.yaml", pytester.path / f"{name}.trainguard.yaml")
    )


def test_each_check_is_one_item(project: pytest.Pytester) -> None:
    """One item per configured check; a job file with a ``gate:`` section also gets the
    invariants item ``trainguard gate`` adds (reading determinism's run), so the summary's gate
    verdict weighs what the gate weighs."""
    add_job(project, "nondet")
    gated = project.path / "gated.trainguard.yaml"
    gated.write_text((project.path / "trainguard.yaml").read_text().replace("name: toy", "name: gated")
                     + "gate:\n  require: [smoke, determinism]\n")
    result = project.runpytest_subprocess("--collect-only", "-q")
    result.stdout.fnmatch_lines(
        [
            "gated.trainguard.yaml::smoke",
            "gated.trainguard.yaml::determinism",
            "gated.trainguard.yaml::invariants",
            "nondet.trainguard.yaml::determinism",
            "trainguard.yaml::smoke",
            "trainguard.yaml::determinism",
            "*6 tests collected*",
        ]
    )
    assert result.ret == 0


def test_a_marker_selects_only_its_check_and_the_summary_lists_it(project: pytest.Pytester) -> None:
    result = project.runpytest_subprocess("-m", "determinism", "-v", "--trainguard-seed=11")
    result.stdout.fnmatch_lines(
        [
            "trainguard.yaml::determinism PASSED*",
            "*= trainguard =*",
            "PASSED  determinism: two runs with seed 11 match on all 8 steps of loss"
            "  [[]trainguard.yaml::determinism[]]",
        ]
    )
    result.stdout.no_fnmatch_line("*::smoke*")
    result.assert_outcomes(passed=1, deselected=1)


@pytest.mark.parametrize(
    "switch",
    [["-o", "trainguard_collect_yaml=false"], ["--trainguard-collect-yaml=0"]],
    ids=["ini", "flag"],
)
def test_collection_can_be_switched_off(project: pytest.Pytester, switch: list[str]) -> None:
    result = project.runpytest_subprocess("--collect-only", "-q", *switch)
    result.stdout.fnmatch_lines(["*no tests collected*"])
    result.stdout.no_fnmatch_line("*trainguard.yaml::*")


def test_the_command_line_overrides_collection_switched_off_in_the_ini_file(
    project: pytest.Pytester,
) -> None:
    project.makeini(INI + "trainguard_collect_yaml = false\n")
    result = project.runpytest_subprocess("--collect-only", "-q", "--trainguard-collect-yaml=1")
    result.stdout.fnmatch_lines(
        ["trainguard.yaml::smoke", "trainguard.yaml::determinism", "*2 tests collected*"]
    )


def test_a_profile_with_a_headroom_search_is_marked_slow(project: pytest.Pytester) -> None:
    """Its probes take minutes (examples/digits/headroom.trainguard.yaml: ~100 s), so
    ``-m "not slow"`` leaves it out; a profile without the search is not slow."""
    headroom = (JOBS / "memory.trainguard.yaml").read_text()
    plain = headroom.replace("    headroom: {start: 16, max: 1024, memory_budget_mb: 200, steps: 3}\n", "")
    assert plain != headroom
    (project.path / "headroom.trainguard.yaml").write_text(headroom)
    (project.path / "plain.trainguard.yaml").write_text(plain)

    slow = project.runpytest_subprocess("--collect-only", "-q", "-m", "slow")
    slow.stdout.fnmatch_lines(["headroom.trainguard.yaml::profile", "*1/4 tests collected (3 deselected)*"])
    assert "plain.trainguard.yaml" not in slow.stdout.str()

    fast = project.runpytest_subprocess("--collect-only", "-q", "-m", "not slow")
    fast.stdout.fnmatch_lines(["plain.trainguard.yaml::profile", "*3/4 tests collected (1 deselected)*"])
    assert "headroom.trainguard.yaml" not in fast.stdout.str()

    profiles = project.runpytest_subprocess("--collect-only", "-q", "-m", "profile")
    profiles.stdout.fnmatch_lines(["*2/4 tests collected (2 deselected)*"])  # still a profile


def test_an_invalid_job_file_is_a_collection_error_without_a_traceback(
    project: pytest.Pytester,
) -> None:
    path = project.path / "trainguard.yaml"
    path.write_text(path.read_text().replace("world_size: 2", "world_size: 0"))
    result = project.runpytest_subprocess()
    assert result.ret == pytest.ExitCode.INTERRUPTED  # collection errors stop the session
    result.stdout.fnmatch_lines(
        [
            "*ERROR collecting trainguard.yaml*",
            f"{path}: job.world_size: expected a value >= 1, got 0*",
        ]
    )
    output = result.stdout.str() + result.stderr.str()
    assert "Traceback" not in output
    assert "config.py" not in output and "collect.py" not in output
    assert "raise " not in output


def test_a_failing_determinism_check_shows_the_step_and_how_to_reproduce(
    project: pytest.Pytester,
) -> None:
    (project.path / "trainguard.yaml").unlink()
    add_job(project, "nondet")
    result = project.runpytest_subprocess()
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "*_ trainguard determinism: nondet.trainguard.yaml _*",
            "trainguard determinism failed: loss differs from step 1 on (*) with the same seed 0",
            '*"first_divergent_step": 1*',
            "*likely_causes*unseeded RNG*",
            "  reproduce: run twice and diff: *toy_train.py --steps 6 --seed 0 *--nondet",
            "*= trainguard =*",
            "FAILED  determinism: loss differs from step 1 *  [[]nondet.trainguard.yaml::determinism[]]",
            "        reproduce: run twice and diff: *",
            "*1 failed*",
        ]
    )
    assert "Traceback" not in result.stdout.str()


def test_xdist_workers_report_verdicts_to_the_controller(project: pytest.Pytester) -> None:
    pytest.importorskip("xdist")
    add_job(project, "nondet")
    add_job(project, "die")
    result = project.runpytest_subprocess("-n", "2")
    result.assert_outcomes(passed=2, failed=2)
    result.stdout.fnmatch_lines(["*2 workers [[]4 items[]]*", "*= trainguard =*"])
    # the section ends where pytest's own short summary starts (untruncated when CI=true)
    summary = result.stdout.str().split("= trainguard =", 1)[1].split("short test summary info")[0]
    for line in (
        "PASSED  smoke: 5 steps in",
        "PASSED  determinism: two runs with seed 0 match",
        "FAILED  determinism: loss differs from step 1",
        "FAILED  smoke: the job did not complete: rank 1 exited with code 3",
    ):
        assert line in summary, line
    assert summary.count("reproduce: ") == 2
    for nodeid in (
        "trainguard.yaml::smoke",
        "trainguard.yaml::determinism",
        "nondet.trainguard.yaml::determinism",
        "die.trainguard.yaml::smoke",
    ):
        assert f"[{nodeid}]" in summary, nodeid


@pytest.mark.parametrize("required", [["smoke", "determinism"], ["smoke", "determinism", "canary"]])
def test_the_gate_verdict_is_in_the_summary_and_a_block_fails_the_run(
    project: pytest.Pytester, required: list[str]
) -> None:
    job = project.path / "trainguard.yaml"
    job.write_text(job.read_text() + f"gate:\n  require: [{', '.join(required)}]\n")
    result = project.runpytest_subprocess()
    if "canary" in required:  # required but not configured: nothing vouches for it
        result.stdout.fnmatch_lines(["GATE    toy: BLOCK  [[]trainguard.yaml[]]",
                                     "        - required check canary is not configured*"])
        assert result.ret == 1  # every item passed; the gate's block carries the exit code
    else:
        result.stdout.fnmatch_lines(["GATE    toy: PROMOTE  [[]trainguard.yaml[]]"])
        assert result.ret == 0
        return  # the partial session once, not per parameter
    partial = project.runpytest_subprocess("-m", "smoke")
    partial.stdout.fnmatch_lines(["GATE    toy: not judged: this session did not run determinism*"])
