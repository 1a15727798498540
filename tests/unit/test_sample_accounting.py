"""Every sample exactly once: the accounting of an interrupted run's samples against the
uninterrupted run's, per epoch (trainguard.checks.accounting)."""

from __future__ import annotations

import json
from pathlib import Path

from trainguard.checks.accounting import Segment, account_samples, index_ranges
from trainguard.launch import MetricPoint, RunResult
from trainguard.launch.hook import SAMPLES_DIR
from trainguard.launch.samples import SampleBatch

DATA = "Sequences(40)"


def _run(world: int, order: list[int], *, per_rank: int = 2, epochs: int = 2, start_step: int = 1,
         steps: int | None = None, skip: int = 0, pad: bool = False) -> dict[int, list[SampleBatch]]:
    """The batches of ``world`` ranks, ``per_rank`` samples each per step, over ``epochs`` passes
    of ``order`` (an epoch is len(order) // (world * per_rank) steps); ``skip`` steps of the first
    epoch not drawn (a resumed loader); ``pad`` repeats the first samples to fill the last step
    (DistributedSampler's padding at a world size that does not divide the data)."""
    step_size = world * per_rank
    data = list(order)
    if pad and len(data) % step_size:
        data += data[: step_size - len(data) % step_size]
    per_epoch = len(data) // step_size
    out: dict[int, list[SampleBatch]] = {r: [] for r in range(world)}
    step = 0
    for e in range(epochs):
        for s in range(per_epoch):
            if e == 0 and s < skip:
                continue
            step += 1
            if steps is not None and step > steps:
                return out
            chunk = data[s * step_size:(s + 1) * step_size]
            for r in range(world):
                out[r].append(SampleBatch(0, DATA, e, s, chunk[r * per_rank:(r + 1) * per_rank]))
    return out


ORDER = list(range(40))


def test_a_resume_from_the_right_position_trains_every_sample_as_often() -> None:
    reference = _run(2, ORDER)                          # 10 steps an epoch, 20 steps
    killed = _run(2, ORDER, steps=8)                    # killed after step 8, checkpoint at 5
    resumed = _run(2, ORDER, skip=5, epochs=2)          # resumes at step 6 of epoch 0
    accounting = account_samples(reference, [Segment(killed, 1, 5, "before the kill"),
                                             Segment(resumed, 6, 20, "after the resume at step 5")], steps=20)
    assert accounting.known and accounting.ok and accounting.compared_steps == 20, accounting.summary()


def test_a_loader_that_restarts_its_epoch_trains_the_start_twice_and_never_the_rest() -> None:
    reference = _run(2, ORDER)
    killed = _run(2, ORDER, steps=8)
    restarted = _run(2, ORDER, epochs=2)                # the position lost: epoch 0 from its start
    accounting = account_samples(reference, [Segment(killed, 1, 5, "before the kill"),
                                             Segment(restarted, 6, 20, "after the resume at step 5")], steps=20)
    assert not accounting.ok
    first = accounting.epochs[0]
    assert (first.epoch, first.first_step, first.last_step) == (0, 1, 10)
    assert index_ranges(first.twice) == "0-19" and index_ranges(first.never) == "20-39"
    assert first.sentence() == ("samples 20-39 never trained in epoch 0 (steps 1-10) after the resume at step 5; "
                                "samples 0-19 trained twice")


def test_a_world_size_that_does_not_divide_the_data_pads_with_samples_trained_twice() -> None:
    """The resumed run at 3 ranks splits 8 samples a step 3-3-2 and its sampler pads each rank's
    share to the same length with samples from the start (DistributedSampler, drop_last=False)."""
    reference = _run(1, ORDER, per_rank=8, epochs=1)            # 5 steps of 8: samples 0-39
    killed = _run(1, ORDER, per_rank=8, epochs=1, steps=3)
    resumed = {0: [SampleBatch(0, DATA, 0, 0, [24, 25, 26]), SampleBatch(0, DATA, 0, 1, [32, 33, 34])],
               1: [SampleBatch(0, DATA, 0, 0, [27, 28, 29]), SampleBatch(0, DATA, 0, 1, [35, 36, 37])],
               2: [SampleBatch(0, DATA, 0, 0, [30, 31, 0]), SampleBatch(0, DATA, 0, 1, [38, 39, 1])]}
    accounting = account_samples(reference, [Segment(killed, 1, 3), Segment(resumed, 4, 5, "at 3 ranks")], steps=5)
    assert [(index_ranges(e.twice), index_ranges(e.never)) for e in accounting.epochs] == [("0-1", "")]
    assert accounting.summary() == "in epoch 0 (steps 1-5) at 3 ranks samples 0-1 trained twice"


