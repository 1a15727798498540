"""Diagnosis of a failed resume: the causes ranked by evidence, the one the evidence shows first."""

from __future__ import annotations

from pathlib import Path

from trainguard.checks.diagnosis import (
    DECISIVE,
    NONE,
    STRONG,
    SUGGESTIVE,
    ResumeFacts,
    data_order_note,
    diagnose_resume,
    explain,
    sample_replay,
    shared_shard_note,
)
from trainguard.checks.framework_warnings import framework_warnings
from trainguard.launch.samples import SampleBatch
from trainguard.unit.checkpoints import CheckpointInventory, StateComparison

FULL = {"model": ["model.w"], "optimizer": ["optimizer.state.0.exp_avg"], "scheduler": ["scheduler.last_epoch"],
        "rng": ["rng.torch"], "data": ["sampler.position"], "counters": ["step"]}


def _inventory(*lacking: str, **details: str) -> CheckpointInventory:
    return CheckpointInventory(Path("/ck/step_5.pt"), files=["step_5.pt"],
                               components={k: v for k, v in FULL.items() if k not in lacking}, details=details)


def _epochs(n_batches: int, order: list[list[int]]) -> list[SampleBatch]:
    """Batches of one loader over passes: ``order[e]`` the indices of pass e, cut in batches of 2."""
    out = []
    for e, indices in enumerate(order):
        for b in range(n_batches):
            out.append(SampleBatch(0, "TensorDataset(8)", e, b, indices[2 * b:2 * b + 2]))
    return out


EPOCH0 = [3, 1, 7, 0, 5, 2, 6, 4]
EPOCH1 = [6, 0, 2, 5, 1, 4, 7, 3]
REFERENCE = _epochs(4, [EPOCH0, EPOCH1])  # 8 steps, a batch each


def _resumed(from_step: int, order: list[int], start: int) -> list[SampleBatch]:
    return [SampleBatch(0, "TensorDataset(8)", 0, b, order[2 * b:2 * b + 2]) for b in range(start, 4)]


def _top(facts: ResumeFacts) -> str:
    return diagnose_resume(facts)[0].key


def test_a_resumed_step_that_replays_the_epoch_start_names_the_data_position_with_the_samples() -> None:
    # resumed from step 6 (next: batch 2 of epoch 1) but the sampler restarts the epoch at batch 0
    replay = sample_replay(REFERENCE, _resumed(6, EPOCH1, 0), resumed_from=6, steps=8)
    assert replay is not None and not replay.same and replay.matched_step == 5
    assert "the resumed step 7 trained on the samples of step 5" in replay.sentence()
    causes = diagnose_resume(ResumeFacts(6, first_divergent_step=7, checkpoint=_inventory(), replay=replay))
    assert causes[0].key == "data_position" and "samples of step 5" in causes[0].evidence[0]
    assert explain(causes).startswith("most likely data position not saved")


def test_the_same_samples_rule_the_data_position_out() -> None:
    replay = sample_replay(REFERENCE, _resumed(6, EPOCH1, 2), resumed_from=6, steps=8)
    assert replay is not None and replay.same
    causes = diagnose_resume(ResumeFacts(6, first_divergent_step=7, checkpoint=_inventory(), replay=replay))
    assert causes[-1].key == "data_position" and causes[-1].ruled_out


