"""Stragglers named (issue 46): the run agent's step clocks and the relative, persistent judgement
on them (trainguard.launch.pace, docs/drills.md "Stragglers")."""

from __future__ import annotations

import itertools
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from trainguard.launch.hook import ENV_RUN_SPEC, ENV_SPEC, PACE_DIR, run_hook_env
from trainguard.launch.pace import StepClock, judge_pace, judged_pace, read_pace, run_pace

STEPS = 60


def _clocks(want: list[float], wall: list[float], cpu_share: float = 0.3) -> list[StepClock]:
    """A rank's step clocks from its CPU-wanting seconds and the wall seconds of each step
    (``cpu_share`` of the wanted time is CPU time, the rest run-queue wait)."""
    cpu = delay = t = 0.0
    out = [StepClock(cpu, delay, t)]
    for w, s in zip(want, wall, strict=True):
        cpu += w * cpu_share
        delay += w * (1 - cpu_share)
        t += s
        out.append(StepClock(cpu, delay, t))
    return out


def _job(world: int, slow: dict[int, float], *, load: float = 1.0, seed: int = 0,
         eval_every: int = 0) -> dict[int, list[StepClock]]:
    """Synchronous steps: each rank wants ``base x load x slowdown`` (jittered) of the CPU; every
    step's wall is the slowest rank's want plus the collective. ``eval_every``: rank 0 alone
    works 10x longer every N steps."""
    rng = random.Random(seed)
    wants = {r: [] for r in range(world)}  # type: dict[int, list[float]]
    walls = []
    for step in range(1, STEPS + 1):
        for r in range(world):
            w = 0.15 * load * slow.get(r, 1.0) * rng.uniform(0.85, 1.15)
            if eval_every and r == 0 and step % eval_every == 0:
                w *= 10
            wants[r].append(w)
        walls.append(max(wants[r][-1] for r in range(world)) + 0.01 * load)
    return {r: _clocks(wants[r], walls) for r in range(world)}


def test_a_rank_half_again_as_slow_is_named_with_its_ratio_and_the_step_it_was_named_at() -> None:
    report = judge_pace(_job(4, {2: 1.5}))
    assert [r.rank for r in report.stragglers] == [2]
    row = report.ranks[2]
    assert 1.3 < row.ratio < 1.7
    assert row.named_at_step == 43  # the end of the second window of 20 steps after the warm-up
    assert report.slowest is row
    assert "rank 2 1." in report.summary() and "as busy as the others" in report.summary()


def test_an_even_job_names_no_straggler_even_on_a_loaded_machine() -> None:
    for load in (1.0, 4.0, 8.0):
        for seed in range(5):
            report = judge_pace(_job(3, {}, load=load, seed=seed))
            assert report.windows == 2
            assert report.stragglers == (), report.summary()
            assert "none over 10%" in report.summary()


def test_rank_0s_periodic_evaluation_is_reported_apart_not_as_a_straggler() -> None:
    report = judge_pace(_job(2, {}, eval_every=10))
    assert report.stragglers == ()
    assert [(w.rank, w.steps[:3]) for w in report.single_rank_work] == [(0, (8, 18, 28))]
    assert "single-rank work, not a straggler" in report.summary()
    # the same job without the evaluation reports no single-rank work
    assert judge_pace(_job(2, {})).single_rank_work == ()


def test_a_slowdown_in_one_window_only_is_not_persistent() -> None:
    clocks = _job(2, {})
    slow = _job(2, {1: 2.0})
    # rank 1 slow only in the steps of the middle window: 1 window of 3 is not persistent
    mixed = {r: clocks[r][:23] for r in clocks}
    for r in mixed:
        base = mixed[r][-1]
        start = slow[r][23]
        for c in slow[r][23:43]:
            mixed[r].append(StepClock(base.cpu + c.cpu - start.cpu, base.delay + c.delay - start.delay,
                                      base.wall + c.wall - start.wall))
    assert judge_pace(mixed).stragglers == ()
    assert [r.rank for r in judge_pace(_job(2, {1: 2.0})).stragglers] == [1]


def test_too_few_steps_or_one_rank_is_not_judged() -> None:
    short = {r: c[:15] for r, c in _job(2, {1: 2.0}).items()}
    assert judge_pace(short).stragglers == ()
    assert "not judged" in judge_pace(short).summary()
    assert judge_pace({0: _job(1, {})[0]}).windows == 0
    assert "no step clocks" in judge_pace({}).summary()


def test_the_files_are_read_bounded_and_a_torn_line_ends_a_ranks_clocks(tmp_path: Path) -> None:
    pace = tmp_path / PACE_DIR
    pace.mkdir()
    (pace / "rank0.txt").write_text("1.0 0.5 10.0\n2.0 0.5 11.0\n3.0 0")
    (pace / "rank1.txt").write_text("1.0 0.5 10.0\nnan 1 2\n4.0 0.5 12.0\n")
    (pace / "rankx.txt").write_text("1 2 3\n")
    os.mkfifo(pace / "rank2.txt")  # a FIFO in the run folder is refused, never waited on
    clocks = read_pace(pace)
    assert sorted(clocks) == [0, 1]
    assert len(clocks[0]) == 2 and len(clocks[1]) == 1
    assert run_pace(tmp_path / "absent").ranks == ()


_LOOP = textwrap.dedent(
    """
    import time, torch
    m = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    for step in range(25):
        m(torch.ones(2, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
        if step == 10:
            time.sleep(0.2)
    """
)


@pytest.mark.slow  # a torch process (seconds); the default run's check is in test_step_agent.py
def test_the_agent_writes_one_line_per_optimizer_step_with_the_threads_clocks(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in (ENV_SPEC, ENV_RUN_SPEC, "PYTHONPATH", "RANK")}
    env.update({"OMP_NUM_THREADS": "1", "RANK": "3"})
    env.update(run_hook_env({"pace_dir": str(tmp_path / PACE_DIR)}, env))
    done = subprocess.run([sys.executable, "-c", _LOOP], env=env, capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0 and "trainguard run hook" not in done.stderr, done.stderr
    clocks = read_pace(tmp_path / PACE_DIR)[3]
    assert len(clocks) == 25  # 20 written by the buffer, the last 5 at exit
    walls = [b.wall - a.wall for a, b in itertools.pairwise(clocks)]
    cpus = [b.cpu - a.cpu for a, b in itertools.pairwise(clocks)]
    assert walls[10] >= 0.2 and cpus[10] < 0.15  # the sleep: wall time, not CPU time
    assert all(c.delay >= 0 for c in clocks)


def test_a_runs_evidence_gains_pace_only_when_a_straggler_or_single_rank_work_is_found(tmp_path: Path) -> None:
    def write(directory: Path, clocks: dict[int, list[StepClock]]) -> Path:
        directory.mkdir(parents=True)
        for rank, lines in clocks.items():
            (directory / f"rank{rank}.txt").write_text("".join(f"{c.cpu:.6f} {c.delay:.6f} {c.wall:.6f}\n" for c in lines))
        return directory

    even = judged_pace(write(tmp_path / "even", _job(2, {})))
    assert even is not None and even.judged and not even.notable  # judged, nothing for the evidence
    found = judged_pace(write(tmp_path / "slow", _job(2, {1: 2.0})))
    assert found is not None and found.notable
    evidence = found.to_dict()
    assert evidence["stragglers"] == [1] and "rank 1" in str(evidence["summary"])
    assert [row["straggler"] for row in evidence["ranks"]] == [False, True]  # type: ignore[index]