def test_records_that_cannot_be_split_into_steps_say_so_and_claim_nothing() -> None:
    reference = _run(2, ORDER, steps=7)
    accounting = account_samples(reference, [Segment(reference, 1, 7)], steps=3)  # 7 batches, 3 steps
    assert not accounting.known and not accounting.ok and "not a whole number per step" in accounting.summary()
    empty = account_samples({}, [], steps=5)
    assert not empty.known and "no sample records" in empty.summary()


def test_index_ranges() -> None:
    assert index_ranges([5, 1, 2, 3, 9, 10]) == "1-3, 5, 9-10"
    assert index_ranges(list(range(0, 40, 2)), limit=3) == "0, 2, 4, ... (17 more ranges)"
    assert index_ranges(["a", 1]) == "1, 'a'"


def test_reshard_names_uneven_shares_from_samples_trained_twice() -> None:
    from trainguard.checks.diagnosis import STRONG
    from trainguard.checks.reshard import PairFacts, rank_reshard_causes

    reference = _run(1, ORDER, per_rank=8, epochs=1)
    killed = _run(1, ORDER, per_rank=8, epochs=1, steps=3)
    padded = {0: [SampleBatch(0, DATA, 0, 0, [24, 25, 26]), SampleBatch(0, DATA, 0, 1, [32, 33, 34])],
              1: [SampleBatch(0, DATA, 0, 0, [27, 28, 29]), SampleBatch(0, DATA, 0, 1, [35, 36, 37])],
              2: [SampleBatch(0, DATA, 0, 0, [30, 31, 0]), SampleBatch(0, DATA, 0, 1, [38, 39, 1])]}
    uneven = account_samples(reference, [Segment(killed, 1, 3), Segment(padded, 4, 5, "at 3 ranks")], steps=5)
    causes = rank_reshard_causes(PairFacts(3, 4, None, None, accounting=uneven))
    assert causes[0].key == "uneven" and causes[0].strength == STRONG
    assert "samples 0-1 trained twice" in causes[0].phrase()
    # a position lost at the new size: samples trained twice and others never
    restarted = account_samples(reference, [Segment(killed, 1, 3), Segment(killed, 4, 5)], steps=5)
    assert rank_reshard_causes(PairFacts(3, 4, None, None, accounting=restarted))[0].key == "sampler_offset"
    # every sample once: no data cause from the accounting
    rest = {r: b[3:] for r, b in reference.items()}
    exact = account_samples(reference, [Segment(killed, 1, 3), Segment(rest, 4, 5)], steps=5)
    assert exact.ok
    assert {c.key for c in rank_reshard_causes(PairFacts(3, 6, None, None, accounting=exact)) if c.strength > 0} == set()


def test_parallel_names_a_data_order_that_depends_on_the_world_size() -> None:
    """run_clm_no_trainer.py's 2 ranks drew another shuffle than its 1 rank: parallel once left
    "each rank reads the same shard" first."""
    from trainguard.checks.equivalence import (
        PARALLEL_CAUSES,
        PARALLEL_ORDER_CAUSE,
        parallel_sample_cause,
    )

    one = _run(1, ORDER, per_rank=4, epochs=1)                      # 10 steps of 4
    same = _run(2, ORDER, per_rank=2, epochs=1)                     # the same 4 a step
    assert parallel_sample_cause(one, same, steps=10, world_size=2) is None
    shuffled = _run(2, ORDER[0::2] + ORDER[1::2], per_rank=2, epochs=1)
    cause, why = parallel_sample_cause(one, shuffled, steps=10, world_size=2) or ("", "")
    assert cause == PARALLEL_ORDER_CAUSE
    assert why == ("at step 1 the 2 rank(s) drew samples that no step of the 1-rank reference drew "
                   "together: the data order depends on the world size")
    bigger = _run(2, ORDER, per_rank=4, epochs=1)                   # 8 a step: the batch doubled
    assert (parallel_sample_cause(one, bigger, steps=10, world_size=2) or ("",))[0] == PARALLEL_CAUSES[2]


