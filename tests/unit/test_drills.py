"""Fault drills without processes: the drill spec in the job file, the fault registry, and each
expectation's verdict on recorded attempts (the end-to-end drills on real ranks are in
tests/distributed/test_drills_e2e.py)."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from trainguard.config import DrillSpec, parse_config
from trainguard.config.fault_params import FaultParams
from trainguard.config.faults import FAULTS, Expectation, FaultNotInstalled, fault_class
from trainguard.drills.driver import make_drill
from trainguard.drills.judges import (
    DrillContext,
    Injection,
    judge_continue,
    judge_fail_clean,
    judge_recover,
)
from trainguard.errors import ConfigError
from trainguard.faults.base import Fault
from trainguard.faults.hang import HangFault
from trainguard.faults.kill import KillRankFault
from trainguard.launch import MetricPoint, RankExit, RunResult
from trainguard.launch.backend import CommandBackend
from trainguard.run.request import RunRequest
from trainguard.run.runner import SupervisedRun

HEAD = r"""
job:
  name: toy
  command: "python toy_train.py --steps {steps} --ckpt-dir {checkpoint_dir}"
  resume_args: "--resume"
  world_size: 2
  metrics: {loss: 'step (?P<step>\d+) loss (?P<value>\S+)'}
checks:
  drills:
