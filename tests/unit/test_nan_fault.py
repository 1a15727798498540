"""The ``nan`` fault without a drill run: its parameters in the job file, the start-up hook in a
real Python process with torch (loss function, loss by hand, gradients), and the
``handle_nonfinite`` verdict on recorded attempts. The drills on real DDP ranks are in
tests/distributed/test_nan_drill.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from trainguard.config import DrillSpec, parse_config
from trainguard.config.fault_params import FaultParams
from trainguard.drills.driver import make_drill
from trainguard.drills.judges import DrillContext, Injection
from trainguard.drills.nonfinite import judge_handle_nonfinite, must_stop
from trainguard.errors import ConfigError
from trainguard.faults.hook import read_events
from trainguard.faults.nan import NanFault
from trainguard.launch import MetricPoint, RankExit, RunResult
from trainguard.launch.backend import CommandBackend
from trainguard.launch.hook import hook_env
from trainguard.run.request import RunRequest
from trainguard.run.runner import SupervisedRun

HEAD = r"""
job:
  name: toy
  command: "python train.py --steps {steps}"
  world_size: 2
  metrics: {loss: 'step (?P<step>\d+) loss (?P<value>\S+)'}
checks:
  drills:
"""


def load(*entries: str) -> Any:
    return parse_config(HEAD + "".join(f"    - {e}\n" for e in entries), path="/jobs/t.trainguard.yaml")


def problem(*entries: str) -> str:
    with pytest.raises(ConfigError) as info:
        load(*entries)
    return str(info.value)


# -- the job file --------------------------------------------------------------------------------


def test_defaults_need_no_resume_args_and_stop_by_the_deadline() -> None:
    stop, skip = load("{name: a, fault: nan, rank: 1}",
                      "{name: b, fault: nan, params: {policy: skip, target: grads, value: .inf}}").checks.drills
    assert (stop.expectation, stop.restart_limit, stop.deadline_s, must_stop(stop)) == ("handle_nonfinite", 0, 60.0, True)
    assert not must_stop(skip)
    fault = NanFault(skip.fault_params)
    assert (fault.policy, fault.target, fault.value) == ("skip", "grads", "inf")
    assert NanFault().params == FaultParams({"policy": "stop", "target": "loss", "value": "nan"})


@pytest.mark.parametrize(
    ("entry", "expected"),
    [
        ("{name: a, fault: nan, params: {policy: continue}}",
         "checks.drills[0].params.policy: expected one of stop, skip, got 'continue'; e.g. `policy: skip`"),
        ("{name: a, fault: nan, params: {target: weights}}",
         "checks.drills[0].params.target: expected one of loss, grads, got 'weights'"),
        ("{name: a, fault: nan, params: {value: 1e9}}",
         "checks.drills[0].params.value: expected one of nan, inf, -inf, got '1e9'; e.g. `value: inf`"),
        ("{name: a, fault: nan, params: {polcy: skip}}",
         "checks.drills[0].params.polcy: unknown parameter for fault 'nan'; expected one of policy, target, value"),
        ("{name: a, fault: nan, deadline: 5, params: {policy: skip}}",
         "deadline applies to `params.policy: stop`"),
        ("{name: a, fault: nan, min_rate: 0.5}", "min_rate does not apply to `expect: handle_nonfinite`"),
        ("{name: a, fault: kill_rank, expect: handle_nonfinite}",
         "`expect: handle_nonfinite` judges a nan drill; for a kill_rank drill use recover, fail_clean or continue"),
        ("{name: a, fault: nan, rank: 2}", "checks.drills[0].rank: rank 2 does not exist in a run of 2 rank(s)"),
    ],
)
def test_each_bad_nan_drill_names_the_key_and_the_fix(entry: str, expected: str) -> None:
    assert expected in problem(entry)


def test_make_drill_takes_the_faults_params_as_keywords() -> None:
    jf = load("{name: a, fault: nan}")
    spec = make_drill(jf, {"name": "t", "fault": "nan", "rank": 1, "policy": "skip", "value": "inf", "steps": 8})
    assert (spec.after_step, spec.params) == (4, {"policy": "skip", "value": "inf"})
    with pytest.raises(ConfigError, match=r"drill.params.target: expected one of loss, grads"):
        make_drill(jf, {"name": "t", "fault": "nan", "target": "activations"})


# -- the start-up hook in a real process ---------------------------------------------------------

SCRIPT = textwrap.dedent("""
    import os, sys, torch
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    criterion = torch.nn.CrossEntropyLoss()
    for step in range(1, 6):
        if step == 3:
            open(os.environ["TRIGGER"], "w").close()  # the drill pulls it after step 2
        out = model(x)
        loss = ((out - 1) ** 2).mean() if sys.argv[1] == "hand" else criterion(out, y)
        before = loss.item()
        opt.zero_grad()
        loss.backward()
        grad = model.weight.grad.abs().sum().item()
        with torch.no_grad():
            torch.nn.functional.cross_entropy(model(x), y)  # an evaluation: never hit
        opt.step()
        print(step, before, grad, flush=True)
