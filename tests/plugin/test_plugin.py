"""The pytest layer, exercised the way users meet it: a real pytest run in a subprocess.

The plugin is loaded through its ``pytest11`` entry point (trainguard is installed), exactly as in
a user's project; nothing here registers it by hand.
"""

from __future__ import annotations

import json
import re
import sys

import pytest
from trainguard.plugins.markers import MARKERS

from trainguard.config.settings import OPTIONS

pytestmark = pytest.mark.timeout(120)

MARKER_SIGNATURES = [
    "seeded(seed=None)",
    "smoke",
    "canary",
    "determinism",
    "resume",
    "parallel",
    "reshard",
    "ddp(world_size=2, backend=None)",
    "fault(kind, **params)",
    "profile(max_data_wait=None, min_throughput=None)",
    "gpu(count=1)",
    "ray",
    "slow",
]


def runpytest(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    """``pytest`` in a subprocess, the plugin loaded by its entry point as in a user's project.

    Hypothesis' pytest plugin is switched off: it has nothing to do with these runs and costs
    about a second of start-up each.
    """
    return pytester.runpytest_subprocess("-p", "no:hypothesispytest", *args)


def _draws(stdout: str) -> dict[str, str]:
    # with -s the first print shares its line with pytest's progress output
    return dict(re.findall(r"DRAW (\S+) (\[[^\]]*\])", stdout))


# --------------------------------------------------------------------------------------------
# Markers
# --------------------------------------------------------------------------------------------


def test_markers_table_matches_the_expected_signatures() -> None:
    assert [spec.line.split(":")[0] for spec in MARKERS.values()] == MARKER_SIGNATURES


def test_pytest_markers_lists_every_marker_with_its_signature(pytester: pytest.Pytester) -> None:
    result = runpytest(pytester, "--markers")
    assert result.ret == 0
    for signature in MARKER_SIGNATURES:
        result.stdout.fnmatch_lines([f"@pytest.mark.{signature}: *"])
    result.stdout.fnmatch_lines(
        [
            "@pytest.mark.fault(kind, **params): a fault-injection drill: kind is a fault kind of docs/drills.md (kill_rank, hang, oom, disk_full, network*soak*crash_loop)*"
        ]
    )


def test_every_marker_runs_clean_under_strict_markers(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    pytester.makepyfile(
        test_all_markers="""
        import pytest

        @pytest.mark.seeded
        @pytest.mark.smoke
        @pytest.mark.canary
        @pytest.mark.determinism
        @pytest.mark.resume
        @pytest.mark.parallel
        @pytest.mark.profile
        @pytest.mark.slow
        def test_plain_markers():
            pass

        @pytest.mark.seeded(seed=3)
        @pytest.mark.fault("kill_rank", rank=0, after_step=2)
        def test_markers_with_arguments():
            pass

        @pytest.mark.ddp(world_size=2, backend="gloo")
        def test_ddp():
            pass

        @pytest.mark.seeded(4)
        @pytest.mark.fault(kind="network", latency_ms=100)
        def test_positional_and_free_params():
            pass

        @pytest.mark.gpu(count=1)
        def test_gpu():
            pass
        """
    )
    # test_ddp is collected (so its marker is checked) but not run: it would launch ranks,
    # which tests/distributed covers
    result = runpytest(
        pytester,
        "--strict-markers",
        "-W",
        "error::pytest.PytestUnknownMarkWarning",
        "-rs",
        "-k",
        "not ddp",
    )
    result.assert_outcomes(passed=3, skipped=1, deselected=1)
    assert "Unknown" not in result.stdout.str() + result.stderr.str()


def test_dash_m_canary_selects_only_canary_tests(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_select="""
        import pytest

        @pytest.mark.canary
        def test_canary():
            pass

        @pytest.mark.smoke
        def test_smoke():
            pass

        def test_unmarked():
            pass

        @pytest.mark.canary
        @pytest.mark.slow
        def test_slow_canary():
            pass
        """
    )
    result = runpytest(pytester, "--strict-markers", "-m", "canary", "-v")
    result.assert_outcomes(passed=2, deselected=2)
    result.stdout.fnmatch_lines(["*test_canary PASSED*", "*test_slow_canary PASSED*"])
    result.stdout.no_fnmatch_line("*test_smoke*")
    result.stdout.no_fnmatch_line("*test_unmarked*")


def test_bad_marker_arguments_fail_the_test_with_a_clear_message(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_bad="""
        import pytest

        @pytest.mark.ddp(world_size="2")
        def test_ddp_string():
            pass

        @pytest.mark.fault("meteor")
        def test_fault_unknown():
            pass

        @pytest.mark.gpu(count=0)
        def test_gpu_zero():
            pass

        @pytest.mark.seeded(seed=-1)
        def test_seed_negative():
            pass

        @pytest.mark.ddp(3, "gloo", "extra")
        def test_ddp_too_many():
            pass

        @pytest.mark.ddp(backend="tcp")
        def test_ddp_backend():
            pass

        @pytest.mark.fault("hang", rank="0")
        def test_fault_rank_string():
            pass

        @pytest.mark.fault("hang", rank=1, after_step=0)
        def test_fine():
            pass
        """
    )
    result = runpytest(pytester, "--strict-markers")
    result.assert_outcomes(passed=1, errors=7)
    out = result.stdout.str()
    for expected in [
        "test_bad.py::test_ddp_string: @pytest.mark.ddp: expected an int for world_size, got world_size='2' (type=str)",
        "test_bad.py::test_fault_unknown: @pytest.mark.fault: unknown kind 'meteor'; expected one of kill_rank, hang, oom, disk_full, network",
        "test_bad.py::test_gpu_zero: @pytest.mark.gpu: count must be >= 1, got count=0",
        "test_bad.py::test_seed_negative: @pytest.mark.seeded: seed must be >= 0, got seed=-1",
        "test_bad.py::test_ddp_too_many: @pytest.mark.ddp(world_size=2, backend=None): too many positional arguments",
        "test_bad.py::test_ddp_backend: @pytest.mark.ddp: backend must be one of None, 'gloo', 'nccl', 'mpi', 'ucc', got backend='tcp'",
        "test_bad.py::test_fault_rank_string: @pytest.mark.fault: expected an int for rank, got rank='0' (type=str)",
    ]:
        assert expected in out
    # pytest.fail(pytrace=False): the message, not a traceback into the plugin
    assert "markers.py" not in out
    assert "UsageError" not in out


def test_gpu_marker_skips_with_the_reason(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    pytester.makepyfile(
        test_gpu="""
        import pytest

        @pytest.mark.gpu
        def test_one():
            raise AssertionError("must not run without a GPU")

        @pytest.mark.gpu(count=2)
        def test_two():
            raise AssertionError("must not run without a GPU")
        """
    )
    result = runpytest(pytester, "-rs")
    result.assert_outcomes(skipped=2)
    result.stdout.fnmatch_lines(
        [
            "SKIPPED [[]1[]] test_gpu.py:*: needs 1 GPU(s), found 0 (CUDA_VISIBLE_DEVICES='' hides every device)",
            "SKIPPED [[]1[]] test_gpu.py:*: needs 2 GPU(s), found 0 *",
        ]
    )


# --------------------------------------------------------------------------------------------
# Options
# --------------------------------------------------------------------------------------------


def test_help_shows_the_trainguard_group(pytester: pytest.Pytester) -> None:
    result = runpytest(pytester, "--help")
    assert result.ret == 0
    result.stdout.fnmatch_lines(["trainguard (training-code checks):"])
    out = result.stdout.str()
    for opt in OPTIONS:
        assert opt.flag in out
        assert opt.ini in out


SEED_PRINTER = """
def test_print_seed(tg_seed):
    print(f"SEED={tg_seed}")
"""


@pytest.mark.parametrize(
    ("ini", "env", "flag", "winner"),
    [
        ("3", None, None, "3"),
        ("3", "4", None, "4"),
        ("3", "4", "5", "5"),
    ],
)
def test_seed_precedence_through_pytest(
    pytester: pytest.Pytester,
    monkeypatch: pytest.MonkeyPatch,
    ini: str | None,
    env: str | None,
    flag: str | None,
    winner: str,
) -> None:
    if ini is not None:
        pytester.makefile(".ini", pytest=f"[pytest]\ntrainguard_seed = {ini}\n")
    if env is not None:
        monkeypatch.setenv("TRAINGUARD_SEED", env)
    pytester.makepyfile(test_seed=SEED_PRINTER)
    args = ["-s"] + ([f"--trainguard-seed={flag}"] if flag is not None else [])
    result = runpytest(pytester, *args)
    result.assert_outcomes(passed=1)
    assert re.findall(r"SEED=(\d+)", result.stdout.str()) == [winner]


@pytest.mark.parametrize(
    ("where", "spelled", "source"),
    [
        ("flag", "--trainguard-seed", "command line"),
        ("env", "TRAINGUARD_SEED", "environment"),
        ("ini", "trainguard_seed", "ini file"),
    ],
)
def test_invalid_option_value_is_a_usage_error(
    pytester: pytest.Pytester,
    monkeypatch: pytest.MonkeyPatch,
    where: str,
    spelled: str,
    source: str,
) -> None:
    pytester.makepyfile(test_x="def test_x(): pass")
    args: list[str] = []
    if where == "flag":
        args.append("--trainguard-seed=abc")
    elif where == "env":
        monkeypatch.setenv("TRAINGUARD_SEED", "abc")
    else:
        pytester.makefile(".ini", pytest="[pytest]\ntrainguard_seed = abc\n")
    result = runpytest(pytester, *args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        [f"ERROR: trainguard: {spelled}: invalid value 'abc' for {spelled} (from the {source}): *"]
    )
    assert "Traceback" not in result.stderr.str() + result.stdout.str()


def test_invalid_boolean_option_names_the_flag(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_x="def test_x(): pass")
    result = runpytest(pytester, "--trainguard-deterministic=maybe")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        [
            "ERROR: trainguard: --trainguard-deterministic: invalid value 'maybe'*expected one of 1/0, true/false, yes/no, on/off*"
        ]
    )
    assert "Traceback" not in result.stderr.str()


# --------------------------------------------------------------------------------------------
# Seeding and the reproduce line
# --------------------------------------------------------------------------------------------


def test_failing_seeded_tests_show_how_to_reproduce(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_repro="""
        import pytest

        @pytest.mark.seeded(seed=7)
        def test_explicit_seed():
            assert False, "boom"

        def test_fixture_seed(tg_seed):
            assert tg_seed == 11
            assert False, "boom"

        @pytest.mark.seeded
        def test_marker_without_seed():
            assert False, "boom"

        @pytest.mark.seeded(seed=8)
        def test_passes():
            pass

        def test_unseeded_failure():
            assert False
        """
    )
    result = runpytest(pytester, "--trainguard-seed=11")
    result.assert_outcomes(passed=1, failed=4)
    result.stdout.fnmatch_lines(
        [
            "*= trainguard =*",
            "FAILED  test_repro.py::test_explicit_seed (seed 7); reproduce: pytest test_repro.py::test_explicit_seed",
            "FAILED  test_repro.py::test_fixture_seed (seed 11); reproduce: pytest test_repro.py::test_fixture_seed --trainguard-seed=11",
            "FAILED  test_repro.py::test_marker_without_seed (seed 11); reproduce: pytest test_repro.py::test_marker_without_seed --trainguard-seed=11",
        ]
    )
    # the failure itself carries the seed too
    result.stdout.fnmatch_lines(
        ["*seeded with 7; reproduce: pytest test_repro.py::test_explicit_seed"]
    )
    summary = result.stdout.str().split("= trainguard =")[1].split("short test summary info")[0]
    assert "test_passes" not in summary
    assert "test_unseeded_failure" not in summary
    # an explicit seed needs no flag to reproduce
    assert "test_explicit_seed --trainguard-seed" not in summary


def test_seeded_marker_seeds_before_fixtures_and_every_test(pytester: pytest.Pytester) -> None:
    # One run for everything seeding does (each run that imports torch costs seconds).
    pytester.makeconftest(
        """
        import pytest
        import torch

        @pytest.fixture
        def drawn():
            return torch.rand(4)
        """
    )
    pytester.makepyfile(
        test_seeded="""
        import pytest
        import torch

        def expected(seed):
            torch.manual_seed(seed)
            return torch.rand(4)

        @pytest.mark.seeded(seed=1)
        def test_a():
            x = torch.rand(4)
            print("DRAW a", x.tolist())
            assert torch.equal(x, expected(1))

        def test_consumes_rng_between():
            torch.rand(100)

        @pytest.mark.seeded(seed=1)
        def test_b():
            x = torch.rand(4)
            print("DRAW b", x.tolist())
            assert torch.equal(x, expected(1))

        @pytest.mark.seeded(seed=1)
        def test_fixture_draws_after_seeding(drawn):
            print("DRAW fixture", drawn.tolist())
            assert torch.equal(drawn, expected(1))

        @pytest.mark.seeded(seed=2)
        def test_other_seed():
            x = torch.rand(4)
            print("DRAW other", x.tolist())
            assert torch.equal(x, expected(2))

        @pytest.mark.seeded
        def test_marker_without_seed_uses_the_setting():
            assert torch.equal(torch.rand(4), expected(21))

        @pytest.mark.seeded(seed=5)
        def test_tg_seed_follows_the_marker(tg_seed):
            assert tg_seed == 5

        def test_tg_seed_follows_the_setting(tg_seed):
            assert tg_seed == 21
            assert torch.equal(torch.rand(4), expected(21))

        @pytest.mark.seeded(seed=13)
        def test_tg_generator_is_seeded_and_leaves_the_global_rng_alone(tg_generator):
            state = torch.get_rng_state()
            x = torch.rand(3, generator=tg_generator)
            assert torch.equal(torch.get_rng_state(), state)
            assert torch.equal(x, torch.rand(3, generator=torch.Generator().manual_seed(13)))
        """
    )
    result = runpytest(pytester, "-s", "-p", "no:randomly", "--trainguard-seed=21")
    result.assert_outcomes(passed=9)
    draws = _draws(result.stdout.str())
    assert draws["a"] == draws["b"] == draws["fixture"]
    assert draws["other"] != draws["a"]
    # passing seeded tests leave no trainguard section behind
    result.stdout.no_fnmatch_line("*= trainguard =*")


def test_deterministic_mode_is_on_inside_and_restored_after(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    # tg_deterministic always; seeded tests and tg_seed only with the deterministic setting
    monkeypatch.setenv("TRAINGUARD_DETERMINISTIC", "1")
    pytester.makepyfile(
        test_det="""
        import os
        import pytest
        import torch

        def off():
            return (
                not torch.are_deterministic_algorithms_enabled()
                and not torch.backends.cudnn.deterministic
                and "CUBLAS_WORKSPACE_CONFIG" not in os.environ
            )

        def test_before():
            assert off()

        def test_fixture(tg_deterministic):
            assert torch.are_deterministic_algorithms_enabled()
            assert torch.backends.cudnn.deterministic
            assert os.environ["CUBLAS_WORKSPACE_CONFIG"]

        def test_after_fixture():
            assert off()

        @pytest.mark.seeded(seed=1)
        def test_seeded():
            assert torch.are_deterministic_algorithms_enabled()

        def test_after_seeded():
            assert off()

        def test_tg_seed(tg_seed):
            assert torch.are_deterministic_algorithms_enabled()

        def test_after_tg_seed():
            assert off()
        """
    )
    result = runpytest(pytester, "-p", "no:randomly", "-v")
    result.assert_outcomes(passed=7)


def test_fixtures_without_the_plugin_explain_themselves(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_x="def test_x(tg_seed): pass")
    result = runpytest(pytester, "-p", "no:trainguard")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*the trainguard plugin is not active in this pytest run*"])


# --------------------------------------------------------------------------------------------
# Report file
# --------------------------------------------------------------------------------------------


def test_report_json_option_writes_the_report(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_x="def test_x(): pass")
    result = runpytest(pytester, "--trainguard-report-json=out/report.json")
    result.assert_outcomes(passed=1)
    path = pytester.path / "out" / "report.json"
    data = json.loads(path.read_text(encoding="utf-8"))
    assert set(data) >= {
        "trainguard_version",
        "schema_version",
        "job",
        "status",
        "checks",
        "created_at",
        "host",
    }
    assert data["job"] == "pytest-session"
    assert data["status"] == "passed"
    assert data["checks"] == []
    result.stdout.fnmatch_lines(["*= trainguard =*", "report: *report.json"])


def test_no_report_without_the_option(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_x="def test_x(): pass")
    result = runpytest(pytester)
    result.assert_outcomes(passed=1)
    assert not list(pytester.path.rglob("*.json"))


# --------------------------------------------------------------------------------------------
# Start-up cost: no torch, ray or mlflow
# --------------------------------------------------------------------------------------------

HEAVY_CHECK = """
import sys
import pytest
ret = pytest.main({args!r})
print("LOADED", "trainguard.plugins.plugin" in sys.modules, "trainguard.fixtures.unit" in sys.modules)
print("HEAVY", sorted(m for m in ("torch", "ray", "mlflow") if m in sys.modules))
print("RET", int(ret))
"""


@pytest.mark.parametrize(
    "args",
    [
        ["--version", "--version"],  # a single --version returns before plugins load
        ["--collect-only", "-q", "test_plain.py"],
        ["-q", "test_plain.py"],
    ],
    ids=["version", "collect-only", "run-plain"],
)
def test_plugin_loads_without_heavy_imports(pytester: pytest.Pytester, args: list[str]) -> None:
    pytester.makepyfile(
        test_plain="""
        import pytest

        def test_plain():
            pass

        @pytest.mark.canary
        def test_marked():
            pass

        def test_uses_fixture_name(tg_deterministic):
            pass
        """
    )
    if "-q" in args and "--collect-only" not in args:
        args = [*args, "-k", "not fixture"]  # running tg_deterministic imports torch, by design
    result = pytester.run(sys.executable, "-c", HEAVY_CHECK.format(args=args))
    out = result.stdout.str()
    assert "LOADED True True" in out  # the check is meaningless if the plugin was not loaded
    assert "HEAVY []" in out
    assert "RET 0" in out


# --------------------------------------------------------------------------------------------
# pytest-xdist
# --------------------------------------------------------------------------------------------


def test_xdist_runs_seeded_tests_and_reports_on_the_controller(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_dist="""
        import pytest

        @pytest.mark.parametrize("i", range(4))
        @pytest.mark.seeded(seed=1)
        def test_seeded(i):
            import torch  # here, not at the top: the controller need not import it

            x = torch.rand(2)
            torch.manual_seed(1)
            assert torch.equal(x, torch.rand(2))

        @pytest.mark.seeded(seed=7)
        def test_fails():
            assert False, "boom"

        def test_fixture_fails(tg_seed):
            assert False, "boom"
        """
    )
    result = runpytest(pytester, "-n", "2", "--trainguard-seed=11")
    result.assert_outcomes(passed=4, failed=2)
    result.stdout.fnmatch_lines(["created: 2/2 workers"])
    out = result.stdout.str()
    assert "= trainguard =" in out
    summary = out.split("= trainguard =")[1].split("short test summary info")[0]
    assert (
        "FAILED  test_dist.py::test_fails (seed 7); reproduce: pytest test_dist.py::test_fails\n"
        in summary
    )
    assert (
        "FAILED  test_dist.py::test_fixture_fails (seed 11); "
        "reproduce: pytest test_dist.py::test_fixture_fails --trainguard-seed=11"
    ) in summary
    assert summary.count("reproduce:") == 2  # once each: the controller, not every worker too