"""


def load(*entries: str, head: str = HEAD) -> Any:
    return parse_config(head + "".join(f"    - {e}\n" for e in entries), path="/jobs/t.trainguard.yaml")


def problem(*entries: str, head: str = HEAD) -> str:
    with pytest.raises(ConfigError) as info:
        load(*entries, head=head)
    return str(info.value)


# -- the drill spec ------------------------------------------------------------------------------


def test_defaults_per_fault_and_after_step_in_the_middle() -> None:
    jf = load("{name: k, fault: kill_rank, rank: 1}", "{name: h, fault: hang, steps: 9}",
              "{name: o, fault: oom, rank: 1}")
    kill, hang, oom = jf.checks.drills
    assert (kill.expectation, kill.restart_limit, kill.after_step, kill.steps) == ("recover", 1, 10, 20)
    assert (hang.expectation, hang.after_step) == ("recover", 4)
    assert (oom.expectation, oom.restart_limit, oom.deadline_s) == ("fail_clean", 0, 60.0)
    net = DrillSpec.model_validate({"name": "n", "fault": "network", "duration": 2.0})
    assert (net.expectation, net.rate_floor) == ("continue", 0.5)


def test_drills_run_after_the_checks_and_are_selected_by_name() -> None:
    jf = load("{name: a, fault: kill_rank}", "{name: b, fault: hang}",
              head=HEAD.replace("checks:\n", "checks:\n  smoke: {steps: 3}\n"))
    assert [n for n, _ in jf.enabled_checks()] == ["smoke", "drill:a", "drill:b"]
    assert [n for n, _ in jf.enabled_checks(["drill:b"])] == ["drill:b"]
    assert [n for n, _ in jf.enabled_checks(["drills"])] == ["drill:a", "drill:b"]
    assert [n for n, _ in jf.enabled_checks(["smoke"])] == ["smoke"]
    with pytest.raises(ConfigError, match=r"drill\(s\) c requested but not in checks.drills \(drills here: a, b\)"):
        jf.enabled_checks(["drill:c"])


@pytest.mark.parametrize(
    ("entry", "expected"),
    [
        ("{name: a, fault: kil_rank}", "checks.drills[0].fault: unknown fault 'kil_rank' (did you mean 'kill_rank'?); expected one of kill_rank, hang, oom, disk_full, network, preempt"),
        ("{name: a, fault: hang, rank: 2}", "checks.drills[0].rank: rank 2 does not exist in a run of 2 rank(s)"),
        ("{name: a, fault: hang, after_step: 20}", "after_step (20) must be smaller than steps (20)"),
        ("{name: a, fault: hang, deadline: 5}", "deadline does not apply to `expect: recover`"),
        ("{name: a, fault: kill_rank, expect: continue, duration: 1, max_restarts: 2}", "max_restarts does not apply to `expect: continue`"),
        ("{name: a, fault: network}", "`expect: continue` compares the step rate"),
        ("{name: a, fault: hang, expect: recovr}", "checks.drills[0].expect: Input should be 'recover', 'fail_clean', 'continue', 'save_and_exit', 'handle_nonfinite', 'caught', 'detect' or 'give_up'"),
        ("{name: a, fault: kill_rank, expect: save_and_exit}", "`expect: save_and_exit` judges a preempt drill"),
        ("{name: a, fault: preempt, params: {style: aws}}", "checks.drills[0].params.style: expected one of kubernetes, slurm"),
        ("{name: a, fault: preempt, params: {grace: 0}}", "checks.drills[0].params.grace: expected seconds from the notice"),
        ("{name: a, fault: preempt, params: {grace: .inf}}", "checks.drills[0].params.grace: expected seconds from the notice"),
        ("{name: a, fault: preempt, params: {lead: 3}}", "checks.drills[0].params.lead: applies to `style: slurm` only"),
        ("{name: a, fault: preempt, params: {style: slurm, grace: 5, lead: 5}}", "checks.drills[0].params.lead: expected seconds from SIGUSR1"),
        ("{name: 'a b', fault: hang}", "drill name 'a b' may hold only letters"),
        ("{name: a, fault: hang, stall_timout: 3}", "checks.drills[0].stall_timout: unknown key 'stall_timout' (did you mean 'stall_timeout'?)"),
        ("{name: a, fault: kill_rank, params: {signal: SIGHUP}}", "checks.drills[0].params.signal: expected one of SIGKILL, SIGTERM, SIGINT, got 'SIGHUP'"),
        ("{name: a, fault: hang, params: {seconds: 3}}", "checks.drills[0].params.seconds: unknown parameter for fault 'hang'"),
        ("{name: a, fault: hang, args: '--x {stepz}'}", "checks.drills[0].args[1]: unknown placeholder {stepz}"),
        # drills that could only be skipped or end in an error are refused (issue 24)
        ("{name: a, fault: node_loss}", "checks.drills[0].fault: node_loss stops a Ray node, and this job is "
         "not `kind: ray_train`; for a command job use kill_rank"),
        ("{name: a, fault: soak, after_step: 5}", "checks.drills[0]: after_step does not apply to a soak drill"),
        ("{name: a, fault: soak, duration: 5}", "duration does not apply to a soak drill"),
        ("{name: a, fault: soak, params: {ranks: [1, 2, 5]}}", "checks.drills[0].params.ranks: rank(s) 2, 5 do "
         "not exist in a run of 2 rank(s); use ranks from 0 to 1"),
        ("{name: a, fault: soak, steps: 6, params: {every_steps: 1000, min_gap: 1, seeds: [1, 2]}}",
         "checks.drills[0].params.every_steps: the schedule of seed 1 holds no fault in 6 steps"),
    ],
)
def test_each_bad_drill_names_the_key_and_the_fix(entry: str, expected: str) -> None:
    assert expected in problem(entry)


def test_duplicate_names_and_missing_resume_args_are_reported_together() -> None:
    head = HEAD.replace('  resume_args: "--resume"\n', "")
    text = problem("{name: a, fault: hang}", "{name: a, fault: kill_rank, expect: fail_clean}", head=head)
    assert "checks.drills[1].name: duplicate drill name 'a' (also checks.drills[0])" in text
    assert "checks.drills[0].expect: `expect: recover` resumes the job" in text
    assert "checks.drills[1].expect: `expect: fail_clean` resumes the job" in text


def test_continue_needs_no_resume_args() -> None:
    head = HEAD.replace('  resume_args: "--resume"\n', "")
    (spec,) = load("{name: p, fault: hang, expect: continue, duration: 1, min_rate: 0}", head=head).checks.drills
    assert spec.rate_floor == 0.0


def test_make_drill_splits_fields_from_fault_params() -> None:
    jf = load("{name: a, fault: hang}")
    spec = make_drill(jf, {"name": "t", "fault": "kill_rank", "rank": 1, "signal": "SIGTERM", "steps": 8})
    assert (spec.rank, spec.steps, spec.after_step, spec.params) == (1, 8, 4, {"signal": "SIGTERM"})
    with pytest.raises(ConfigError, match=r"drill.params.signal: expected one of SIGKILL"):
        make_drill(jf, {"name": "t", "fault": "kill_rank", "signal": "SIGSEGV"})
    with pytest.raises(ConfigError, match=r"drill.rank: rank 5 does not exist"):
        make_drill(jf, {"name": "t", "fault": "hang", "rank": 5})


# -- the registry ------------------------------------------------------------------------------


def test_registry_gives_every_kind_a_class_and_a_default_expectation() -> None:
    assert all(":" in target for target in FAULTS.lines().values())
    assert fault_class("kill_rank") is KillRankFault
    assert fault_class("hang") is HangFault
    # each class carries its kind and the expectations it may be judged by, its default first
    defaults = {kind: fault_class(kind).expectations_for(FaultParams({}))[0] for kind in FAULTS}
    assert all(fault_class(kind).kind == kind for kind in FAULTS)
    assert defaults == {
        "kill_rank": "recover", "hang": "recover", "oom": "fail_clean", "disk_full": "fail_clean",
        "network": "continue", "preempt": "save_and_exit", "nan": "handle_nonfinite", "sdc": "caught",
        "storage": "fail_clean", "kill_during_save": "recover", "kill_worker": "fail_clean",
        "slow_rank": "continue", "soak": "recover", "node_loss": "recover", "crash_loop": "give_up",
    }
    assert fault_class("storage").expectations_for(FaultParams({"kind": "slow"})) == (Expectation.CONTINUE,)


def test_a_kind_whose_module_is_missing_is_reported_in_words(request: pytest.FixtureRequest, tmp_path: Path) -> None:
    FAULTS.unregister("oom")
    FAULTS.register("oom", "trainguard.faults.not_written_yet:OomFault", before="disk_full", lazy=True)
    request.addfinalizer(lambda: (FAULTS.unregister("oom"),
                                  FAULTS.register("oom", "trainguard.faults.oom:OomFault", before="disk_full")))
    with pytest.raises(FaultNotInstalled, match=r"fault 'oom' is not available in this installation: importing trainguard.faults.not_written_yet failed"):
        fault_class("oom")
    # the job file still loads (the other checks stay usable); the drill itself reports the error
    job = tmp_path / "t.trainguard.yaml"
    job.write_text(HEAD + "    - {name: o, fault: oom}\n")
    from trainguard.config import load_config
    from trainguard.drills import run_drill
    from trainguard.run.runner import JobRunner

    jf = load_config(job)
    result = run_drill(JobRunner(jf), jf.checks.drills[0])
    assert result.status == "error"
    assert "fault 'oom' is not available in this installation" in result.summary
    assert not (tmp_path / ".trainguard").exists()  # nothing was launched


def test_fault_contract_defaults() -> None:
    fault = KillRankFault(FaultParams({"signal": "SIGTERM"}), rank=1, after_step=3)
    assert fault.signal.name == "SIGTERM" and not fault.needs_preexec
    assert Fault.verify_continue(fault, _result("ok", [])) == []
    assert KillRankFault.validate(FaultParams({"signal": "SIGKILL"})) == []


# -- verdicts on recorded attempts -------------------------------------------------------------


def _points(steps: range, *, t0: float = 1.0, dt: float = 0.1, ranks: int = 2, value: float | None = None,
            ) -> list[MetricPoint]:
    return [
        MetricPoint("loss", s, value if value is not None else 1.0 / s, r, t0 + (s - steps.start) * dt)
        for s in steps for r in range(ranks)
    ]


def _result(outcome: str, points: list[MetricPoint], *, failed_rank: int | None = None, duration: float = 5.0,
            codes: tuple[int | None, int | None] = (0, 0), run_dir: Path = Path("/nonexistent")) -> RunResult:
    exits = [RankExit(r, 100 + r, c, "SIGKILL" if c == -9 else None) for r, c in enumerate(codes)]
    return RunResult(outcome, ["python"], run_dir, 2, 0, exits, points, duration, 1.0,  # type: ignore[arg-type]
                     reason="" if outcome == "ok" else f"rank {failed_rank} died",
                     failed_rank=failed_rank, evidence={"checkpoint_dir": "/nonexistent"},
                     checkpoint_dir=Path("/nonexistent"))


def _context(spec: DrillSpec, attempts: list[RunResult], *, injected_at: float | None = 1.55,
             runner: Any = None, fault: Fault | None = None) -> DrillContext:
    fault = fault or KillRankFault(spec.fault_params, rank=spec.rank, after_step=spec.after_step)
    fault.injected_at = injected_at
    info = Injection(watch_rank=spec.rank, injected_step=spec.after_step if injected_at else None)
    reference = _result("ok", _points(range(1, spec.steps + 1)))
    if runner is None:  # the judgement launches nothing: its reference is the run with records
        runner = SimpleNamespace(scheduling=SimpleNamespace(recorded=lambda run: run))
    return DrillContext(runner, spec, fault, info, SupervisedRun(attempts, Path("/x"), Path("/nonexistent")),
                    reference, RunRequest.make(steps=spec.steps, seed=0, world_size=2), "loss",
                    Path("/nonexistent"), 5.0)


KILL = DrillSpec.model_validate({"name": "k", "fault": "kill_rank", "rank": 1, "steps": 12, "after_step": 6})


def test_recover_passes_when_the_restart_resumes_and_matches() -> None:
    attempts = [_result("failed", _points(range(1, 7)), failed_rank=1, codes=(-15, -9)),
                _result("ok", _points(range(6, 13)))]
    status, summary, evidence = judge_recover(_context(KILL, attempts))
    assert status == "passed", summary
    assert "recovered with 1 restart(s), 1 step(s) lost" in summary
    assert evidence.lost_steps == 1 and evidence.resumes[0].resumed_from_step == 5


def test_recover_catches_a_restart_from_scratch_even_when_the_numbers_match() -> None:
    attempts = [_result("failed", _points(range(1, 7)), failed_rank=1), _result("ok", _points(range(1, 13)))]
    status, summary, evidence = judge_recover(_context(KILL, attempts))
    assert status == "failed"
    assert "began again at step 1: no usable checkpoint, all progress lost" in summary
    assert evidence.lost_steps == 6 and evidence.likely_causes


def test_recover_enforces_max_lost_steps_and_the_trajectory() -> None:
    spec = KILL.model_copy(update={"max_lost_steps": 0})
    diverged = _points(range(4, 13))
    diverged[-1] = MetricPoint("loss", 12, 9.0, 1, diverged[-1].t)
    attempts = [_result("failed", _points(range(1, 7)), failed_rank=1), _result("ok", diverged)]
    status, summary, _ = judge_recover(_context(spec, attempts))
    assert status == "failed"
    assert "3 steps of progress lost (max_lost_steps 0)" in summary
    assert "loss of the recovered run diverges from the uninterrupted run at step 12" in summary


def test_recover_fails_when_the_restarts_run_out_and_errors_when_never_injected() -> None:
    attempts = [_result("failed", _points(range(1, 7)), failed_rank=1),
                _result("failed", _points(range(6, 8)), failed_rank=0)]
    status, summary, _ = judge_recover(_context(KILL, attempts))
    assert status == "failed" and "did not recover: after 1 restart(s) (max_restarts 1)" in summary
    status, summary, _ = judge_recover(_context(KILL, [_result("ok", _points(range(1, 13)))], injected_at=None))
    assert status == "error" and "the fault was never injected" in summary


def test_a_fault_that_struck_after_the_last_step_is_an_error_not_a_pass() -> None:
    # the monitor read "step 6" late: the rank had printed all 12 steps before the kill landed
    done = [MetricPoint("loss", s, 1.0 / s, r, 1.0 + 0.01 * s) for s in range(1, 13) for r in range(2)]
    attempts = [_result("failed", done, failed_rank=1), _result("ok", [])]
    status, summary, evidence = judge_recover(_context(KILL, attempts))
    assert status == "error"
    assert "the fault came too late to test anything: rank 1 had already printed its last step (12)" in summary
    assert evidence.watched_rank_step_at_injection == 12


class _VerifyRunner:
    """Hands the fail_clean judge a recorded verification run (the real one is tested e2e)."""

    def __init__(self, result: RunResult) -> None:
        self.result = result
        self.calls: list[dict[str, Any]] = []

    def run(self, request: RunRequest, **kwargs: Any) -> RunResult:
        self.calls.append(kwargs)
        return self.result


FAIL = DrillSpec.model_validate({"name": "f", "fault": "hang", "rank": 1, "steps": 12, "after_step": 6,
                                 "expect": "fail_clean", "deadline": 5})


def test_fail_clean_passes_on_a_prompt_error_exit_and_an_intact_checkpoint(tmp_path: Path) -> None:
    (tmp_path / "rank0.stderr.log").write_text("RuntimeError: collective timed out\n")
    first = _result("failed", _points(range(1, 7)), failed_rank=0, codes=(1, -15), run_dir=tmp_path)
    runner = _VerifyRunner(_result("ok", _points(range(6, 13))))
    c = _context(FAIL, [first], runner=runner)
    c.info.first_exit = (0, 1, 1.55 + 3.0)
    status, summary, evidence = judge_fail_clean(c)
    assert status == "passed", summary
    assert runner.calls == [{"label": "drill-f-verify", "resume": True, "checkpoint_dir": Path("/nonexistent")}]
    assert evidence.exit_after_s == 3.0 and evidence.checkpoint.to_dict() == {"intact": True, "resumed_from_step": 5}


def test_fail_clean_catches_a_hang_a_late_exit_a_silent_exit_and_a_lost_checkpoint(tmp_path: Path) -> None:
    (tmp_path / "rank0.stderr.log").write_text("")
    hung = _result("hung", _points(range(1, 7)), codes=(-15, -15), run_dir=tmp_path)
    c = _context(FAIL, [hung], runner=_VerifyRunner(_result("ok", _points(range(1, 13)))))
    status, summary, _ = judge_fail_clean(c)
    assert status == "failed"
    assert "the job hung: trainguard's stall detection ended it" in summary
    assert "the resume run started again from step 1" in summary

    late = _result("failed", _points(range(1, 7)), failed_rank=0, codes=(3, -15), run_dir=tmp_path)
    c = _context(FAIL, [late], runner=_VerifyRunner(_result("ok", _points(range(6, 13)))))
    c.info.first_exit = (0, 3, 1.55 + 9.0)
    status, summary, _ = judge_fail_clean(c)
    assert "exited 9.0 s after the fault, later than the deadline of 5 s" in summary
    assert "rank 0 exited with code 3 but wrote no error to stderr after the fault" in summary


def _fail_clean_on(tmp_path: Path, stderr: str) -> tuple[str, str, dict[str, Any]]:
    """fail_clean's verdict on a rank 0 that exited 1 three seconds after the fault with
    ``stderr``, its checkpoint intact."""
    (tmp_path / "rank0.stderr.log").write_text(stderr)
    first = _result("failed", _points(range(1, 7)), failed_rank=0, codes=(1, -15), run_dir=tmp_path)
    c = _context(FAIL, [first], runner=_VerifyRunner(_result("ok", _points(range(6, 13)))))
    c.metric_lines = (r"step (?P<step>\d+) loss (?P<value>\S+)",)
    c.info.first_exit = (0, 1, 1.55 + 3.0)
    return judge_fail_clean(c)


TQDM = "".join(f"\r{n * 10:3d}%|{'#' * n}{' ' * (10 - n)}| {n}/10 [00:0{n // 5}<00:01, 4.97it/s]" for n in (0, 5, 10))


@pytest.mark.parametrize("said", [
    "OSError: [Errno 5] Input/output error",  # had "error": passed before too
    "toy_train : rang 0 : aucun pair n'a répondu en 2 s à l'étape 7, on s'arrête",
    "rank 0: the other ranks went quiet at step 7; stopping here",
    "ValueError: []",
])
def test_fail_clean_takes_any_line_the_job_wrote_as_its_report_and_shows_it(tmp_path: Path, said: str) -> None:
    """A job reports its failure in its own words: no word list decides (issue 24)."""
    status, summary, evidence = _fail_clean_on(tmp_path, f"step 7 loss 0.5\n{TQDM}\n{said}\n"
                                               "/x/train.py:9: UserWarning: slow\n  warnings.warn('slow')\n")
    assert status == "passed", summary
    assert evidence.error_line == said and f'error reported ("{said}")' in summary


@pytest.mark.parametrize("stderr", [
    "",  # a silent non-zero exit
    TQDM + "\n",  # only a progress bar
    "\x1b[31m" + TQDM + "\x1b[0m\nstep 7 loss 0.5\n/x/train.py:9: UserWarning: peers are slow\n"
    "  warnings.warn('peers are slow')\nWARNING:root:slow peers\n[W socket.cpp:464] slow\n"
    "trainguard run hook: the sampler failed (OSError: x); the job goes on\n"
    "[trainguard: 10 bytes of this log dropped here]\n",  # nothing but noise
])
def test_fail_clean_fails_an_exit_that_reported_nothing(tmp_path: Path, stderr: str) -> None:
    status, summary, evidence = _fail_clean_on(tmp_path, stderr)
    assert status == "failed"
    assert "rank 0 exited with code 1 but wrote no error to stderr after the fault" in summary
    assert "error_line" not in evidence.to_dict()


def test_the_rate_before_a_fault_is_not_fooled_by_lines_read_in_a_burst() -> None:
    """Seen under load: the lines of steps 2-10 (20 ms steps) read within 40 us of each other;
    the first-to-last span made the rate before 230 000 steps/s and a slow_rank drill failed."""
    from trainguard.launch.metrics import step_rate

    steady = [(s, 0.02 * s) for s in range(1, 31)]
    assert math.isclose(step_rate(steady) or 0, 50.0, rel_tol=1e-6)
    # a third of the lines read late, in one burst: the median time per step is still 20 ms
    burst = [(s, 0.02 * s if s % 3 else 0.02 * (s + 1) - 1e-6) for s in range(1, 31)]
    assert math.isclose(step_rate(burst) or 0, 50.0, rel_tol=0.05)  # the last line read late: 48
    # every line read at once: no rate rather than a wrong one
    assert step_rate([(s, 5.0 + 4e-6 * s) for s in range(2, 11)]) is None
    assert step_rate([(3, 1.0)]) is None
    # a line every 5 steps counts its steps
    assert math.isclose(step_rate([(5 * k, 0.1 * k) for k in range(1, 8)]) or 0, 50.0, rel_tol=1e-6)
    # seen beside two CPU hogs: a starved reader took the lines of 20 ms steps in clumps of 8 read
    # 2.4 ms apart, a clump every 160 ms; the median alone said 412 steps/s, and a slow_rank drill
    # judged its rate during the fault as 2% of that
    clumps = [(s, 0.16 * ((s - 1) // 8 + 1) + 0.0024 * ((s - 1) % 8)) for s in range(1, 31)]
    assert 40 < (step_rate(clumps) or 0) < 65  # within a clump of the truth, not 412


def test_continue_judges_the_rate_during_the_fault_and_the_faults_own_check() -> None:
    spec = DrillSpec.model_validate({"name": "n", "fault": "hang", "steps": 30, "after_step": 10,
                                     "expect": "continue", "duration": 1.0, "min_rate": 0.5})

    class Lossy(HangFault):
        def verify_continue(self, result: RunResult) -> list[str]:
            return ["3 of 30 loss values never reached the tracking store"]

    # 10 steps/s before; during [2.0, 3.0] only 2 steps: 20% of the rate before
    points = [MetricPoint("loss", s, 1.0 / s, 0, 1.0 + 0.1 * s) for s in range(1, 11)]
    points += [MetricPoint("loss", s, 1.0 / s, 0, 2.0 + 0.5 * (s - 10)) for s in range(11, 13)]
    points += [MetricPoint("loss", s, 1.0 / s, 0, 3.0 + 0.1 * (s - 12)) for s in range(13, 31)]
    fault = Lossy({}, rank=0, after_step=10, duration=1.0)
    c = _context(spec, [_result("ok", points)], injected_at=2.0, fault=fault)
    fault.cleared_at = 3.0
    c.reference.points[:] = [p for p in c.reference.points if p.rank == 0]
    status, summary, evidence = judge_continue(c)
    assert status == "failed"
    assert "the step rate during the fault fell to 20% of the rate before" in summary
    assert "3 of 30 loss values never reached the tracking store" in summary
    assert math.isclose(evidence.step_rate.during_over_before, 0.2, abs_tol=0.01)
    relaxed = spec.model_copy(update={"min_rate": 0.1})
    c.spec = relaxed
    fault.verify_continue = lambda result: []  # type: ignore[method-assign]
    status, summary, _ = judge_continue(c)
    assert status == "passed", summary


def test_a_fault_whose_own_rules_raise_still_gives_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """A fault class (ours or a plugin's) tripping over a value it did not expect: the key and
    the exception in words, never a traceback."""
    def broken(cls: type, params: Any) -> list[tuple[str, str]]:
        raise TypeError("unhashable type: 'list'")

    monkeypatch.setattr(KillRankFault, "validate", classmethod(broken))
    text = problem("{name: k, fault: kill_rank, rank: 1, after_step: 3, steps: 8, params: {x: [1]}}")
    assert "checks.drills[0].params: could not be checked (TypeError: unhashable type: 'list')" in text


def test_a_step_checkpointed_and_not_printed_before_the_kill_is_not_missing() -> None:
    """digits' train.py saves step 105, then prints it; a kill between the two leaves no line for
    105 while the next attempt resumes after it (found by the chaos soak): not a missing step.
    A step nobody printed and nobody resumed after stays missing."""
    from trainguard.drills.steps import judged_steps, unprinted_resumed_steps
    from trainguard.launch import MetricPoint, RunResult

    def attempt(steps: range) -> RunResult:
        return RunResult("failed", [], Path("."), 1, 0, [], [MetricPoint("loss", s, 1.0, 0, float(s)) for s in steps],
                         1.0, None)

    attempts = [attempt(range(1, 105)), attempt(range(106, 111)), attempt(range(110, 121))]
    assert unprinted_resumed_steps(attempts, "loss") == [105]
    compared, excused = judged_steps(attempts, "loss", 120)
    assert excused == [105] and 105 not in compared and len(compared) == 119
    gap = [attempt(range(1, 50)), attempt(range(51, 61))]  # resumed after 50: excused
    assert unprinted_resumed_steps(gap, "loss") == [50]
    hole = [attempt([*range(1, 30), *range(31, 61)])]  # one attempt skipped 30: not excused
    assert judged_steps(hole, "loss", 60)[1] == []


def test_recover_causes_follow_the_evidence() -> None:
    """After a restart that resumed from a checkpoint and then diverged (nanoGPT: no RNG state in
    ckpt.pt), the missing state comes first and "no checkpoint" is ruled out; after a restart from
    scratch, the missing checkpoint stays first."""
    from trainguard.checks.equivalence import TrajectoryDiff
    from trainguard.drills.judges import DRILL_CAUSES, recover_causes

    diverged = TrajectoryDiff(metric="loss", compared_steps=9, first_divergent_step=5, first_values=(1.0, 2.0),
                              max_abs_diff=1.0, max_rel_diff=0.5, missing_in_actual=[], missing_in_expected=[])
    resumed = recover_causes([4], diverged)
    assert resumed[0].startswith("state missing from the checkpoint") and "--only resume" in resumed[0]
    assert not any(c.startswith("no checkpoint") for c in resumed)
    scratch = recover_causes([0], diverged)
    assert scratch == list(DRILL_CAUSES["recover"])


def test_a_rank_dying_of_the_notice_while_the_teardown_signals_it_still_died_of_the_notice() -> None:
    """CI: rank 0 died of the notice, the teardown marked rank 1 (dying too, not yet reaped) as
    killed by trainguard, and the judge said [0]. The fault's record of whom it signalled decides."""
    from trainguard.drills.save_and_exit import died_of_the_notice
    from trainguard.faults.preempt import SignalSent

    sent = [SignalSent("SIGTERM", 0.0, [0, 1])]
    exits = [RankExit(0, 10, -15, "SIGTERM"), RankExit(1, 11, -15, "SIGTERM", killed_by_trainguard=True)]
    assert died_of_the_notice(exits, sent, killed=[]) == [0, 1]
    # a rank the notice never reached and the teardown ended is not counted; nor one killed at grace
    assert died_of_the_notice(exits, [SignalSent("SIGTERM", 0.0, [0])], killed=[]) == [0]
    killed = [RankExit(0, 10, -15, "SIGTERM"), RankExit(1, 11, -9, "SIGKILL", killed_by_trainguard=True)]
    assert died_of_the_notice(killed, sent, killed=[1]) == [0]
    assert died_of_the_notice([RankExit(0, 10, 0), RankExit(1, 11, 0)], sent, killed=[]) == []


def test_the_first_exit_is_noted_even_when_the_attempt_ended_before_the_watch_polled() -> None:
    """Golden toy, under load: the killed rank's exit ended the attempt and the watch was stopped
    before its next poll, so the report lost `first_exit` and the exit time. The watch's last
    look notes it, at the time the launcher saw it."""
    import signal as _signal
    import time as _time
    from types import SimpleNamespace

    from trainguard.drills.driver import Driver

    spec = load('{name: f, fault: kill_rank, rank: 1, expect: fail_clean}').checks.drills[0]
    driver = Driver(KillRankFault(spec.fault_params, rank=1, after_step=spec.after_step), spec, "loss", 0)
    codes = {0: -_signal.SIGTERM, 1: -_signal.SIGKILL}
    ranks = [SimpleNamespace(rank=r, popen=SimpleNamespace(poll=lambda r=r: codes[r])) for r in (0, 1)]
    launcher = SimpleNamespace(ranks=ranks, exit_seen_at={1: 2.5, 0: 2.6}, elapsed=lambda: 9.0)
    driver.info.injected_mono = _time.monotonic()
    driver._stop.set()  # the attempt was over before the watch's first poll
    driver._watch(launcher)  # type: ignore[arg-type]
    assert driver.info.first_exit == (1, -_signal.SIGKILL, 2.5)


def test_a_fault_on_what_every_rank_shares_strikes_once_every_rank_printed_after_step(tmp_path: Path) -> None:
    """CI, under load: a storage drill struck after rank 0's step 7 while rank 1, with no barrier,
    was still writing its step-5 checkpoint; the EIO hit that save, nothing was left to resume
    from, and a correct atomic writer was told it overwrites in place. A fault that strikes every
    rank waits for every reporting rank; one aimed at a rank waits for that rank alone."""
    from types import SimpleNamespace

    from trainguard.drills.driver import Driver
    from trainguard.faults.base import Fault
    from trainguard.launch import MetricPoint

    class _Struck(Fault):
        kind = "struck-test"

        def inject(self, launcher: object) -> None:
            self.injected_at = 1.0

    class _Shared(_Struck):
        strikes_every_rank = True

    spec = load('{name: f, fault: kill_rank, rank: 0, after_step: 7}').checks.drills[0]
    ranks = [SimpleNamespace(rank=r, popen=SimpleNamespace(poll=lambda: None), stderr_log=tmp_path / f"r{r}")
             for r in (0, 1)]
    launcher = SimpleNamespace(spec=SimpleNamespace(restart_count=0, run_dir=tmp_path), ranks=ranks,
                               elapsed=lambda: 1.0, exit_seen_at={})
    for cls, rank1_needed in ((_Shared, True), (_Struck, False)):
        fault = cls({}, rank=0, after_step=7)
        driver = Driver(fault, spec, "loss", 0, wait_for=(0, 1) if cls.strikes_every_rank else ())
        try:
            for rank, step in ((1, 5), (0, 7), (0, 8)):
                driver.on_metric(MetricPoint("loss", step, 1.0, rank=rank, t=0.0), launcher)  # type: ignore[arg-type]
            assert (driver.info.injected_mono is None) is rank1_needed
            driver.on_metric(MetricPoint("loss", 7, 1.0, rank=1, t=0.0), launcher)  # type: ignore[arg-type]
            # the watched rank's progress when it struck: step 8 (shared), 7 (rank 0's own)
            assert driver.info.injected_step == (8 if rank1_needed else 7)
        finally:
            driver.finish()


def test_a_fault_whose_target_was_gone_because_the_run_finished_came_too_late() -> None:
    """Ray's state showed no live run: it had finished while the fault looked for rank 1's
    worker. That is a fault that came too late, not one that cannot be injected."""
    finished = [_result("ok", _points(range(1, 13)))]
    context = _context(KILL, finished)
    context.info.inject_failed = "WorkerNotHere: no live Train run named 'toy' (runs: [('toy', 'FINISHED')])"
    status, summary, _ = judge_recover(context)
    assert status == "error" and summary.startswith("the fault came too late to test anything: the run had "
                                                    "finished while it looked for its target after step 6")
    # a run still going when the lookup failed: the fault itself could not be injected
    running = _context(KILL, [_result("failed", _points(range(1, 8)), failed_rank=0)])
    running.info.inject_failed = "WorkerNotHere: no worker of rank 1"
    assert judge_recover(running)[1].startswith("the fault could not be injected after step 6")


def test_fail_clean_on_a_job_that_trained_through_the_fault_blames_no_checkpoint(tmp_path: Path) -> None:
    """On an H200 an OOM drill's job trained on to its last step: the verdict said so, and then
    resumed from its final checkpoint, read no line and blamed "a checkpoint overwritten in
    place". A job that completed has no resume to verify."""
    (tmp_path / "rank0.stderr.log").write_text("")
    done = _result("ok", _points(range(1, 13)), run_dir=tmp_path)
    runner = _VerifyRunner(_result("ok", []))
    runner.job_file = SimpleNamespace(job=SimpleNamespace(max_restarts=0))  # type: ignore[attr-defined]
    runner.backend = CommandBackend()  # type: ignore[attr-defined]
    status, summary, evidence = judge_fail_clean(_context(FAIL, [done], runner=runner))
    assert status == "failed" and "the job completed (exit 0) despite the fault" in summary, summary
    assert runner.calls == [] and "overwritten" not in summary and "no `loss` line" not in summary
    from trainguard.drills.judges import DRILL_CAUSES

    assert evidence.likely_causes[0] == DRILL_CAUSES["fail_clean"][1]
