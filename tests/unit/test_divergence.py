"""The first divergence of two runs' step records, and the causes it shows (records written in
the run agent's format by tests/steplines.py: one planted difference per case, and the clean
run beside it)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from tests.steplines import Step, restore, save, trajectory, write_rank, write_samples
from trainguard.checks.divergence import (
    Agreement,
    Divergence,
    NoComparison,
    first_divergence,
    observe_runs,
    observed_determinism_causes,
    observed_resume_causes,
    steps_before,
)
from trainguard.launch.samples import read_samples
from trainguard.launch.steps import StepRecords, read_steps

#: what a careful job restores and saves (model, optimizer, scheduler, RNG)
RESTORES = restore("torch.load", "Module.load_state_dict", "Optimizer.load_state_dict",
                   "LRScheduler.load_state_dict", "torch.set_rng_state")
SAVED = save("model", "optimizer", "scheduler", "rng")


def _runs(tmp_path: Path, reference: list[Step], other: list[Step], *, restores: list[Any] = RESTORES,
          saved: Any = None, offset: int = 20) -> tuple[Divergence | Agreement | NoComparison, StepRecords, StepRecords]:
    """(the divergence, the other run's records, the saving run's records)."""
    write_rank(tmp_path / "ref", 0, reference, extra=[saved or SAVED])
    write_rank(tmp_path / "other", 0, other, before=restores)
    ref, oth = read_steps(tmp_path / "ref"), read_steps(tmp_path / "other")
    samples = (read_samples(tmp_path / "ref"), read_samples(tmp_path / "other"))
    return first_divergence(ref, oth, offset=offset, samples=samples), oth, ref


def _resumed(**changes: Any) -> list[Step]:
    return trajectory(1, 10, shift=20, **changes)


def test_a_resume_that_restored_everything_agrees_at_every_step(tmp_path: Path) -> None:
    write_samples(tmp_path / "ref", 0, [[s, s + 1] for s in range(1, 31)])
    write_samples(tmp_path / "other", 0, [[s, s + 1] for s in range(21, 31)])
    found, _, _ = _runs(tmp_path, trajectory(1, 30), _resumed())
    assert isinstance(found, Agreement), found
    assert found.compared_steps == 10 and (found.first_step, found.last_step) == (21, 30) and found.samples_compared
    assert "agree with the reference's at all 10 steps compared (21-30), samples included" in found.sentence()


def test_no_records_or_no_common_step_is_no_comparison_never_equal(tmp_path: Path) -> None:
    write_rank(tmp_path / "ref", 0, trajectory(1, 30))
    (tmp_path / "none").mkdir()
    ref = read_steps(tmp_path / "ref")
    missing = first_divergence(ref, read_steps(tmp_path / "none"))
    assert isinstance(missing, NoComparison) and "the other run left no step records" in missing.reason
    write_rank(tmp_path / "other", 0, _resumed())
    beyond = first_divergence(ref, read_steps(tmp_path / "other"), offset=40)
    assert isinstance(beyond, NoComparison) and "no step in common" in beyond.reason
    assert beyond.as_evidence().compared_steps == 0 and "not compared" in beyond.as_evidence().sentence
    assert observe_runs(tmp_path / "none", tmp_path / "none") is None  # nothing recorded: nothing said


def test_a_lost_scheduler_shows_as_the_lr_of_the_second_resumed_step(tmp_path: Path) -> None:
    """Issue 44's case: model, optimizer, RNG and step saved, not the LambdaLR. The optimizer's
    state brings back the first resumed step's lr; the scheduler, restarted, sets the next."""
    def restarted(n: int) -> float:
        return 1e-3 * 0.9 ** n if n <= 21 else 1e-3 * 0.9 ** (n - 20)

    resumed = trajectory(1, 10, shift=20, lr=restarted)
    found, other, saver = _runs(tmp_path, trajectory(1, 30), resumed, saved=save("model", "optimizer", "rng"),
                                restores=restore("Module.load_state_dict", "Optimizer.load_state_dict",
                                                 "torch.set_rng_state"))
    assert isinstance(found, Divergence), found
    assert (found.step, found.first.kind, found.first.name) == (22, "lr", "group 0's lr")
    assert (found.first.reference, found.first.other) == ("9.85e-05", "0.00081")  # the digits that tell them apart
    causes = observed_resume_causes(found, other, saver)
    assert causes[0].key == "scheduler", causes
    assert causes[0].observation.startswith("the resumed run never loaded the scheduler's state: group 0's lr is "
                                            "0.00081 at step 22 against 9.85e-05")
    assert causes[0].observation.endswith("its checkpoint holds none")
    assert found.as_evidence().kind == "lr" and found.as_evidence().step == 22