""")


def _run_hooked(tmp_path: Path, case: str, target: str, value: str, rank: str = "1") -> subprocess.Popen[str]:
    work = tmp_path / case
    work.mkdir()
    (work / "train.py").write_text(SCRIPT)
    spec = {"fault": "nan", "rank": 1, "trigger": str(work / "trigger"), "events": str(work / "events.jsonl"),
            "step": 2, "target": target, "value": value}
    env = {**os.environ, **hook_env(spec), "RANK": rank, "TRIGGER": str(work / "trigger")}
    return subprocess.Popen([sys.executable, "train.py", case], cwd=work, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _lines(proc: subprocess.Popen[str]) -> list[tuple[float, float]]:
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    return [(float(b), float(g)) for _, b, g in (line.split() for line in out.splitlines())]


def _finite(value: float) -> bool:
    return value == value and abs(value) != float("inf")


def _injected(work: Path, via: str) -> None:
    events = read_events(work / "events.jsonl")
    injected = [e for e in events if e["event"] == "injected"]
    assert len(injected) == 1 and injected[0]["via"].startswith(via), events
    assert injected[0]["step"] == 3 and injected[0]["rank"] == "1"


def test_the_hook_puts_a_nan_into_the_loss_a_loss_module_computes(tmp_path: Path) -> None:
    lines = _lines(_run_hooked(tmp_path, "module", "loss", "nan"))
    # CrossEntropyLoss's result at step 3 is NaN (a check of the loss before backward sees it),
    # and so is every gradient; the NaN weights keep every later loss NaN; the evaluation under
    # no_grad was never hit
    assert all(_finite(b) and _finite(g) for b, g in lines[:2])
    assert all(not _finite(b) for b, _ in lines[2:]) and not _finite(lines[2][1])
    _injected(tmp_path / "module", "torch.nn.functional.cross_entropy")


@pytest.mark.slow
def test_the_hook_fills_the_gradients_and_takes_a_loss_by_hand_at_backward_in_its_rank_only(tmp_path: Path) -> None:
    procs = {case: _run_hooked(tmp_path, case, target, value) for case, target, value in
             [("grads", "grads", "inf"), ("hand", "loss", "nan")]}
    other = _run_hooked(tmp_path, "other-rank", "loss", "nan", rank="0")
    lines = {case: _lines(proc) for case, proc in procs.items()}
    # grads: the loss of step 3 is finite, its gradients are not
    assert _finite(lines["grads"][2][0]) and not _finite(lines["grads"][2][1])
    assert not _finite(lines["grads"][3][0])
    # a loss computed by hand takes it at backward(): the value printed before it is finite
    assert _finite(lines["hand"][2][0]) and not _finite(lines["hand"][2][1])
    assert all(_finite(b) and _finite(g) for b, g in _lines(other))  # rank 0 is not the target
    _injected(tmp_path / "grads", "backward (parameter gradients")
    _injected(tmp_path / "hand", "backward (a loss computed by hand)")
    assert not (tmp_path / "other-rank" / "events.jsonl").exists()


# -- the verdict on recorded attempts ------------------------------------------------------------


class _Injected(NanFault):
    """The hook's event, as the recorded run would have left it."""

    def __init__(self, params: dict[str, Any], event: dict[str, Any] | None) -> None:
        super().__init__(FaultParams(params), rank=1, after_step=3)
        self.event = event

    def injection(self) -> dict[str, Any] | None:
        return self.event


