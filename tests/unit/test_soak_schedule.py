"""The chaos soak's schedule and parameters (no run): the same seed gives the same faults, the
spacing rules hold for every seed, bad parameters are named, and the seed's spellings resolve."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trainguard.config import load_config
from trainguard.config.fault_params import FaultParams
from trainguard.config.settings import resolve
from trainguard.errors import ConfigError
from trainguard.faults.soak import SOAK_KINDS, SoakFault, soak_schedule, soak_seeds
from trainguard.profiling.goodput import wall_clock_s

KINDS = st.lists(st.sampled_from(SOAK_KINDS), min_size=1, max_size=4, unique=True)


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), steps=st.integers(8, 400), world=st.integers(1, 8),
       kinds=KINDS, every=st.floats(0.5, 50), gap=st.integers(1, 6))
def test_a_rate_schedule_is_a_function_of_its_seed_and_keeps_its_spacing(
        seed: int, steps: int, world: int, kinds: list[str], every: float, gap: int) -> None:
    events = soak_schedule(seed, steps, world, kinds=kinds, every_steps=every, min_gap=gap)
    assert events == soak_schedule(seed, steps, world, kinds=kinds, every_steps=every, min_gap=gap)
    triggers = [e.step for e in events]
    assert all(b - a >= gap for a, b in itertools.pairwise(triggers))
    assert all(gap <= t <= steps - gap for t in triggers)
    assert all(e.kind in kinds and 0 <= e.rank < world for e in events)
    assert [e.index for e in events] == list(range(len(events)))


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), steps=st.integers(10, 300), faults=st.integers(1, 20),
       gap=st.integers(1, 5))
def test_a_counted_schedule_holds_exactly_that_many_faults_or_says_why_not(
        seed: int, steps: int, faults: int, gap: int) -> None:
    fits = steps - gap - gap * faults >= 0
    if not fits:
        with pytest.raises(ValueError, match="do not fit"):
            soak_schedule(seed, steps, 2, faults=faults, min_gap=gap)
        return
    events = soak_schedule(seed, steps, 2, faults=faults, min_gap=gap)
    triggers = [e.step for e in events]
    assert len(events) == faults
    assert all(b - a >= gap for a, b in itertools.pairwise(triggers))
    assert gap <= triggers[0] and triggers[-1] <= steps - gap


def test_seeds_differ_and_the_rate_sets_the_count() -> None:
    schedules = {tuple((e.kind, e.rank, e.step) for e in soak_schedule(s, 200, 2, kinds=["kill_rank", "preempt"]))
                 for s in range(20)}
    assert len(schedules) == 20
    counts = [len(soak_schedule(s, 1000, 2, every_steps=20)) for s in range(30)]
    # a Poisson process of mean 20 steps (at least 3 apart) in 997 steps: about 45 faults
    assert 35 < sum(counts) / len(counts) < 55


def test_the_schedule_is_the_same_in_another_interpreter(tmp_path: Path) -> None:
    """String seeds of random.Random are hashed with SHA-512, not Python's salted hash()."""
    import subprocess
    import sys

    code = ("from trainguard.faults.soak import soak_schedule; "
            "print([(e.kind, e.rank, e.step) for e in soak_schedule(7, 120, 4, kinds=['kill_rank', 'hang'])])")
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                           env={"PYTHONHASHSEED": str(h), "PATH": "/usr/bin:/bin"}).stdout for h in (1, 2)}
    assert len(outs) == 1
    assert outs.pop().strip() == str([(e.kind, e.rank, e.step)
                                      for e in soak_schedule(7, 120, 4, kinds=["kill_rank", "hang"])])


@pytest.mark.parametrize(("params", "key", "words"), [
    ({"kinds": ["nan"]}, "kinds", "fault kinds from"),
    ({"kinds": []}, "kinds", "fault kinds from"),
    ({"seed": -1}, "seed", "between 0 and"),
    ({"seed": True}, "seed", "between 0 and"),
    ({"seeds": [1, "x"]}, "seeds", "list of seeds"),
    ({"every_steps": 0}, "every_steps", "mean number of steps"),
    ({"every_steps": 5, "faults": 2}, "faults", "not both"),
    ({"faults": 0}, "faults", "from 1 to"),
    ({"min_gap": 0}, "min_gap", ">= 1"),
    ({"ranks": [-1]}, "ranks", "list of ranks"),
    ({"fault_params": {"preempt": {"grace": 5}}}, "fault_params.preempt", "not among `kinds`"),
    ({"kinds": ["preempt"], "fault_params": {"preempt": {"style": "nope"}}}, "fault_params.preempt.style", ""),
    ({"bogus": 1}, "bogus", "unknown parameter"),
])
def test_bad_parameters_are_named(params: dict[str, object], key: str, words: str) -> None:
    problems = dict(SoakFault.validate(FaultParams(params)))
    assert key in problems, problems
    assert words in problems[key]


