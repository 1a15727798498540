"""The first divergence of runs that are not bitwise reproducible (N ranks against 1, a resume at
another world size, a calibrated noisy job): step records written in the agent's format, the
sums of squares chosen per case, one planted difference per case and the clean run beside it;
the per-tensor spread a calibration records, read back and refused when bad."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import each_refused
from tests.steplines import write_rank
from trainguard.checks.calibration import (
    CalibrationError,
    CalibrationRuns,
    ToleranceUsed,
    load_calibration,
    metric_stats,
    save_calibration,
)
from trainguard.checks.calibration_steps import measure_step_spreads
from trainguard.checks.divergence import Agreement, Divergence, NoComparison, observed_resume_causes
from trainguard.checks.divergence_noisy import (
    noisy_divergence,
    observe_noisy,
    observe_noisy_resume,
    observed_world_size_causes,
)
from trainguard.checks.statefiles import JobKey
from trainguard.checks.step_compare import MAX_ROWS, SsTolerance, whole_run
from trainguard.evidence import UNSET
from trainguard.launch.steps import read_steps
from trainguard.run.request import RunRequest

NAMES = ("fc1.weight", "fc1.bias", "fc2.weight")


def line(n: int, *, salt: int = 0, lr: float | None = None, param: float = 1.0, grad: float = 2.0,
         sizes: dict[str, float] | None = None, placement: bool = False, optim: float = 3.0) -> dict[str, Any]:
    """Step ``n``'s line: each tensor's sum of squares its base value x (1 + n/10) (x ``sizes[name]``),
    bit sums that change with ``salt`` (another run, bitwise different, numerically alike)."""
    def prints(base: float, k: int) -> dict[str, Any]:
        return {name: [f"{(n * 7919 + i * 31 + k * 101 + salt * 104729) % 2**64:016x}",
                       base * (1 + n / 10) * (i + 1) * (sizes or {}).get(name, 1.0)] for i, name in enumerate(NAMES)}
    out: dict[str, Any] = {
        "k": "step", "opt": 0, "n": n, "t": float(n), "backward": 1,
        "groups": [{"lr": lr if lr is not None else 1e-3 * 0.9**n, "weight_decay": 0.01}],
        "rng": {"cpu": f"{n:016x}", "cuda": None, "numpy": None, "python": "00000000000000bb"},
        "param": prints(param, 1), "grad": prints(grad, 2), "optim": prints(optim, 3), "scaler": None,
    }
    if placement:
        out["placement"] = dict.fromkeys(NAMES, "(Shard(dim=0),)")
    return out


def run(path: Path, lines_of: dict[int, list[dict[str, Any]]]) -> Path:
    """A run whose rank r wrote ``lines_of[r]``."""
    for rank, lines in lines_of.items():
        write_rank(path, rank, [], extra=lines)
    return path


def steps(first: int, last: int, **kw: Any) -> list[dict[str, Any]]:
    return [line(n, **kw) for n in range(first, last + 1)]


def test_n_ranks_that_train_like_one_agree_and_a_planted_gradient_is_found(tmp_path: Path) -> None:
    one = read_steps(run(tmp_path / "one", {0: steps(1, 10)}))
    # DDP: every rank holds the whole parameter (no placement), bitwise other than the 1-rank run
    clean = read_steps(run(tmp_path / "two", {0: steps(1, 10, salt=1), 1: steps(1, 10, salt=1)}))
    found = noisy_divergence(one, clean, tolerance=SsTolerance())
    assert isinstance(found, Agreement) and found.compared_steps == 10, found
    # a gradient 1 % off from step 4 on (beyond the default relative 1e-3)
    bad = [line(n, salt=1, sizes={"fc1.bias": 1.01} if n >= 4 else None) for n in range(1, 11)]
    planted = read_steps(run(tmp_path / "bad", {0: bad, 1: bad}))
    found = noisy_divergence(one, planted, tolerance=SsTolerance())
    assert isinstance(found, Divergence), found
    assert (found.step, found.first.kind) == (4, "parameter") or (found.step, found.first.kind, found.first.name) == (
        4, "gradient", "fc1.bias"), found
    evidence = found.as_evidence("the 2-rank run")
    assert evidence.kind in ("gradient", "parameter") and evidence.step == 4
    rows = evidence.steps
    assert rows and [r.step for r in rows] == list(range(1, 11))  # 3 before it, then on to the last step
    assert [r.kind for r in rows[:3]] == ["", "", ""] and rows[3].name == "fc1.bias"
    assert rows[3].reference.startswith("sum of squares") and rows[3].reference != rows[3].other


def test_dtensor_shards_are_summed_across_ranks_and_replicas_are_not(tmp_path: Path) -> None:
    one = read_steps(run(tmp_path / "one", {0: steps(1, 5)}))
    # two shards, each half the sum of squares, named with their placement
    halves = {name: 0.5 for name in NAMES}
    sharded = read_steps(run(tmp_path / "fsdp", {r: steps(1, 5, salt=r + 1, sizes=halves, placement=True) for r in (0, 1)}))
    assert isinstance(noisy_divergence(one, sharded, tolerance=SsTolerance()), Agreement)
    merged = whole_run(sharded)[1].param["fc1.bias"]
    assert merged.ss == pytest.approx(whole_run(one)[1].param["fc1.bias"].ss)
    # the same halves without a placement are replicas: one rank's value, half the reference's
    replicas = read_steps(run(tmp_path / "ddp", {r: steps(1, 5, salt=r + 1, sizes=halves) for r in (0, 1)}))
    found = noisy_divergence(one, replicas, tolerance=SsTolerance())
    assert isinstance(found, Divergence) and (found.step, found.first.kind) == (1, "parameter")
    # ZeroRedundancyOptimizer: each rank holds the optimizer state of its own parameters only
    zero = {r: [dict(x, optim={k: v for k, v in x["optim"].items() if (k == "fc2.weight") == (r == 1)})
                for x in steps(1, 5, salt=1)] for r in (0, 1)}
    whole = whole_run(read_steps(run(tmp_path / "zero", zero)))
    assert set(whole[1].optim) == set(NAMES)
    assert isinstance(noisy_divergence(one, read_steps(tmp_path / "zero"), tolerance=SsTolerance()), Agreement)


def test_a_learning_rate_that_depends_on_the_world_size_is_named_first(tmp_path: Path) -> None:
    one = read_steps(run(tmp_path / "one", {0: steps(1, 6)}))
    two = read_steps(run(tmp_path / "two", {r: [line(n, salt=1, lr=2e-3 * 0.9**n) for n in range(1, 7)] for r in (0, 1)}))
    runs = observe_noisy(tmp_path / "one", tmp_path / "two", tolerance=SsTolerance())
    assert runs is not None and isinstance(runs.divergence, Divergence)
    assert (runs.divergence.step, runs.divergence.first.kind) == (1, "lr")
    causes = observed_world_size_causes(runs, 2, "the 2-rank run")
    assert causes[0].key == "schedule" and "group 0's lr is 0.0018 at step 1 against 0.0009" in causes[0].observation
    assert "compared within a relative 0.001 (the default" in runs.evidence().compared_by
    assert noisy_divergence(one, two, tolerance=SsTolerance()) == runs.divergence


def test_gradients_summed_instead_of_averaged_show_as_world_size_squared(tmp_path: Path) -> None:
    run(tmp_path / "one", {0: steps(1, 4)})
    summed = steps(1, 4, salt=1, grad=8.0)  # 4x the gradients' sum of squares, the same weights at step 1
    run(tmp_path / "two", {0: summed, 1: summed})
    runs = observe_noisy(tmp_path / "one", tmp_path / "two", tolerance=SsTolerance())
    assert runs is not None and isinstance(runs.divergence, Divergence)
    causes = observed_world_size_causes(runs, 2)
    assert [c.key for c in causes] == ["summed"] and "4x the reference's sum of squares, about 2^2" in causes[0].observation
    # averaged but on other samples (a ratio not near 4): no cause claimed from it
    run(tmp_path / "other", {0: steps(1, 4, salt=1, grad=2.5)})
    runs = observe_noisy(tmp_path / "one", tmp_path / "other", tolerance=SsTolerance())
    assert runs is not None and observed_world_size_causes(runs, 2) == []


def test_a_calibrated_spread_allows_the_noise_it_measured_and_no_more(tmp_path: Path) -> None:
    reference = read_steps(run(tmp_path / "ref", {0: steps(1, 5)}))
    noisy = read_steps(run(tmp_path / "noisy", {0: steps(1, 5, salt=1, sizes={"fc2.weight": 1.003})}))
    assert isinstance(noisy_divergence(reference, noisy, tolerance=SsTolerance()), Divergence)
    # fc2.weight's sums of squares (up to 13.5) 0.3 % apart; same-seed runs spread 0.02 between same-seed runs: 3x that allowed
    spreads = {(kind, "fc2.weight"): dict.fromkeys(range(1, 6), 0.02) for kind in ("parameter", "gradient", "optimizer state")}
    assert isinstance(noisy_divergence(reference, noisy, tolerance=SsTolerance(spreads=spreads)), Agreement)
    tight = {k: dict.fromkeys(range(1, 6), 0.001) for k in spreads}
    found = noisy_divergence(reference, noisy, tolerance=SsTolerance(spreads=tight, rtol=0.0))
    assert isinstance(found, Divergence) and found.first.name == "fc2.weight"


def test_a_calibrated_resume_names_the_lost_scheduler_not_the_noise(tmp_path: Path) -> None:
    """A noisy job's resume: bitwise every tensor differs; the lr is the one real difference."""
    run(tmp_path / "ref", {0: steps(1, 20)})
    resumed = [line(n, salt=1) for n in range(11, 21)]
    lost = [dict(x, n=x["n"] - 10, groups=[{"lr": 1e-3 * 0.9 ** (x["n"] - 10), "weight_decay": 0.01}]) if x["n"] > 11
            else dict(x, n=x["n"] - 10) for x in resumed]
    write_rank(tmp_path / "res", 0, [], extra=[{"k": "restore", "t": 0.1, "call": "Optimizer.load_state_dict",
                                                 "target": "AdamW", "path": None}, *lost])
    runs = observe_noisy(tmp_path / "ref", tmp_path / "res", tolerance=SsTolerance(), printed=11, last_printed=20)
    assert runs is not None and isinstance(runs.divergence, Divergence), runs
    assert (runs.divergence.step, runs.divergence.first.kind) == (12, "lr")
    causes = observed_resume_causes(runs.divergence, runs.other, runs.reference)
    assert causes[0].key == "scheduler" and "never loaded the scheduler's state" in causes[0].observation
    found, observed = observe_noisy_resume(tmp_path / "ref", tmp_path / "res", tmp_path / "ref", tolerance=SsTolerance(),
                                           resumed_from=10, counted_from=1, last_printed=20)
    assert found is not None and found.kind == "lr" and observed == causes and found.compared_by
    # without the lost schedule it agrees: the bitwise noise is not a difference
    write_rank(tmp_path / "ok", 0, [], extra=[dict(x, n=x["n"] - 10) for x in resumed])
    clean = observe_noisy(tmp_path / "ref", tmp_path / "ok", tolerance=SsTolerance(), printed=11, last_printed=20)
    assert clean is not None and isinstance(clean.divergence, Agreement), clean