def test_parallel_names_the_order_within_a_printed_step_that_spans_many_batches() -> None:
    """run_clm_no_trainer.py prints a line per epoch: at 1 and 2 ranks every printed step holds
    the whole epoch, so the samples per step agree while the order batch by batch does not."""
    from trainguard.checks.equivalence import PARALLEL_ORDER_CAUSE, parallel_sample_cause

    one = _run(1, ORDER, per_rank=4, epochs=2)                      # 2 printed steps of 10 batches
    same = _run(2, ORDER, per_rank=2, epochs=2)
    assert parallel_sample_cause(one, same, steps=2, world_size=2) is None
    shuffled = _run(2, ORDER[0::2] + ORDER[1::2], per_rank=2, epochs=2)
    cause, why = parallel_sample_cause(one, shuffled, steps=2, world_size=2) or ("", "")
    assert cause == PARALLEL_ORDER_CAUSE, why
    assert "same samples per printed step as 1 rank, but not batch by batch (first at batch 1, of 10 a step)" in why
    # a step of one batch: the per-step comparison above already covers it
    single_batch = _run(1, ORDER, per_rank=4, epochs=1)
    assert parallel_sample_cause(single_batch, _run(2, ORDER, per_rank=2, epochs=1), steps=10, world_size=2) is None


def test_a_run_resumed_inside_what_the_job_counts_as_a_step_is_not_accounted() -> None:
    """run_clm_no_trainer.py prints one line per epoch: a resume from its mid-epoch checkpoint
    draws the rest of the epoch, then the next. Split into whole epochs its batches straddle two
    passes, and the accounting once claimed samples never trained in every later epoch."""
    reference = _run(1, ORDER, per_rank=4, epochs=3, steps=None)
    per_epoch = 10                                                    # batches of 4 per epoch
    batches = reference[0]
    reference = {0: batches}
    resumed = {0: [SampleBatch(1, DATA, 0, i, b.indices) for i, b in enumerate(batches[3:per_epoch])]
               + [SampleBatch(1, DATA, 1, i, b.indices) for i, b in enumerate(batches[per_epoch:])]}
    accounting = account_samples(reference, [Segment({0: []}, 1, 0), Segment(resumed, 1, 3, "after the resume")],
                                 steps=3)
    assert not accounting.known and "resumed inside a step" in accounting.summary(), accounting.summary()


def _attempt(tmp: Path, name: str, batches: dict[int, list[SampleBatch]], printed: range) -> RunResult:
    """A run (or a drill's attempt) that recorded ``batches`` and printed the loss of ``printed``."""
    folder = tmp / name / SAMPLES_DIR
    folder.mkdir(parents=True)
    for rank, drawn in batches.items():
        (folder / f"rank{rank}.jsonl").write_text("".join(
            json.dumps({"loader": b.loader, "dataset": b.dataset, "iter": b.iter, "batch": b.batch,
                        "indices": list(b.indices)}) + "\n" for b in drawn))
    points = [MetricPoint("loss", s, 1.0, 0, float(s)) for s in printed]
    return RunResult("ok", [], tmp / name, 1, 0, [], points, 1.0, None)


def test_a_drills_attempts_are_accounted_sample_by_sample(tmp_path: Path) -> None:
    """A recover drill killed after step 6 restarts from step 5's checkpoint: the restart must
    draw the samples of steps 6-10. One whose loader started its epoch again trains the
    samples of steps 1-5 twice and those of 6-10 never: the attempts' accounting says so."""
    from trainguard.drills.steps import attempts_accounting

    reference = _attempt(tmp_path, "reference", _run(1, ORDER, per_rank=4, epochs=1), range(1, 11))
    killed = _attempt(tmp_path, "attempt-0", _run(1, ORDER, per_rank=4, epochs=1, steps=6), range(1, 7))
    resumed = _attempt(tmp_path, "attempt-1", _run(1, ORDER, per_rank=4, epochs=1, skip=5), range(6, 11))
    exact = attempts_accounting(reference, [killed, resumed], "loss", 10)
    assert exact is not None and exact.known and exact.ok, exact.summary()
    again = _attempt(tmp_path, "attempt-1-again", _run(1, ORDER, per_rank=4, epochs=1, steps=5), range(6, 11))
    lost = attempts_accounting(reference, [killed, again], "loss", 10)
    assert lost is not None and not lost.ok
    assert "never trained" in lost.summary() and "trained twice" in lost.summary(), lost.summary()
    assert "after restart 1 (resumed from step 5)" in lost.summary(), lost.summary()
    # no restart: nothing to account
    assert attempts_accounting(reference, [killed], "loss", 10) is None