def _job(tmp_path: Path, drill: str) -> Path:
    path = tmp_path / "soak.trainguard.yaml"
    path.write_text(
        "job:\n  name: soak\n  command: \"python train.py --ckpt-dir {checkpoint_dir}\"\n"
        "  resume_args: \"--resume\"\n  world_size: 2\n"
        "  metrics: {loss: 'step (?P<step>\\d+) loss (?P<value>\\S+)'}\n"
        f"checks:\n  drills:\n    - {drill}\n")
    return path


@pytest.mark.parametrize(("drill", "words"), [
    ("{name: s, fault: soak, steps: 20, params: {faults: 9}}", "do not fit in 20 steps"),
    ("{name: s, fault: soak, expect: fail_clean}", "judged by recover, not fail_clean"),
    ("{name: s, fault: soak, rank: 3}", "rank 3 does not exist"),
    ("{name: s, fault: soak, params: {kinds: [oom]}}", "checks.drills[0].params.kinds"),
])
def test_a_job_file_with_a_bad_soak_is_an_error_naming_the_key(tmp_path: Path, drill: str, words: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(_job(tmp_path, drill))
    assert words in str(err.value)


def test_the_soak_seed_setting_wins_over_the_job_file_seeds() -> None:
    assert soak_seeds(FaultParams({"seeds": [3, 4, 3]}), None) == [3, 4]
    assert soak_seeds(FaultParams({"seed": 9}), None) == [9]
    assert soak_seeds(FaultParams({}), None) == [0]
    assert soak_seeds(FaultParams({"seeds": [3, 4]}), 11) == [11]
    assert resolve(environ={"TRAINGUARD_SOAK_SEED": "12"}).soak_seed == 12
    assert resolve(cli={"soak_seed": "13"}, environ={"TRAINGUARD_SOAK_SEED": "12"}).soak_seed == 13
    assert resolve(ini={"soak_seed": "14"}, environ={}).soak_seed == 14
    with pytest.raises(ConfigError, match="TRAINGUARD_SOAK_SEED"):
        resolve(environ={"TRAINGUARD_SOAK_SEED": "-3"})


def test_the_forecast_for_faults_that_occurred_is_the_models_wall_clock() -> None:
    """forecast_for (given n faults) and wall_clock_s (given an MTBF) are one model: n faults in
    W seconds is an MTBF of W / n, and the fixed point of wall_clock_s is forecast_for's W."""
    from trainguard.drills.soak import forecast_for

    work, restart, interval, faults = 100.0, 4.0, 2.0, 5
    predicted = forecast_for(work, [restart] * faults, interval)["wall_s"]
    # the saves are part of the failure-free work here (save_s 0 in wall_clock_s)
    assert wall_clock_s(work, interval, 0.0, predicted / faults, restart) == pytest.approx(predicted)


class _Struck:
    """A fault that only records that it was injected (the driver's bookkeeping is tested)."""

    injected_at: float | None = None

    def inject(self, launcher: object) -> None:
        self.hits = getattr(self, "hits", 0) + 1


def test_the_resume_is_read_from_the_rank_the_fault_was_timed_by() -> None:
    """Ranks that never wait for each other drift apart: the killed rank 1 was 4 steps behind
    rank 0 (seen at load ~5) and, restarted, printed its step 11 before rank 0 printed its 16.
    The resume (and the steps lost) is rank 0's: it resumed after step 15."""
    from types import SimpleNamespace

    from trainguard.drills.soak import FaultRecord, SoakDriver
    from trainguard.faults.soak import SoakEvent
    from trainguard.launch.metrics import MetricPoint

    fault = _Struck()
    record = FaultRecord(SoakEvent(0, "kill_rank", 1, 15), fault)  # type: ignore[arg-type]
    driver = SoakDriver([record], "loss", watch_rank=0, min_gap=4)

    def line(attempt: int, rank: int, step: int) -> None:
        launcher = SimpleNamespace(spec=SimpleNamespace(restart_count=attempt), elapsed=lambda: 0.0)
        driver.on_metric(MetricPoint("loss", step, 1.0, rank, 0.0), launcher)  # type: ignore[arg-type]

    line(0, 1, 11)
    line(0, 0, 15)  # the fault's step, on the watched rank: struck
    assert record.injected_step == 15 and fault.hits == 1
    line(1, 1, 11)  # the laggard, restarted from its own older checkpoint, prints first
    assert record.first_new_step is None
    line(1, 0, 16)
    assert record.first_new_step == 16  # resumed after step 15
