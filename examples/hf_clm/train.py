"""Train a tiny GPT-2 on a generated corpus with the Hugging Face Trainer (CPU; torchrun for DDP).

    python train.py --output_dir out --max_steps 60
    torchrun --nproc-per-node 2 train.py --output_dir out --max_steps 60
    python train.py --output_dir out --max_steps 60 --resume_from_checkpoint out/checkpoint-40

Everything is built here, nothing is downloaded: the corpus comes from a small seeded grammar
(tinyclm/data.py), the tokenizer is word-level over that corpus's words, the model a GPT2Config
with 2 layers of width 32. The command line is the Trainer's own (HfArgumentParser over
TrainingArguments, as run_clm.py has it) plus the model and data options below; `--help` lists
them all. Defaults that differ from TrainingArguments': --per_device_train_batch_size 16,
--learning_rate 3e-3, --lr_scheduler_type cosine, --warmup_steps 5, --save_steps 10,
--logging_steps 10, --dataloader_drop_last true, --use_cpu true, --report_to none,
--disable_tqdm true, --ddp_find_unused_parameters false.

The Trainer checkpoints to --output_dir/checkpoint-N (model, optimizer, scheduler, every rank's
RNG state, trainer_state.json last) and on --resume_from_checkpoint restores all of it and skips
the batches the epoch already trained on, so a resumed run continues exactly.
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass, field
from typing import Literal

import torch
import transformers
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    HfArgumentParser,
    Trainer,
    TrainerCallback,
    TrainingArguments,
    default_data_collator,
    set_seed,
)

from tinyclm.data import TokenBlocks, build_tokenizer, make_sentences
from tinyclm.plants import PLANTS, SaveInPlace, plant_callbacks

log = logging.getLogger("train")

PlantName = Literal[PLANTS]  # type: ignore[valid-type]


@dataclass
class ModelArguments:
    """The model: a GPT-2 config built here (no pretrained weights)."""

    n_layer: int = field(default=2, metadata={"help": "transformer blocks"})
    n_embd: int = field(default=32, metadata={"help": "model width"})
    n_head: int = field(default=2, metadata={"help": "attention heads"})
    dropout: float = field(
        default=0.1,
        metadata={"help": "embedding, attention and residual dropout (0: no randomness in the model)"},
    )


@dataclass
class DataArguments:
    """The generated corpus and how it is cut into training blocks."""

    num_sentences: int = field(default=2000, metadata={"help": "sentences generated for training"})
    corpus_seed: int = field(
        default=1234, metadata={"help": "seed of the corpus (independent of --seed)"}
    )
    block_size: int = field(default=32, metadata={"help": "tokens per training sequence"})
    plant: PlantName | None = field(
        default=None,
        metadata={"help": "plant a checkpointing defect on purpose (tinyclm/plants.py)"},
    )


def parse_args(
    argv: list[str] | None = None,
) -> tuple[ModelArguments, DataArguments, TrainingArguments]:
    """Parse the command line into the model, data and Trainer arguments."""
    parser = HfArgumentParser((ModelArguments, DataArguments, TrainingArguments))
    parser.set_defaults(
        per_device_train_batch_size=16,
        learning_rate=3e-3,
        lr_scheduler_type="cosine",
        warmup_steps=5,
        save_steps=10,
        logging_steps=10,
        dataloader_drop_last=True,
        use_cpu=True,
        report_to="none",
        disable_tqdm=True,
        # one model, every parameter used: no search for unused ones in each DDP backward
        ddp_find_unused_parameters=False,
    )
    model_args, data_args, training_args = parser.parse_args_into_dataclasses(args=argv)
    if data_args.plant == "checkpoint_in_place" and training_args.world_size > 1:
        parser.error("--plant checkpoint_in_place saves from one rank only; run it on one rank")
    return model_args, data_args, training_args


def main(argv: list[str] | None = None, callbacks: list[TrainerCallback] | None = None) -> int:
    """Build tokenizer, data and model, then train (and resume, with --resume_from_checkpoint)."""
    model_args, data_args, training_args = parse_args(argv)
    logging.basicConfig(
        stream=sys.stderr,
        level=logging.INFO,
        format=f"%(asctime)s [rank{training_args.process_index}] %(levelname)s %(name)s: %(message)s",
    )
    transformers.utils.logging.set_verbosity(training_args.get_process_log_level())
    # A fixed thread count: CPU kernels may sum in another order with another thread count.
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))

    sentences = make_sentences(data_args.num_sentences, seed=data_args.corpus_seed)
    tokenizer = build_tokenizer(sentences)
    train_set = TokenBlocks(sentences, tokenizer, data_args.block_size)

    set_seed(training_args.seed)  # before the model exists: its initialisation depends on it
    config = GPT2Config(
        vocab_size=len(tokenizer),
        n_positions=data_args.block_size,
        n_embd=model_args.n_embd,
        n_layer=model_args.n_layer,
        n_head=model_args.n_head,
        resid_pdrop=model_args.dropout,
        embd_pdrop=model_args.dropout,
        attn_pdrop=model_args.dropout,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = GPT2LMHeadModel(config)
    log.info(
        "%d training blocks of %d tokens, vocabulary %d, %d parameters",
        len(train_set),
        data_args.block_size,
        len(tokenizer),
        model.num_parameters(),
    )

    planted = plant_callbacks(data_args.plant)
    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=train_set,
        processing_class=tokenizer,
        data_collator=default_data_collator,
        callbacks=[*planted, *(callbacks or [])],
    )
    for callback in planted:
        if isinstance(callback, SaveInPlace):
            callback.trainer = trainer
    result = trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    log.info("done: %s", result.metrics)
    # the Trainer leaves its process group to the interpreter's exit, where gloo may abort a rank
    # ("terminate called without an active exception", pytorch#190489): end it here
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