def test_a_resume_that_sets_no_rng_state_is_named_with_the_generators_state(tmp_path: Path) -> None:
    """nanoGPT: model, optimizer and iter_num saved; the resume seeds again and restores no RNG:
    its batches (torch.randint) and dropout draw from a fresh generator."""
    resumed = [replace(s, rng="00000000000000ff" if s.n == 1 else s.rng, grad=999 if s.n == 1 else s.grad)
               for s in _resumed()]
    found, other, saver = _runs(tmp_path, trajectory(1, 30), resumed, saved=save("model", "optimizer", "value"),
                                restores=restore("torch.load", "Module.load_state_dict", "Optimizer.load_state_dict"))
    assert isinstance(found, Divergence) and (found.step, found.first.kind, found.first.name) == (21, "rng", "torch CPU")
    causes = observed_resume_causes(found, other, saver)
    assert causes[0].key == "rng"
    assert causes[0].observation.startswith("its checkpoint saves no RNG state and the resume sets none: the torch "
                                            f"CPU generator's state at step 21's start is 00000000000000ff against {21:016x}")
    # the same difference after a resume that set the RNG: restored from elsewhere
    found, other, saver = _runs(tmp_path / "set", trajectory(1, 30), resumed)
    assert isinstance(found, Divergence)
    assert "set RNG state (torch.set_rng_state), but" in observed_resume_causes(found, other, saver)[0].observation


def test_an_rng_state_that_changes_nothing_is_remembered_not_blamed(tmp_path: Path) -> None:
    """A resumed run's DataLoader iterator draws its seed from the global RNG at another moment:
    the state differs, nothing drawn from it differs; the learning rate parts a step later."""
    resumed = [replace(s, rng="00000000000000ee", lr=0.5 if s.n >= 2 else s.lr) for s in _resumed()]
    found, other, saver = _runs(tmp_path, trajectory(1, 30), resumed)
    assert isinstance(found, Divergence) and found.step == 22 and found.first.kind == "lr"
    assert found.rng_since == 21 and "the RNG states differ from step 21 on" in found.sentence()
    assert [c.key for c in observed_resume_causes(found, other, saver)] == ["scheduler"]


def test_an_optimizer_state_never_loaded_is_named_first(tmp_path: Path) -> None:
    resumed = [replace(s, no_optim=True) if s.n == 1 else replace(s, optim=0) for s in _resumed()]
    found, other, saver = _runs(tmp_path, trajectory(1, 30), resumed,
                                restores=restore("Module.load_state_dict", "LRScheduler.load_state_dict",
                                                 "torch.set_rng_state"))
    assert isinstance(found, Divergence) and (found.step, found.first.kind) == (21, "optimizer state")
    assert found.first.name == "fc1.weight" and found.first.other == "absent"
    causes = observed_resume_causes(found, other, saver)
    assert causes[0].key == "optimizer"
    assert causes[0].observation.startswith("the resumed run loaded no optimizer state: the optimizer state of "
                                            "fc1.weight is absent at step 21 against")


def test_weights_that_differ_at_the_first_resumed_step_are_a_stale_checkpoint(tmp_path: Path) -> None:
    resumed = [replace(s, param_of={"fc2.weight": 77}) if s.n == 1 else s for s in _resumed()]
    found, other, saver = _runs(tmp_path, trajectory(1, 30), resumed)
    assert isinstance(found, Divergence) and (found.first.kind, found.first.name) == ("parameter", "fc2.weight")
    causes = observed_resume_causes(found, other, saver)
    assert causes[0].key == "stale_checkpoint" and "after step 20: parameter fc2.weight is" in causes[0].observation


