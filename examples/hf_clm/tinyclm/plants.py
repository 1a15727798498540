"""Realistic checkpointing defects, planted on purpose (``train.py --plant NAME``).

The Trainer gets all of these right by itself, so each defect is a small ``TrainerCallback`` of
the kind users write, and each mimics a real mistake. The tests use them to check that trainguard
catches each defect and names its cause; a clean run plants nothing.

=========================  ==============================================================  =====================
``--plant``                what it does                                                    trainguard should say
=========================  ==============================================================  =====================
``rng_not_saved``          deletes ``rng_state*.pth`` from every checkpoint just written     resume: RNG
``optimizer_not_restored`` clears the optimizer's state (Adam moments, step counts) right    resume: optimizer
                           after the Trainer restored it
``scheduler_not_restored`` puts the LR schedule back to step 0 after the Trainer restored it resume: LR schedule
``checkpoint_only_at_exit`` saves no checkpoint but the last one                            resume: no checkpoint
                                                                                           before the kill
``checkpoint_in_place``    saves into one directory, ``checkpoint-last``, overwriting its     disk_full: torn
                           files in place (no new directory per save)                      checkpoint
=========================  ==============================================================  =====================

The data position needs no plant: ``--ignore_data_skip true`` is a real TrainingArguments option
that makes a resumed run start its epoch again from the first batch.
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments

PLANTS = (
    "rng_not_saved",
    "optimizer_not_restored",
    "scheduler_not_restored",
    "checkpoint_only_at_exit",
    "checkpoint_in_place",
)

#: the one directory ``checkpoint_in_place`` rewrites
IN_PLACE_DIR = "checkpoint-last"


class DropRngState(TrainerCallback):
    """``rng_not_saved``: the checkpoint keeps model, optimizer, scheduler and trainer state but
    no RNG state, as if the save code had forgotten it. The Trainer then resumes with the RNG as
    seeded at start-up, so dropout masks differ from the uninterrupted run's."""

    def on_save(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        checkpoint = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        rank_file = "rng_state.pth" if args.world_size <= 1 else f"rng_state_{args.process_index}.pth"
        (checkpoint / rank_file).unlink(missing_ok=True)


class ForgetOptimizerState(TrainerCallback):
    """``optimizer_not_restored``: after a resume, AdamW starts from zero moments and step count,
    as with a script that builds a fresh optimizer after loading the checkpoint."""

    def on_train_begin(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        optimizer: torch.optim.Optimizer | None = None,
        **kwargs: Any,
    ) -> None:
        if state.global_step > 0 and optimizer is not None:
            optimizer.state.clear()


class RestartSchedule(TrainerCallback):
    """``scheduler_not_restored``: after a resume the LR schedule starts over (warmup again), as
    with a script that restores the optimizer but builds a fresh scheduler."""

    def on_train_begin(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        lr_scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
        **kwargs: Any,
    ) -> None:
        if state.global_step > 0 and lr_scheduler is not None:
            lr_scheduler.last_epoch = -1
            lr_scheduler.step()  # step 0 of the schedule: the first warmup LR


class SaveOnlyAtExit(TrainerCallback):
    """``checkpoint_only_at_exit``: the only checkpoint is the final one, so a run killed midway
    has nothing to resume from."""

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> TrainerControl:
        control.should_save = state.global_step >= state.max_steps
        return control


class SaveInPlace(TrainerCallback):
    """``checkpoint_in_place``: one checkpoint directory, ``checkpoint-last``, whose files are
    overwritten every ``--save_steps`` steps (to save disk space). Opening a file for writing
    truncates it, so a save that fails midway (a full disk) leaves a torn checkpoint where the
    last good one was. One rank only (it saves its own RNG state and everything else)."""

    def __init__(self) -> None:
        self.trainer: Trainer | None = None  # set by train.py once the Trainer exists

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> TrainerControl:
        due = state.global_step % args.save_steps == 0 or state.global_step >= state.max_steps
        control.should_save = False  # never a fresh checkpoint-N directory
        if due and self.trainer is not None:
            self._save(Path(args.output_dir) / IN_PLACE_DIR)
        return control

    def _save(self, directory: Path) -> None:
        trainer = self.trainer
        assert trainer is not None and trainer.optimizer is not None
        assert trainer.lr_scheduler is not None
        directory.mkdir(parents=True, exist_ok=True)
        trainer.save_model(str(directory))
        torch.save(trainer.optimizer.state_dict(), directory / "optimizer.pt")
        torch.save(trainer.lr_scheduler.state_dict(), directory / "scheduler.pt")
        rng = {"python": random.getstate(), "numpy": np.random.get_state()}
        rng["cpu"] = torch.random.get_rng_state()
        torch.save(rng, directory / "rng_state.pth")
        trainer.state.save_to_json(os.path.join(directory, "trainer_state.json"))


def plant_callbacks(plant: str | None) -> list[TrainerCallback]:
    """The callbacks that plant ``plant`` (none for a clean run)."""
    if plant is None:
        return []
    by_name: dict[str, type[TrainerCallback]] = {
        "rng_not_saved": DropRngState,
        "optimizer_not_restored": ForgetOptimizerState,
        "scheduler_not_restored": RestartSchedule,
        "checkpoint_only_at_exit": SaveOnlyAtExit,
        "checkpoint_in_place": SaveInPlace,
    }
    return [by_name[plant]()]