def test_without_records_nothing_is_said_and_one_side_missing_is_no_comparison(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    assert observe_noisy(tmp_path / "a", tmp_path / "b", tolerance=SsTolerance()) is None
    run(tmp_path / "c", {0: steps(1, 3)})
    found = observe_noisy(tmp_path / "c", tmp_path / "b", tolerance=SsTolerance())
    assert found is not None and isinstance(found.divergence, NoComparison)
    assert "the other run left no step records" in found.evidence().sentence


def test_the_table_is_bounded(tmp_path: Path) -> None:
    reference = read_steps(run(tmp_path / "ref", {0: steps(1, 200)}))
    other = read_steps(run(tmp_path / "other", {0: [line(n, salt=1, lr=1.0 if n >= 10 else None) for n in range(1, 201)]}))
    found = noisy_divergence(reference, other, tolerance=SsTolerance())
    assert isinstance(found, Divergence) and found.step == 10
    assert len(found.rows) == MAX_ROWS and found.rows[0].step == 7 and found.rows[3].kind == "lr"


# -- the per-tensor spread of a calibration ------------------------------------------------------

REQUEST = RunRequest.make(steps=4, seed=0, world_size=1)
JOB = JobKey("trainguard.yaml", "0" * 64, ("python", "t.py"), ("loss",))


def _calibrated(tmp_path: Path) -> Path:
    dirs = [run(tmp_path / f"same{i}", {0: steps(1, 4, salt=i, sizes={"fc1.bias": 1 + i / 100})}) for i in range(3)]
    spreads = measure_step_spreads(dirs)
    assert spreads is not None
    stats = metric_stats([{s: 1.0 for s in range(1, 5)}] * 3, [{s: 1.0 for s in range(1, 5)}])
    assert stats is not None
    return save_calibration(tmp_path, tmp_path, REQUEST, CalibrationRuns(3, [0], step_spreads=spreads),
                            {"loss": stats}, job=JOB)


def test_a_calibration_records_each_tensors_spread_and_a_check_reads_it_back(tmp_path: Path) -> None:
    found = load_calibration(_calibrated(tmp_path))
    spreads = found.step_spreads
    assert spreads is not None and spreads.steps == [1, 2, 3, 4]
    # fc1.bias's sum of squares is 2 x 2 x (1 + n/10) x (1 + i/100) in run i: spread 0.08 x (1 + n/10)
    assert spreads.spreads["gradient"]["fc1.bias"] == pytest.approx([0.08 * (1 + n / 10) for n in range(1, 5)])
    assert spreads.spreads["parameter"]["fc1.weight"] == [0.0] * 4
    tolerance = ToleranceUsed(0.0, 0.0, "test", found).ss_tolerance()
    assert tolerance.spreads[("gradient", "fc1.bias")][4] == pytest.approx(0.112)
    assert "3x the same-seed spread calibrated per tensor and step (calibration 0001_" in tolerance.words()
    # a calibration made before (no step_spreads): the default tolerance, said
    assert "recorded no per-tensor spread" in ToleranceUsed(0.0, 0.0, "t", found.__class__(
        found.path, found.request, found.runs, found.metrics)).ss_tolerance().words()


def test_a_bad_per_tensor_spread_refuses_the_calibration(tmp_path: Path) -> None:
    good = json.loads(_calibrated(tmp_path).read_text())
    spread = good["step_spreads"]

    def changed(**fields: Any) -> str:
        return json.dumps({**good, "step_spreads": {**spread, **fields}})

    grad = spread["spread"]["gradient"]
    cases = {
        "nan": (changed(spread={**spread["spread"], "gradient": {**grad, "fc1.bias": [0, math.nan, 0, 0]}}),
                r"step_spreads.spread.gradient.fc1.bias\[1\] is nan"),
        "negative": (changed(spread={"gradient": {"fc1.bias": [0, -1, 0, 0]}}), r"fc1.bias\[1\] is -1"),
        "short": (changed(spread={"gradient": {"fc1.bias": [0]}}), "fc1.bias must be a list of 4 numbers"),
        "steps": (changed(steps=[2, 1, 3, 4]), "step_spreads.steps must be a rising list"),
        "steps from 0": (changed(steps=[0, 1, 2, 3]), "step_spreads.steps must be a rising list"),
        "not an object": (json.dumps({**good, "step_spreads": [1]}), "step_spreads must be an object"),
    }
    each_refused(tmp_path, cases, load_calibration, CalibrationError, "trainguard calibrate")


# -- the gate's HTML view -------------------------------------------------------------------------


def test_the_gate_html_shows_the_first_differing_quantity_per_step_of_a_failed_check(tmp_path: Path) -> None:
    from tests.unit.test_gate_records import _gate
    from trainguard.checks.equivalence_records import DeterminismEvidence, Tolerance
    from trainguard.gate.run import write_gate_report
    from trainguard.report import CheckResult, Report

    reference = read_steps(run(tmp_path / "ref", {0: steps(1, 8)}))
    bad = [line(n, salt=1, sizes={"fc1.bias": 1.5} if n >= 5 else None) for n in range(1, 9)]
    found = noisy_divergence(reference, read_steps(run(tmp_path / "bad", {0: bad})), tolerance=SsTolerance())
    assert isinstance(found, Divergence)

    def checked(status: str) -> CheckResult:
        evidence = DeterminismEvidence(0, 8, Tolerance(0.0, 0.0), [], [], first_divergence=found.as_evidence())
        return CheckResult("determinism", status, "loss differs", evidence)  # type: ignore[arg-type]

    html = Path(write_gate_report(_gate(report=Report(job="toy", checks=[checked("failed")]), sizing=None), tmp_path / "g")["html"]).read_text()
    assert "determinism: where the runs first differ" in html and found.sentence() in html
    rows = html.split("<th>other run</th></tr>")[1].split("</table>")[0].split("<tr>")[1:]
    # steps 2-4 (3 before the first difference) agree, then each step's first difference to the last
    assert len(rows) == 7 and all("nothing differs" in r for r in rows[:3]) and "<td>2</td>" in rows[0]
    first = found.rows[3]
    assert f"<td>5</td><td>{first.kind}: {first.name}</td><td>{first.reference}</td><td>{first.other}</td>" in rows[3]
    assert first.reference != first.other and "nothing differs" not in "".join(rows[3:])
    passed = write_gate_report(_gate(report=Report(job="toy", checks=[checked("passed")]), sizing=None), tmp_path / "p")["html"]
    assert "where the runs first differ" not in Path(passed).read_text()


def test_an_exact_comparison_gets_its_table_too_in_the_steps_the_job_printed(tmp_path: Path) -> None:
    """A resume compared bit for bit (observe_runs): the rows are the reference's printed steps."""
    from tests.steplines import trajectory
    from trainguard.checks.divergence import observe_runs

    write_rank(tmp_path / "ref", 0, trajectory(1, 30))
    # nanoGPT-like: printed steps 0..29, resumed after printed step 19; the lr lost from its 3rd step
    write_rank(tmp_path / "res", 0, trajectory(1, 10, shift=20, lr=lambda s: 1.0 if s >= 23 else 1e-3 * 0.9**s))
    runs = observe_runs(tmp_path / "ref", tmp_path / "res", printed=20, counted_from=0, last_printed=29)
    assert runs is not None and isinstance(runs.divergence, Divergence)
    evidence = runs.divergence.as_evidence()
    assert (evidence.step, evidence.kind) == (22, "lr") and evidence.steps
    assert [r.step for r in evidence.steps] == list(range(20, 30))
    assert [r.kind for r in evidence.steps[:2]] == ["", ""] and evidence.steps[2].kind == "lr"
    assert evidence.compared_by is UNSET  # bit for bit


def test_reshard_names_the_cause_its_step_records_show_first() -> None:
    from trainguard.checks.divergence import ObservedCause
    from trainguard.checks.reshard import PairFacts, rank_reshard_causes

    plain = rank_reshard_causes(PairFacts(4, 5, None, None))
    assert plain[0].key == "optimizer_shard" and not plain[0].observed
    seen = ObservedCause("schedule", "with the same seed and global batch, group 0's lr is 2 at step 5 against 1")
    causes = rank_reshard_causes(PairFacts(4, 5, None, None, observed=[seen]))
    assert causes[0].key == "schedule" and causes[0].observed and causes[0].evidence[0] == seen.observation
    assert causes[0].as_evidence().evidence_strength == "decisive"


def test_a_recover_drill_names_what_the_restart_that_parted_did_not_restore(tmp_path: Path) -> None:
    """The attempt resumed after printed step 10 never loads its scheduler; the one before saved none."""
    from tests.steplines import restore, save, trajectory
    from trainguard.drills.observed import observed_restart
    from trainguard.launch import MetricPoint, RunResult

    def result(path: Path, printed: range) -> RunResult:
        return RunResult("ok", ["python"], path, 1, 0, [], [MetricPoint("loss", s, 1.0, 0, float(s)) for s in printed],
                         1.0, None)

    write_rank(tmp_path / "ref", 0, trajectory(1, 20))
    write_rank(tmp_path / "a0", 0, trajectory(1, 12), extra=[save("model", "optimizer", "rng")])
    write_rank(tmp_path / "a1", 0, trajectory(1, 10, shift=10, lr=lambda s: 5e-3 if s >= 12 else 1e-3 * 0.9**s),
               before=restore("torch.load", "Module.load_state_dict", "Optimizer.load_state_dict", "torch.set_rng_state"))
    attempts = [result(tmp_path / "a0", range(1, 13)), result(tmp_path / "a1", range(11, 21))]
    found, causes = observed_restart(result(tmp_path / "ref", range(1, 21)), attempts, "loss", 12, 20)
    assert found is not None and (found.step, found.kind) == (12, "lr") and found.steps
    assert causes[0].startswith("LR scheduler state not saved or not restored") and "its checkpoint holds none" in causes[0]
    # a divergence before any restart (the first attempt's own steps): nothing to observe
    assert observed_restart(result(tmp_path / "ref", range(1, 21)), attempts, "loss", 5, 20) == (None, [])


def test_the_step_dcp_makes_to_create_optimizer_state_is_not_a_training_step(tmp_path: Path) -> None:
    """``set_state_dict`` runs the optimizer once at lr 0 on zero gradients before it loads the
    state: the resumed run's first line; the 3-rank run is otherwise the 2-rank one, resumed after 5."""
    run(tmp_path / "ref", {r: steps(1, 12, salt=r + 1, placement=True, sizes=dict.fromkeys(NAMES, 0.5)) for r in (0, 1)})
    init = dict(line(1, salt=9, lr=0.0, grad=0.0), backward=0, optim={})
    resumed = [init, *(dict(line(n, salt=5, placement=True, sizes=dict.fromkeys(NAMES, 1 / 3)), n=n - 4)
                       for n in range(6, 13))]
    run(tmp_path / "res", {r: resumed for r in range(3)})
    runs = observe_noisy(tmp_path / "ref", tmp_path / "res", tolerance=SsTolerance(), printed=6, last_printed=12)
    assert runs is not None and isinstance(runs.divergence, Agreement), runs.divergence
    assert (runs.divergence.first_step, runs.divergence.compared_steps) == (6, 7)
    # AdamW's step counter is in every rank's combined optimizer state, whole: 3 ranks sum it 3 times,
    # 2 ranks twice, so a sharded parameter's optimizer state is not compared across world sizes
    counted = [dict(x, optim={k: [v[0], v[1] + 25.0 * 3] for k, v in x["optim"].items()}) for x in resumed[1:]]
    run(tmp_path / "counted", {r: [init, *counted] for r in range(3)})
    runs = observe_noisy(tmp_path / "ref", tmp_path / "counted", tolerance=SsTolerance(), printed=6, last_printed=12)
    assert runs is not None and isinstance(runs.divergence, Agreement), runs.divergence