def test_other_samples_name_the_data_position_and_the_lr_comes_first_within_a_step(tmp_path: Path) -> None:
    write_samples(tmp_path / "ref", 0, [[s, s + 1] for s in range(1, 31)])
    write_samples(tmp_path / "other", 0, [[s, s + 1] for s in range(1, 11)])  # the epoch's start again
    resumed = [replace(s, grad=0) for s in _resumed()]
    found, other, saver = _runs(tmp_path, trajectory(1, 30), resumed)
    assert isinstance(found, Divergence) and found.first.kind == "samples" and found.samples_compared
    assert found.first.reference == "[21, 22]" and found.first.other == "[1, 2]"
    assert [d.kind for d in found.at_step] == ["samples", "gradient", "gradient", "gradient"]
    causes = observed_resume_causes(found, other, saver)
    assert causes[0].key == "data_position"
    assert causes[0].observation.startswith("the resumed run's step 21 drew samples [1, 2] (the samples of step 1 "
                                            "again) against [21, 22]")
    assert causes[0].observation.endswith("it restored no loader state")


def test_only_gradients_that_differ_with_the_same_samples_name_the_jobs_nondeterminism(tmp_path: Path) -> None:
    write_samples(tmp_path / "ref", 0, [[s] for s in range(1, 31)])
    write_samples(tmp_path / "other", 0, [[s] for s in range(21, 31)])
    resumed = [replace(s, grad_of={"fc1.bias": 5}) if s.n == 6 else s for s in _resumed()]
    found, other, saver = _runs(tmp_path, trajectory(1, 30), resumed)
    assert isinstance(found, Divergence) and (found.step, found.first.kind) == (26, "gradient")
    causes = observed_resume_causes(found, other, saver)
    assert [c.key for c in causes] == ["nondeterministic"]
    # without sample records the data may differ too: nothing is observed
    found, other, saver = _runs(tmp_path / "unrecorded", trajectory(1, 30), resumed)
    assert isinstance(found, Divergence) and not found.samples_compared
    assert observed_resume_causes(found, other, saver) == []


def test_determinism_causes_from_the_first_step(tmp_path: Path) -> None:
    def pair(name: str, second: list[Step], seeds: tuple[str, ...] = ("torch.manual_seed",)) -> Divergence:
        seed = [{"k": "seed", "t": 0.0, "call": c} for c in seeds]
        write_rank(tmp_path / name / "a", 0, trajectory(1, 5), before=seed)
        write_rank(tmp_path / name / "b", 0, second, before=seed)
        observed = observe_runs(tmp_path / name / "a", tmp_path / name / "b")
        assert observed is not None and isinstance(observed.divergence, Divergence), observed
        return observed.divergence

    clean = observe_runs(tmp_path / "x", tmp_path / "x")
    assert clean is None
    weights = pair("weights", [replace(s, param=s.param + 100) for s in trajectory(1, 5)])
    first, second = read_steps(tmp_path / "weights" / "a"), read_steps(tmp_path / "weights" / "b")
    causes = observed_determinism_causes(weights, first, second)
    assert causes[0].key == "seed" and causes[0].observation.startswith("the initial weights are not seeded: parameter "
                                                                        "fc1.weight is")
    rng = pair("rng", [replace(s, rng="0123456789abcdef", grad=50 + s.n) for s in trajectory(1, 5)], seeds=())
    causes = observed_determinism_causes(rng, read_steps(tmp_path / "rng" / "a"), read_steps(tmp_path / "rng" / "b"))
    assert causes[0].key == "seed" and "(no torch.manual_seed call in the first and second run)" in causes[0].observation
    kernels = pair("kernels", [replace(s, grad_of={"fc2.weight": 1}) if s.n == 3 else s for s in trajectory(1, 5)])
    # the grads alone differ, but no samples were recorded: the data may differ too
    assert observed_determinism_causes(kernels, first, second) == []
    update = pair("update", [replace(s, param_of={"fc1.bias": 3}) if s.n == 4 else s for s in trajectory(1, 5)])
    assert observed_determinism_causes(update, first, second)[0].key == "kernels"