def _points(values: dict[int, list[float]]) -> list[MetricPoint]:
    return [MetricPoint("loss", s, v, r, 1.0 + 0.1 * s) for r, vs in values.items() for s, v in enumerate(vs, 1)]


def _result(outcome: str, points: list[MetricPoint], codes: tuple[int, int], run_dir: Path) -> RunResult:
    exits = [RankExit(r, 100 + r, c, None) for r, c in enumerate(codes)]
    return RunResult(outcome, ["python"], run_dir, 2, 0, exits, points, 5.0, 1.0,  # type: ignore[arg-type]
                     reason="" if outcome == "ok" else "rank 1 exited with code 1",
                     failed_rank=None if outcome == "ok" else 1, evidence={})


def _judge(params: dict[str, Any], attempt: RunResult, *, first_exit: tuple[int, int, float] | None = None,
           event: dict[str, Any] | None = None, reference: list[MetricPoint] | None = None) -> tuple[str, str, dict]:
    spec = DrillSpec.model_validate({"name": "n", "fault": "nan", "rank": 1, "steps": 8, "after_step": 3,
                                     "deadline": 5, "params": params} if params.get("policy") != "skip" else
                                    {"name": "n", "fault": "nan", "rank": 1, "steps": 8, "after_step": 3,
                                     "params": params})
    fault = _Injected(params, {"event": "injected", "step": 4, "via": "torch.nn.functional.mse_loss"}
                      if event is None else event)
    fault.injected_at = 1.32
    info = Injection(watch_rank=1, injected_step=3, first_exit=first_exit)
    ref = _result("ok", reference or _points({0: [1.0] * 8, 1: [1.0] * 8}), (0, 0), attempt.run_dir)
    c = DrillContext(RUNNER, spec, fault, info, SupervisedRun([attempt], Path("/x"), Path("/nonexistent")),  # type: ignore[arg-type]
                     ref, RunRequest.make(steps=8, seed=0, world_size=2), "loss", Path("/nonexistent"), 5.0)
    return judge_handle_nonfinite(c)


NAN = float("nan")
#: what the judge reads of the runner: how the job's ranks run, its restart budget
RUNNER = SimpleNamespace(backend=CommandBackend(), job_file=SimpleNamespace(job=SimpleNamespace(max_restarts=0)))


def test_stop_passes_on_a_prompt_error_and_names_the_step_and_rank(tmp_path: Path) -> None:
    (tmp_path / "rank1.stderr.log").write_text("FloatingPointError: non-finite loss at step 4\n")
    attempt = _result("failed", _points({0: [1.0] * 3, 1: [1.0] * 3}), (-15, 1), tmp_path)
    status, summary, evidence = _judge({"policy": "stop"}, attempt, first_exit=(1, 1, 2.5))
    assert status == "passed", summary
    assert summary.startswith("nan put into rank 1's loss at step 4 (via torch.nn.functional.mse_loss")
    assert "rank 1 exited with an error 1.18 s after the fault" in summary
    assert evidence.numerics.to_dict()["put_into"] == {"rank": 1, "step": 4, "target": "loss", "value": "nan",
                                                "via": "torch.nn.functional.mse_loss"}


def test_stop_fails_a_job_that_trains_on_and_a_silent_exit(tmp_path: Path) -> None:
    trained_on = _points({0: [1.0] * 4 + [NAN] * 4, 1: [1.0] * 3 + [NAN] * 5})
    status, summary, evidence = _judge({"policy": "stop"}, _result("ok", trained_on, (0, 0), tmp_path))
    assert status == "failed"
    assert "the job did not stop: it completed (exit 0); it trained on after the non-finite value: 8 of 8 " \
           "later metric value(s) non-finite (steps 5..8 on ranks 0, 1)" in summary
    assert "the nan put into rank 1 reached every rank (first non-finite metric: rank 0 at step 5, " \
           "rank 1 at step 4)" in summary
    assert evidence.likely_causes[0].startswith("no check for non-finite values")
    (tmp_path / "rank1.stderr.log").write_text("")
    silent = _result("failed", _points({0: [1.0] * 3, 1: [1.0] * 3}), (-15, 1), tmp_path)
    status, summary, evidence = _judge({"policy": "stop"}, silent, first_exit=(1, 1, 2.0))
    assert status == "failed" and "rank 1 exited with code 1 but wrote no error to stderr" in summary
    assert evidence.likely_causes[0].startswith("the job stops without saying why")