def test_a_new_dataloader_per_epoch_is_read_as_one_stream_of_batches() -> None:
    """A job that builds a DataLoader per epoch: the reference's epochs are two loaders (0, 1)
    of 4 batches; the resumed run's rest of epoch 1 is its loader 0. Reading only the loader with
    the most batches compared the resumed batch with epoch 0's and named the wrong cause."""
    reference = [SampleBatch(e, b.dataset, 0, b.batch, b.indices) for e, b in
                 ((i // 4, b) for i, b in enumerate(REFERENCE))]
    resumed = _resumed(6, EPOCH1, 2)  # the right samples: batch 2 of epoch 1
    replay = sample_replay(reference, resumed, resumed_from=6, steps=8)
    assert replay is not None and replay.same, replay


def test_a_reshuffled_order_without_rng_in_the_checkpoint_names_the_rng_first() -> None:
    other = [0, 1, 2, 3, 4, 5, 6, 7]  # no step of the reference drew these pairs
    replay = sample_replay(REFERENCE, _resumed(6, other, 2), resumed_from=6, steps=8)
    assert replay is not None and replay.matched_step is None
    causes = diagnose_resume(ResumeFacts(6, first_divergent_step=7, checkpoint=_inventory("rng"), replay=replay))
    assert causes[0].key == "rng"
    assert any("holds no RNG state" in e for e in causes[0].evidence)


def test_a_checkpoint_without_rng_state_puts_rng_before_the_generic_causes() -> None:
    # nanoGPT: model, optimizer, iter_num; no RNG, no DataLoader to record
    causes = diagnose_resume(ResumeFacts(5, first_divergent_step=6, checkpoint=_inventory("rng", "scheduler", "data")))
    assert causes[0].key == "rng"
    order = [c.key for c in causes]
    assert order.index("optimizer") > order.index("data_position")  # it holds optimizer state


def test_final_state_counters_name_the_optimizer_and_the_scheduler() -> None:
    optimizer = StateComparison(True, differing=[("model.w", "differs"), ("optimizer.state.0.exp_avg", "differs"),
                                                 ("optimizer.state.0.step", "resumed 7.0 vs reference 12.0")],
                                by_component={"model": ["model.w"],
                                              "optimizer": ["optimizer.state.0.exp_avg", "optimizer.state.0.step"]})
    causes = diagnose_resume(ResumeFacts(5, first_divergent_step=6, checkpoint=_inventory(), final_state=optimizer))
    assert causes[0].key == "optimizer" and "7.0 vs reference 12.0" in causes[0].evidence[0]

    scheduler = StateComparison(True, differing=[("scheduler.last_epoch", "7 vs 12")],
                                by_component={"scheduler": ["scheduler.last_epoch"]})
    assert _top(ResumeFacts(5, first_divergent_step=6, checkpoint=_inventory(), final_state=scheduler)) == "scheduler"


def test_an_lr_metric_decides_the_scheduler_either_way() -> None:
    assert _top(ResumeFacts(5, first_divergent_step=6, lr=(6, "lr"))) == "scheduler"
    causes = diagnose_resume(ResumeFacts(5, first_divergent_step=6, lr=(None, "lr")))
    assert next(c for c in causes if c.key == "scheduler").ruled_out


def test_no_checkpoint_before_the_kill_comes_first() -> None:
    assert _top(ResumeFacts(0, first_divergent_step=1, checkpoint=None)) == "no_checkpoint"


def test_without_evidence_the_order_is_the_generic_one_and_nothing_is_claimed() -> None:
    causes = diagnose_resume(ResumeFacts(5, first_divergent_step=6))
    assert explain(causes) == ""
    assert all(c.strength == 0 for c in causes if c.key != "no_checkpoint")
    assert causes[-1].key == "no_checkpoint" and causes[-1].ruled_out  # it went on from step 5


def test_framework_warnings_pass_on_the_lines_that_name_a_cause() -> None:
    lines = [
        "Epoch 0:  40%|####      | 4/10",
        "UserWarning: You're resuming from a checkpoint that ended before the epoch ended and your "
        "dataloader is not resumable. This can cause unreliable results if further training is done.",
        "some unrelated warning about tokenizers parallelism",
    ]
    found = framework_warnings(lines)
    assert [k for k, _ in found] == ["data_position"]
    causes = diagnose_resume(ResumeFacts(5, first_divergent_step=6, warnings=found))
    assert causes[0].key == "data_position" and "not resumable" in causes[0].evidence[0]
    assert framework_warnings(["all good", "step 5 loss 1.0"]) == []


def test_determinism_and_parallel_notes_from_the_samples() -> None:
    shuffled = _epochs(4, [EPOCH1, EPOCH0])
    note = data_order_note(REFERENCE, shuffled)
    assert note is not None and "different samples from batch 1" in note
    same = data_order_note(REFERENCE, list(REFERENCE))
    assert same is not None and "not the cause" in same

    assert shared_shard_note({0: REFERENCE, 1: list(REFERENCE)}) is not None
    assert shared_shard_note({0: REFERENCE, 1: shuffled}) is None


def test_other_samples_after_the_resume_with_rng_in_the_checkpoint_name_the_data_position_first() -> None:
    """examples/fsdp2 with a bug of its own: the loader state of an epoch's end was restored into
    the next epoch's sampler, so the resume skipped an epoch. The first resumed step drew other
    samples and the final RNG states differed (a default DataLoader draws its workers' seeds from
    the global RNG at each pass); the check named the RNG first, the data position second."""
    other = [0, 1, 2, 3, 4, 5, 6, 7]  # no step of the reference drew these pairs
    replay = sample_replay(REFERENCE, _resumed(6, other, 2), resumed_from=6, steps=8)
    assert replay is not None and replay.matched_step is None
    rng = StateComparison(True, differing=[("model.w", "differs"), ("rng.rank0", "differs")],
                          by_component={"model": ["model.w"], "rng": ["rng.rank0"]})
    causes = diagnose_resume(ResumeFacts(6, first_divergent_step=7, checkpoint=_inventory(), final_state=rng,
                                         replay=replay))
    assert causes[0].key == "data_position" and "the checkpoint holds RNG state" in causes[0].evidence[0]
    later = next(c for c in causes if c.key == "rng")
    assert later.strength < causes[0].strength and "or the data after the resume differ" in later.evidence[0]
    # the same final RNG difference with the same samples still names the RNG
    same = sample_replay(REFERENCE, _resumed(6, EPOCH1, 2), resumed_from=6, steps=8)
    assert _top(ResumeFacts(6, first_divergent_step=7, checkpoint=_inventory(), final_state=rng,
                            replay=same)) == "rng"


def test_the_same_samples_and_a_loss_that_differs_at_the_first_resumed_step_point_at_the_rng() -> None:
    """Megatron-LM PR 6858's case: every rank saved its RNG state under one key, the checkpoint
    kept rank 0's and every rank came back drawing rank 0's dropout masks."""
    replay = sample_replay(REFERENCE, _resumed(6, EPOCH1, 2), resumed_from=6, steps=8)
    assert replay is not None and replay.same
    one_state = _inventory()
    one_state.torch_rng_states = 1
    causes = diagnose_resume(ResumeFacts(6, first_divergent_step=7, checkpoint=one_state, replay=replay, world_size=2))
    assert causes[0].key == "rng" and causes[0].strength == STRONG
    assert any("one torch RNG state for 2 ranks" in e for e in causes[0].evidence)
    # one state per rank: the boundary alone is only suggestive; one rank needs only one state
    per_rank = _inventory()
    per_rank.torch_rng_states = 2
    assert diagnose_resume(ResumeFacts(6, first_divergent_step=7, checkpoint=per_rank, replay=replay,
                                       world_size=2))[0].strength == SUGGESTIVE
    assert diagnose_resume(ResumeFacts(6, first_divergent_step=7, checkpoint=one_state, replay=replay,
                                       world_size=1))[0].strength == SUGGESTIVE
    # a divergence a step later is not the RNG's boundary sign
    later = diagnose_resume(ResumeFacts(6, first_divergent_step=8, checkpoint=per_rank, replay=replay, world_size=2))
    assert next(c for c in later if c.key == "rng").strength == NONE


def test_samples_trained_twice_or_never_name_the_data_position() -> None:
    accounted = "samples 20-39 never trained in epoch 0 (steps 1-10) after the resume at step 5; samples 0-19 trained twice"
    causes = diagnose_resume(ResumeFacts(5, first_divergent_step=6, checkpoint=_inventory(), samples_accounted=accounted))
    assert causes[0].key == "data_position" and causes[0].strength == STRONG and accounted in causes[0].evidence


def test_a_job_counting_from_0_that_resumed_from_step_0_did_not_begin_again() -> None:
    """run_clm_no_trainer.py prints `epoch 0` first: a resume from its mid-epoch checkpoint prints
    epoch 1 first, resumed_from 0. That is not a restart from scratch."""
    resumed = diagnose_resume(ResumeFacts(0, first_divergent_step=1, checkpoint=_inventory(), began_again=False))
    assert next(c for c in resumed if c.key == "no_checkpoint").ruled_out
    again = diagnose_resume(ResumeFacts(0, first_divergent_step=0, checkpoint=_inventory(), began_again=True))
    assert again[0].key == "no_checkpoint"


def test_a_component_in_a_file_not_read_safely_is_not_called_missing() -> None:
    """accelerate's sampler_1.bin pickles the sampler object: skipped unread, it once read as
    "step_15 holds no data position"."""
    unread = _inventory("data")
    unread.skipped = {"sampler_1.bin": "needs full unpickling (a SeedableRandomSampler)"}
    causes = diagnose_resume(ResumeFacts(5, first_divergent_step=6, checkpoint=unread))
    assert not any("holds no data position" in e for c in causes for e in c.evidence)
    assert any("holds no data position" in e for c in diagnose_resume(
        ResumeFacts(5, first_divergent_step=6, checkpoint=_inventory("data"))) for e in c.evidence)


def test_a_gpu_job_whose_checkpoint_holds_no_cuda_rng_state_names_the_rng() -> None:
    """A job that ran on the GPU (NVML saw its memory) and saved only the CPU generator: its
    dropout masks after the resume start again from the seed. On a CPU job the same checkpoint
    is whole, and a checkpoint with a CUDA state is not blamed."""
    replay = sample_replay(REFERENCE, _resumed(6, EPOCH1, 2), resumed_from=6, steps=8)
    cpu_only = _inventory()
    cpu_only.torch_rng_states = 1
    causes = diagnose_resume(ResumeFacts(6, first_divergent_step=7, checkpoint=cpu_only, replay=replay, on_gpu=True))
    assert causes[0].key == "rng" and causes[0].strength >= STRONG
    assert any("none of the CUDA generator" in e for e in causes[0].evidence)
    on_cpu = diagnose_resume(ResumeFacts(6, first_divergent_step=7, checkpoint=cpu_only, replay=replay))
    assert not any("CUDA" in e for c in on_cpu for e in c.evidence)
    with_cuda = _inventory()
    with_cuda.torch_rng_states, with_cuda.cuda_rng_states = 1, 1
    causes = diagnose_resume(ResumeFacts(6, first_divergent_step=7, checkpoint=with_cuda, replay=replay, on_gpu=True))
    assert not any("CUDA" in e for c in causes for e in c.evidence)


def test_a_loss_scale_metric_that_parts_at_the_resume_names_the_scaler() -> None:
    """fp16 with a GradScaler not restored: the loss agrees until the first step one run skips
    (an overflow), while the printed scale differs from the first resumed step. A scale that
    parts only after the loss is a consequence, not the cause."""
    scaler_first = diagnose_resume(ResumeFacts(20, first_divergent_step=23, checkpoint=_inventory(),
                                                metrics={"loss": 23, "loss_scale": 21}))
    assert scaler_first[0].key == "scaler" and scaler_first[0].strength == DECISIVE
    assert "loss_scale differs from step 21" in scaler_first[0].evidence[0]
    after = diagnose_resume(ResumeFacts(20, first_divergent_step=23, checkpoint=_inventory(),
                                        metrics={"loss": 23, "scale": 25}))
    assert next(c for c in after if c.key == "scaler").strength == SUGGESTIVE
    matching = diagnose_resume(ResumeFacts(20, first_divergent_step=23, checkpoint=_inventory(),
                                           metrics={"loss": 23, "grad_scale": None}))
    assert next(c for c in matching if c.key == "scaler").strength == NONE
    # a learning-rate scale is no loss scale
    other = diagnose_resume(ResumeFacts(20, first_divergent_step=23, checkpoint=_inventory(),
                                        metrics={"loss": 23, "lr_scale": 21}))
    assert next(c for c in other if c.key == "scaler").strength == NONE


def test_a_divergence_one_step_after_the_resume_points_at_the_scheduler_not_the_data_position() -> None:
    """Issue 44's opening case: a checkpoint of model, optimizer, RNG and step, not the LambdaLR.
    The first resumed step matched and the second differed: a lost data position or RNG shows at
    the first resumed step itself, a lost scheduler or optimizer state a step later. "lacks
    scheduler" and "lacks data position" tied, and dict order named the data position."""
    causes = diagnose_resume(ResumeFacts(20, first_divergent_step=22, checkpoint=_inventory("scheduler", "data")))
    assert causes[0].key == "scheduler", [(c.key, c.strength) for c in causes]
    data = next(c for c in causes if c.key == "data_position")
    assert data.strength < causes[0].strength
    assert any("first resumed step (21) matched" in e for e in data.evidence)
    assert explain(causes).startswith("most likely LR scheduler state")
    # the same checkpoint with the divergence at the first resumed step: the data position stays a candidate
    boundary = diagnose_resume(ResumeFacts(20, first_divergent_step=21, checkpoint=_inventory("scheduler", "data")))
    assert next(c for c in boundary if c.key == "data_position").strength == SUGGESTIVE
    # the first resumed step not compared (a metric printed every other step): no such conclusion
    unprinted = diagnose_resume(ResumeFacts(20, first_divergent_step=22, checkpoint=_inventory("scheduler", "data"),
                                            boundary_compared=False))
    assert next(c for c in unprinted if c.key == "data_position").strength == SUGGESTIVE


def test_a_late_small_divergence_with_the_same_samples_does_not_name_the_data_position() -> None:
    """A correct job that is merely not bitwise deterministic: the checkpoint holds no data
    position (its batches come from the RNG it restores), the resumed run drew the reference's
    samples at every step, and the runs part late. The data position was named first."""
    causes = diagnose_resume(ResumeFacts(5, first_divergent_step=12, checkpoint=_inventory("data"), samples_agree_through=12))
    assert causes[0].key == "nondeterministic", [(c.key, c.strength) for c in causes]
    assert next(c for c in causes if c.key == "data_position").ruled_out
    assert "drew the reference's samples at every step through step 12" in " ".join(
        next(c for c in causes if c.key == "data_position").evidence)
    # samples that part before the divergence still point at the data position
    other = diagnose_resume(ResumeFacts(5, first_divergent_step=12, checkpoint=_inventory("data")))
    assert other[0].key in ("data_position", "rng")


def test_the_cause_the_step_records_show_comes_first_with_its_observation(tmp_path: Path) -> None:
    """The issue's job again, now with step records: the inference alone named the scheduler
    (suggestive) beside the data position; the records show the lr of step 22 and that the
    resumed run never loaded a scheduler state, so that is named first, decisively, citing both
    values, and the report says where the runs first differ."""
    from dataclasses import replace

    from tests.steplines import restore, save, trajectory, write_rank
    from trainguard.checks.diagnosis import resume_diagnosis

    write_rank(tmp_path / "ref", 0, trajectory(1, 30))
    write_rank(tmp_path / "killed", 0, trajectory(1, 20), extra=[save("model", "optimizer", "rng", "value")])
    resumed = [replace(s, lr=0.5) if s.n >= 2 else s for s in trajectory(1, 10, shift=20)]
    write_rank(tmp_path / "resumed", 0, resumed,
               before=restore("Module.load_state_dict", "Optimizer.load_state_dict", "torch.set_rng_state"))
    facts = ResumeFacts(20, first_divergent_step=22, checkpoint=_inventory("scheduler", "data"))
    causes, found = resume_diagnosis(reference_dir=tmp_path / "ref", resumed_dir=tmp_path / "resumed", world_size=1,
                                     steps=30, facts=facts, saved_dir=tmp_path / "killed")
    assert causes[0].key == "scheduler" and causes[0].observed and causes[0].strength == DECISIVE
    assert causes[0].evidence[0].startswith("the resumed run never loaded the scheduler's state: group 0's lr is 0.5 "
                                            "at step 22 against"), causes[0].evidence
    assert causes[0].evidence[0].endswith("its checkpoint holds none")
    assert explain(causes).startswith("most likely LR scheduler state not saved or not restored: the resumed run never")
    report = found.to_dict()
    assert report["diagnosis"][0]["observed"] is True and "observed" not in report["diagnosis"][1]
    assert report["first_divergence"]["step"] == 22 and report["first_divergence"]["kind"] == "lr"
    assert report["first_divergence"]["other"] == "0.5"
    # no step records (the agent off): the inference alone, and no first_divergence in the report
    causes, found = resume_diagnosis(reference_dir=tmp_path / "none", resumed_dir=tmp_path / "none2", world_size=1,
                                     steps=30, facts=ResumeFacts(20, first_divergent_step=22,
                                                                 checkpoint=_inventory("scheduler", "data")))
    assert not causes[0].observed and "first_divergence" not in found.to_dict()


def test_a_nanogpt_like_resume_names_the_rng_from_the_records(tmp_path: Path) -> None:
    """nanoGPT saves model, optimizer, model_args, iter_num, best_val_loss and config; its resume
    seeds again and sets no RNG state: the first resumed step starts from a fresh generator."""
    from dataclasses import replace

    from tests.steplines import restore, save, trajectory, write_rank
    from trainguard.checks.diagnosis import resume_diagnosis

    write_rank(tmp_path / "ref", 0, trajectory(1, 30))
    write_rank(tmp_path / "killed", 0, trajectory(1, 20), extra=[save("model", "optimizer", "value")])
    resumed = [replace(s, rng=f"{s.n:016x}", grad=s.n) for s in trajectory(1, 10, shift=20)]
    write_rank(tmp_path / "resumed", 0, resumed, before=[{"k": "seed", "t": 0.0, "call": "torch.manual_seed"},
                                                          *restore("torch.load", "Module.load_state_dict",
                                                                   "Optimizer.load_state_dict")])
    # nanoGPT counts from iter 0: iter 20 is the 21st step, named by the iter it printed
    facts = ResumeFacts(19, first_divergent_step=20, checkpoint=_inventory("rng", "scheduler", "data"),
                        counted_from=0, last_step=29)
    causes, _ = resume_diagnosis(reference_dir=tmp_path / "ref", resumed_dir=tmp_path / "resumed", world_size=1,
                                 steps=30, facts=facts, saved_dir=tmp_path / "killed")
    assert causes[0].key == "rng" and causes[0].observed
    assert causes[0].evidence[0].startswith("its checkpoint saves no RNG state and the resume sets none: the torch CPU "
                                            "generator's state at step 20's start is"), causes[0].evidence