def test_sums_of_squares_compare_runs_that_are_not_bitwise_reproducible(tmp_path: Path) -> None:
    write_rank(tmp_path / "a", 0, trajectory(1, 5))
    write_rank(tmp_path / "b", 0, [replace(s, grad_of={"fc1.weight": 2000 * s.n + 1000}) for s in trajectory(1, 5)])
    a, b = read_steps(tmp_path / "a"), read_steps(tmp_path / "b")
    assert isinstance(first_divergence(a, b), Divergence)  # the bits differ
    loose = first_divergence(a, b, exact=False, rtol=1.0)
    assert isinstance(loose, Agreement), loose


@pytest.mark.parametrize(("count", "span", "printed", "want"), [(30, 30, 21, 20), (60, 30, 21, 40), (31, 30, 21, None)])
def test_the_offset_of_a_resume_in_optimizer_steps(tmp_path: Path, count: int, span: int, printed: int,
                                                    want: int | None) -> None:
    write_rank(tmp_path, 0, trajectory(1, count))
    found = steps_before(read_steps(tmp_path), printed, counted_from=1, last_printed=span)
    if want is None:
        assert isinstance(found, NoComparison) and "do not split evenly" in found.reason
    else:
        assert found == want
    # a job counting from 0 (nanoGPT's iter 0 .. iter 29): iter 20 comes after 20 steps
    assert steps_before(read_steps(tmp_path), 20, counted_from=0, last_printed=count - 1) == 20


def test_a_failed_determinism_check_names_what_the_records_show_first(tmp_path: Path) -> None:
    from trainguard.checks.equivalence import NONDETERMINISM_CAUSES, observed_nondeterminism
    from trainguard.checks.equivalence_records import DeterminismEvidence, Tolerance

    def evidence() -> DeterminismEvidence:
        return DeterminismEvidence(1, 5, Tolerance(0.0, 0.0), [], ["a", "b"])

    write_rank(tmp_path / "a", 0, trajectory(1, 5))
    write_rank(tmp_path / "b", 0, [replace(s, param=s.param + 100) for s in trajectory(1, 5)])
    found = evidence()
    causes, most_likely = observed_nondeterminism(tmp_path / "a", tmp_path / "b", found)
    assert causes[0].startswith(NONDETERMINISM_CAUSES[0] + ": the initial weights are not seeded: parameter fc1.weight")
    assert most_likely.startswith("Most likely an unseeded RNG: the initial weights are not seeded")
    assert found.to_dict()["first_divergence"]["kind"] == "parameter"
    # the same records twice: compared, nothing to name
    same = evidence()
    assert observed_nondeterminism(tmp_path / "a", tmp_path / "a", same) == ([], "")
    assert "agree with the reference's at all 5 steps" in same.to_dict()["first_divergence"]["sentence"]
    # no records: nothing said, nothing added to the report
    none = evidence()
    assert observed_nondeterminism(tmp_path / "x", tmp_path / "y", none) == ([], "")
    assert "first_divergence" not in none.to_dict()


def test_a_fresh_optimizer_beside_a_loaded_scheduler_names_the_optimizer_not_the_schedule(tmp_path: Path) -> None:
    """examples/digits with `optimizer.load_state_dict` planted out: the scheduler came back, the
    optimizer did not, so its lr (a fresh optimizer's) and its state (none yet) differ at the
    first resumed step: the optimizer, not the schedule, is what was lost."""
    resumed = [replace(s, no_optim=True, lr=1e-3) if s.n == 1 else replace(s, optim=0) for s in _resumed()]
    found, other, saver = _runs(tmp_path, trajectory(1, 30), resumed,
                                restores=restore("Module.load_state_dict", "LRScheduler.load_state_dict",
                                                 "torch.set_rng_state"))
    assert isinstance(found, Divergence) and found.first.kind == "lr" and "optimizer state" in found.kinds
    causes = observed_resume_causes(found, other, saver)
    assert [c.key for c in causes] == ["optimizer"], causes
    assert "the optimizer state of fc1.weight is absent at step 21" in causes[0].observation