def test_skip_passes_when_every_later_value_is_finite_and_fails_on_a_spread(tmp_path: Path) -> None:
    skipped = _points({0: [1.0] * 8, 1: [1.0] * 3 + [NAN] + [1.0] * 4})
    status, summary, evidence = _judge({"policy": "skip"}, _result("ok", skipped, (0, 0), tmp_path))
    assert status == "passed", summary
    assert "the job went on to step 8 and all 8 metric value(s) after step 4 are finite" in summary
    assert evidence.numerics.to_dict()["first_nonfinite"] == {"step": 4, "rank": 1, "metric": "loss", "value": "nan"}
    # a NaN gradient of rank 1 (its loss finite at step 4) is in every rank's loss from step 5 on
    spread = _points({0: [1.0] * 4 + [NAN] * 4, 1: [1.0] * 4 + [NAN] * 4})
    grads = {"event": "injected", "step": 4, "via": "backward (parameter gradients)"}
    status, summary, evidence = _judge({"policy": "skip", "target": "grads"}, _result("ok", spread, (0, 0), tmp_path),
                                       event=grads)
    assert status == "failed"
    assert "every later metric must be finite, but it trained on after the non-finite value" in summary
    assert "nan put into rank 1's gradients at step 4" in summary and "reached every rank" in summary
    assert evidence.numerics.reached_every_rank is True
    assert evidence.likely_causes[0].startswith("the check reads only the loss")


def test_skip_fails_a_job_that_stops_and_nothing_is_judged_without_the_value_in(tmp_path: Path) -> None:
    (tmp_path / "rank1.stderr.log").write_text("FloatingPointError\n")
    stopped = _result("failed", _points({0: [1.0] * 3, 1: [1.0] * 3}), (-15, 1), tmp_path)
    status, summary, evidence = _judge({"policy": "skip"}, stopped, first_exit=(1, 1, 2.0))
    assert status == "failed" and "the job did not go on after the nan" in summary
    assert evidence.likely_causes[0].startswith("the job stops on a non-finite value where it should skip")
    status, summary, _ = _judge({"policy": "skip"}, _result("ok", _points({0: [1.0] * 8, 1: [1.0] * 8}), (0, 0),
                                                             tmp_path), event={})
    assert status == "passed"  # an event without a step: the first step after the trigger
    status, summary, _ = _judge({"policy": "stop"}, stopped, reference=_points({0: [1.0, NAN], 1: [1.0, 1.0]}))
    assert status == "error" and "the uninterrupted run printed non-finite values by itself" in summary


def test_no_injection_event_is_an_error_not_a_verdict(tmp_path: Path) -> None:
    class Never(_Injected):
        def injection(self) -> dict[str, Any] | None:
            return None

    spec = DrillSpec.model_validate({"name": "n", "fault": "nan", "rank": 1, "steps": 8, "after_step": 3})
    fault = Never({}, None)
    fault.injected_at = 1.32
    attempt = _result("ok", _points({0: [1.0] * 8, 1: [1.0] * 8}), (0, 0), tmp_path)
    c = DrillContext(None, spec, fault, Injection(watch_rank=1, injected_step=3),  # type: ignore[arg-type]
                     SupervisedRun([attempt], Path("/x"), Path("/nonexistent")), attempt,
                     RunRequest.make(steps=8, seed=0, world_size=2), "loss", Path("/nonexistent"), 5.0)
    status, summary, _ = judge_handle_nonfinite(c)
    assert status == "error" and "the nan was never put in after step 3" in summary
    assert json.dumps(NanFault().evidence().to_dict())  # the evidence is JSON before setup too