def test_a_generator_neither_run_draws_from_is_no_difference(tmp_path: Path) -> None:
    """numpy's global generator is seeded from the OS at import: two processes of a job that
    never seeds nor uses it differ there at every step. A state neither run's steps change is
    not a difference; one a run draws from is."""
    write_rank(tmp_path / "a", 0, [replace(s, numpy="000000000000000a") for s in trajectory(1, 5)])
    write_rank(tmp_path / "b", 0, [replace(s, numpy="000000000000000b") for s in trajectory(1, 5)])
    a, b = read_steps(tmp_path / "a"), read_steps(tmp_path / "b")
    assert isinstance(first_divergence(a, b), Agreement)
    write_rank(tmp_path / "c", 0, [replace(s, numpy=f"{s.n + 100:016x}") for s in trajectory(1, 5)])
    drawn = first_divergence(a, read_steps(tmp_path / "c"))
    assert isinstance(drawn, Divergence) and (drawn.first.kind, drawn.first.name) == ("rng", "numpy")


def test_batches_a_resumed_run_drew_to_skip_them_are_not_its_steps(tmp_path: Path) -> None:
    """A loop that restores its data position by drawing the batches it already trained on
    (`next(it)` k times; the Trainer skips so too): the resumed run's records start with them."""
    write_samples(tmp_path / "ref", 0, [[s] for s in range(1, 31)])
    write_samples(tmp_path / "other", 0, [[s] for s in range(1, 31)])  # 20 skipped, then 21..30 trained
    found, _, _ = _runs(tmp_path, trajectory(1, 30), _resumed())
    assert isinstance(found, Agreement) and found.samples_compared, found
    write_samples(tmp_path / "wrong", 0, [[s] for s in range(1, 21)] + [[s] for s in range(1, 11)])
    write_rank(tmp_path / "wrong", 0, _resumed())
    ref, wrong = read_steps(tmp_path / "ref"), read_steps(tmp_path / "wrong")
    found = first_divergence(ref, wrong, offset=20, samples=(read_samples(tmp_path / "ref"), read_samples(tmp_path / "wrong")))
    assert isinstance(found, Divergence) and found.first.kind == "samples" and found.first.other == "[1]"


def test_records_without_a_step_on_either_side_say_nothing(tmp_path: Path) -> None:
    """A job without torch (the toy job) under the agent: a meta line, perhaps a seeding, no
    step. Nothing is compared and nothing is added to the report."""
    for run in ("a", "b"):
        write_rank(tmp_path / run, 0, [], before=[{"k": "seed", "t": 0.0, "call": "random.seed"}])
    assert observe_runs(tmp_path / "a", tmp_path / "b") is None
    write_rank(tmp_path / "c", 0, trajectory(1, 3))
    one_sided = observe_runs(tmp_path / "a", tmp_path / "c")
    assert one_sided is not None and isinstance(one_sided.divergence, NoComparison)


def test_a_job_counting_from_0_is_named_by_its_printed_steps(tmp_path: Path) -> None:
    """nanoGPT prints `iter 0` for its first optimizer step: a resume at `iter 10` is its 11th
    step, and the steps named are the iters it printed."""
    write_rank(tmp_path / "ref", 0, trajectory(1, 30))
    write_rank(tmp_path / "resumed", 0, [replace(s, rng="00000000000000ff", grad=999) if s.n == 1 else s
                                         for s in trajectory(1, 20, shift=10)])
    observed = observe_runs(tmp_path / "ref", tmp_path / "resumed", printed=10, counted_from=0, last_printed=29)
    assert observed is not None and isinstance(observed.divergence, Divergence)
    assert observed.divergence.step == 10 and "generator's state at step 10's start" in observed.divergence.sentence()
    write_rank(tmp_path / "twin", 0, [replace(s, param=s.param + 5) for s in trajectory(1, 30)])
    twins = observe_runs(tmp_path / "ref", tmp_path / "twin", counted_from=0, last_printed=29)
    assert twins is not None and isinstance(twins.divergence, Divergence) and twins.divergence.step == 0
    causes = observed_determinism_causes(twins.divergence, twins.reference, twins.other)
    assert causes[0].key == "seed" and "at step 0 against" in causes[0].observation


def test_a_frameworks_own_rng_isolation_and_a_cleared_optimizer_do_not_fool_the_causes(tmp_path: Path) -> None:
    """Lightning's isolate_rng sets the RNG states it read itself (``by`` its seed module): no
    resume's restore; an optimizer state loaded, then cleared, is absent at the first resumed
    step: the optimizer's, not a stale checkpoint's."""
    resumed = [replace(s, rng="00000000000000ff" if s.n == 1 else s.rng, grad=999 if s.n == 1 else s.grad)
               for s in _resumed()]
    isolated = restore("torch.set_rng_state", "random.setstate", by="lightning.fabric.utilities.seed")
    found, other, saver = _runs(tmp_path, trajectory(1, 30), resumed, saved=save("model", "optimizer", "value"),
                                restores=restore("Module.load_state_dict", "Optimizer.load_state_dict") + isolated)
    assert isinstance(found, Divergence) and found.first.kind == "rng"
    assert "torch.set_rng_state" not in other.restore_calls()
    assert observed_resume_causes(found, other, saver)[0].observation.startswith(
        "its checkpoint saves no RNG state and the resume sets none")
    cleared = [replace(s, no_optim=True) if s.n == 1 else replace(s, optim=0) for s in _resumed()]
    found, other, saver = _runs(tmp_path / "cleared", trajectory(1, 30), cleared)
    assert isinstance(found, Divergence) and found.first.other == "absent"
    cause = observed_resume_causes(found, other, saver)[0]
    assert cause.key == "optimizer" and "though the resumed run loaded an optimizer state" in cause.observation


def test_other_samples_beside_an_rng_state_set_name_the_data_position(tmp_path: Path) -> None:
    """A resume that sets the RNG state and still draws other batches (the Trainer's skip turned
    off): the batches part it, the RNG state follows from drawing them."""
    write_samples(tmp_path / "ref", 0, [[s, s + 1] for s in range(1, 31)])
    write_samples(tmp_path / "other", 0, [[s, s + 1] for s in range(1, 11)])
    resumed = [replace(s, rng="00000000000000ff", grad=0) for s in _resumed()]
    found, other, saver = _runs(tmp_path, trajectory(1, 30), resumed)
    assert isinstance(found, Divergence) and {"rng", "samples"} <= found.kinds
    assert [c.key for c in observed_resume_causes(found, other, saver)] == ["data_position"]
    # no RNG state set either (Lightning's usual script): the batches of step 1 drawn again at
    # step 21 are the data position's doing, which no generator's state explains
    found, other, saver = _runs(tmp_path, trajectory(1, 30), resumed, saved=save("model", "optimizer", "value"),
                                restores=restore("Module.load_state_dict", "Optimizer.load_state_dict"))
    assert isinstance(found, Divergence)
    causes = observed_resume_causes(found, other, saver)
    assert causes[0].key == "data_position" and "(the samples of step 1 again)" in causes[0].observation
    # other batches that are no earlier step's, beside an RNG never set: the RNG, first
    write_samples(tmp_path / "other", 0, [[s + 100, s] for s in range(1, 11)])
    found, other, saver = _runs(tmp_path, trajectory(1, 30), resumed, saved=save("model", "optimizer", "value"),
                                restores=restore("Module.load_state_dict", "Optimizer.load_state_dict"))
    assert isinstance(found, Divergence)
    assert [c.key for c in observed_resume_causes(found, other, saver)][:2] == ["rng", "data_position"]


def test_a_loader_that_reads_one_batch_ahead_still_has_its_samples_compared(tmp_path: Path) -> None:
    """accelerate's loaders (the HF Trainer's) draw one batch more than the steps take: the batch
    read ahead at the end is no step's, and no skip at the start."""
    write_samples(tmp_path / "ref", 0, [[s, s + 1] for s in range(1, 32)])  # 30 steps + 1 ahead
    write_samples(tmp_path / "other", 0, [[s, s + 1] for s in range(1, 12)])  # 10 steps + 1 ahead
    found, _, _ = _runs(tmp_path, trajectory(1, 30), [replace(s, grad=0) for s in _resumed()])
    assert isinstance(found, Divergence) and found.first.kind == "samples" and found.samples_compared
    assert (found.first.reference, found.first.other, found.first.replays) == ("[21, 22]", "[1, 2]", 1)


def test_the_rng_cause_says_what_the_checkpoint_the_resume_read_holds_not_what_a_save_once_wrote(
        tmp_path: Path) -> None:
    """run_clm.py's ``rng_not_saved`` plant: the Trainer saves rng_state.pth and the plant
    deletes it; the resume loads the other files of a kept copy of checkpoint-5 and sets no RNG
    state. The checkpoint it read holds none (the save record alone says it held some). Where
    the file is there and the resume only never loads it, the checkpoint it loaded holds some."""
    saved = [save("model", path=str(tmp_path / "ref/checkpoints/checkpoint-5/model.safetensors")),
             {**save(path=str(tmp_path / "ref/checkpoints/checkpoint-5/optimizer.pt")), "whole": "optimizer"},
             {**save(path=str(tmp_path / "ref/checkpoints/checkpoint-5/scheduler.pt")), "whole": "scheduler"},
             {**save(path=str(tmp_path / "ref/checkpoints/checkpoint-5/rng_state.pth")), "whole": "rng"}]
    kept = tmp_path / "kept" / "checkpoint-5"  # the copy the resume loads, without rng_state.pth
    kept.mkdir(parents=True)
    loads = [line for name in ("model.safetensors", "optimizer.pt", "scheduler.pt")
             for line in restore("torch.load", path=str(kept / name))]
    (kept / "scheduler.pt").write_bytes(b"")
    resumed = [replace(s, rng="00000000000000ff" if s.n == 1 else s.rng, grad=999 if s.n == 1 else s.grad)
               for s in _resumed()]
    write_rank(tmp_path / "ref", 0, trajectory(1, 30), extra=saved)
    write_rank(tmp_path / "other", 0, resumed,
               before=loads + restore("Module.load_state_dict", "Optimizer.load_state_dict",
                                      "LRScheduler.load_state_dict"))
    ref, other = read_steps(tmp_path / "ref"), read_steps(tmp_path / "other")
    found = first_divergence(ref, other, offset=20)
    assert isinstance(found, Divergence) and found.first.kind == "rng"
    cause = observed_resume_causes(found, other, ref)[0]
    assert cause.key == "rng"
    assert cause.observation.startswith(
        "its checkpoint holds no RNG state and the resume sets none: the save wrote checkpoint-5/rng_state.pth, "
        "which is not in the folder the resume loaded from: the torch CPU generator's state"), cause.observation
    assert "holds some" not in cause.observation
    (kept / "rng_state.pth").write_bytes(b"")  # there, and never loaded: the resume forgets it
    cause = observed_resume_causes(found, other, ref)[0]
    assert cause.observation.startswith("the resume sets no RNG state (no torch.set_rng_state, numpy.random.set_state "
                                        "or random.setstate call) although the checkpoint it loaded holds some: ")
    # a file of another checkpoint (checkpoint-10's rng_state.pth) says nothing of this one
    (kept / "rng_state.pth").unlink()
    write_rank(tmp_path / "ref", 0, trajectory(1, 30), extra=[
        *saved[:3], {**save(path=str(tmp_path / "ref/checkpoints/checkpoint-10/rng_state.pth")), "whole": "rng"}])
    cause = observed_resume_causes(found, other, read_steps(tmp_path / "ref"))[0]
    assert cause.observation.startswith("its checkpoint saves no RNG state and the resume sets none: ")
