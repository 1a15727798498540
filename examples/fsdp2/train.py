"""Train a small causal transformer on synthetic token sequences the way large runs are built:
parameters sharded with FSDP2 (``fully_shard``), sharded ``torch.distributed.checkpoint`` (DCP)
checkpoints (``--async-save``: ``dcp.async_save``) committed by a completion marker, a
``StatefulDataLoader`` (torchdata) with worker processes whose position is in the checkpoint,
gradient accumulation, bf16 autocast (``--precision fp16``: fp16 with a ``GradScaler``, whose
state is saved), an EMA of the weights and a warmup + cosine schedule.

    torchrun --nproc-per-node 2 train.py --steps 40 --ckpt-dir ckpt
    torchrun --nproc-per-node 2 train.py --steps 40 --ckpt-dir ckpt --resume
    torchrun --nproc-per-node 3 train.py --steps 40 --ckpt-dir ckpt --resume   # DCP reshards

After every optimizer step rank 0 prints ``step N loss L lr R ema_norm E``: L is the mean token
loss of the whole global batch (every rank's micro-batches), E the norm of the EMA weights. The
global batch (--global-batch sequences, split over the ranks, each rank's share over --accum
micro-batches) and its order are the same at every world size and accumulation, so runs on 1, 2
and 3 ranks train on the same batches (with --dropout 0 they match: dropout masks are drawn per
rank). The data are made here, from a fixed seed: no download.

Checkpoints: ``{ckpt-dir}/step_NNNNNN/``, a DCP directory holding the sharded model, optimizer
and EMA, the scheduler, the scaler, the progress, and per rank its RNG state and its loader's
state; ``COMPLETE`` in it (written once every rank's shards and DCP's metadata are on disk)
makes it a checkpoint. --resume loads the newest complete one; at another world size DCP
reshards the tensors, and the data position is rebuilt from the step (the per-rank RNG and
loader states belong to the old ranks and are not restored).

A scheduler's notice (SIGTERM, SIGUSR1) makes every rank finish its step, agree, checkpoint it
(waiting for an async save) and exit 0.
"""

from __future__ import annotations

import argparse
import io
import logging
import math
import os
import shutil
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard
from torch.optim.lr_scheduler import LambdaLR
from torch.utils.data import Dataset, Sampler
from torchdata.stateful_dataloader import StatefulDataLoader

log = logging.getLogger("train")

MARKER = "COMPLETE"
DATA_SEED = 1234  # the data set is the same whatever --seed: --seed draws the init and the order


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=200, help="total optimizer steps (spans epochs)")
    p.add_argument("--global-batch", type=int, default=48, help="sequences per optimizer step, all ranks")
    p.add_argument("--accum", type=int, default=2, help="micro-batches per rank per optimizer step")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup-steps", type=int, default=5)
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--ema-decay", type=float, default=0.99, help="the EMA's decay once warmed up")
    p.add_argument("--precision", choices=("bf16", "fp16", "fp32"), default="bf16")
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--dataset-size", type=int, default=1000, help="sequences (the tail short of a global batch is dropped)")
    p.add_argument("--num-workers", type=int, default=2, help="loader worker processes per rank")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ckpt-dir", default=None)
    p.add_argument("--ckpt-every", type=int, default=5)
    p.add_argument("--ckpt-every-micro", type=int, default=0,
                   help="also checkpoint every N micro-batches, mid-step included (0: off)")
    p.add_argument("--keep-last", type=int, default=2)
    p.add_argument("--async-save", action="store_true", help="save with dcp.async_save")
    p.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint")
    p.add_argument("--log-level", default="INFO")
    args = p.parse_args(argv)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if args.global_batch % (world_size * args.accum):
        p.error(f"--global-batch {args.global_batch} must split evenly over WORLD_SIZE={world_size} ranks "
                f"x --accum {args.accum} micro-batches")
    if args.dataset_size < args.global_batch:
        p.error("--dataset-size must hold at least one global batch")
    if args.resume and not args.ckpt_dir:
        p.error("--resume needs --ckpt-dir")
    return args


# ---------------------------------------------------------------------------------------------
# data


class Sequences(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Token sequences from a fixed random Markov chain: (input, next tokens)."""

    def __init__(self, size: int, seq_len: int, vocab: int) -> None:
        g = torch.Generator().manual_seed(DATA_SEED)
        logits = torch.randn(vocab, vocab, generator=g) * 3
        probs = torch.softmax(logits, dim=1)
        tokens = torch.empty(size, seq_len + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(vocab, (size,), generator=g)
        for t in range(seq_len):
            tokens[:, t + 1] = torch.multinomial(probs[tokens[:, t]], 1, generator=g).squeeze(1)
        self.tokens = tokens

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        row = self.tokens[index]
        return row[:-1], row[1:]


class RankShare(Sampler[int]):
    """This rank's share of every global batch of an epoch, in order.

    The epoch's order is a permutation drawn from (seed, epoch); global batch ``s`` is its
    ``s``-th slice of ``global_batch`` indices (the tail short of one is dropped), and rank ``r``
    of ``w`` takes the ``r``-th of ``w`` equal parts of it. Whatever the world size, step ``s``
    trains on the same sequences."""

    def __init__(self, size: int, global_batch: int, rank: int, world_size: int, seed: int) -> None:
        self.size, self.global_batch, self.rank, self.world_size, self.seed = size, global_batch, rank, world_size, seed
        self.epoch = 0
        self.start_step = 0  # global batches of the epoch to skip (a resume at another world size)

    @property
    def steps_per_epoch(self) -> int:
        return self.size // self.global_batch

    def set_epoch(self, epoch: int, start_step: int = 0) -> None:
        self.epoch, self.start_step = epoch, start_step

    def __iter__(self) -> Iterator[int]:
        g = torch.Generator().manual_seed(self.seed * 100_003 + self.epoch)
        order = torch.randperm(self.size, generator=g).tolist()
        share = self.global_batch // self.world_size
        for step in range(self.start_step, self.steps_per_epoch):
            first = step * self.global_batch + self.rank * share
            yield from order[first:first + share]

    def __len__(self) -> int:
        return (self.steps_per_epoch - self.start_step) * (self.global_batch // self.world_size)


# ---------------------------------------------------------------------------------------------
# model


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        # no bias on q, k, v: a key bias gets no gradient (softmax ignores it), and Adam would
        # turn the rounding noise it does get into updates that differ between world sizes
        self.qkv, self.proj = nn.Linear(dim, 3 * dim, bias=False), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + F.dropout(self.proj(att), self.dropout, self.training)
        return x + F.dropout(self.mlp(self.ln2(x)), self.dropout, self.training)


class TinyLM(nn.Module):
    def __init__(self, vocab: int, seq_len: int, dim: int, layers: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(seq_len, dim))
        self.blocks = nn.ModuleList(Block(dim, heads, dropout) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def warmup_cosine(warmup: int, total: int, min_ratio: float) -> Any:
    def factor(step: int) -> float:  # step 0 is the first optimizer step
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return factor


# ---------------------------------------------------------------------------------------------
# checkpoints


def _blob(obj: Any) -> io.BytesIO:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return buffer


def _unblob(buffer: io.BytesIO) -> Any:
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def complete_checkpoints(ckpt_dir: Path) -> list[Path]:
    """The complete checkpoints in ``ckpt_dir``, oldest first."""
    if not ckpt_dir.is_dir():
        return []
    return sorted(p for p in ckpt_dir.glob("step_*") if (p / MARKER).is_file())


class Checkpointer:
    """Saves the training state as DCP directories, sync or async, each committed by a marker
    that rank 0 writes once the save is complete on every rank."""

    def __init__(self, args: argparse.Namespace, rank: int) -> None:
        self.dir = Path(args.ckpt_dir) if args.ckpt_dir else None
        self.keep_last, self.rank, self.use_async = args.keep_last, rank, args.async_save
        # an async save finishes in a background thread with collectives of its own group
        self.group = dist.new_group(backend="gloo") if self.use_async else None
        self.pending: tuple[Any, Path] | None = None

    def save(self, state: dict[str, Any], step: int) -> None:
        assert self.dir is not None
        self.wait()
        path = self.dir / f"step_{step:06d}"
        if self.rank == 0 and path.exists():  # a save of this step that a kill cut short
            shutil.rmtree(path)
        dist.barrier()
        if self.use_async:
            self.pending = (dcp.async_save(state, checkpoint_id=str(path), process_group=self.group), path)
        else:
            dcp.save(state, checkpoint_id=str(path))
            self._commit(path)

    def wait(self) -> None:
        """Finish the async save in flight, if any (its marker included)."""
        if self.pending is not None:
            future, path = self.pending
            self.pending = None
            future.result()
            self._commit(path)

    def _commit(self, path: Path) -> None:
        dist.barrier()  # every rank's shards are written
        if self.rank == 0:
            tmp = path / f".{MARKER}.tmp"
            with open(tmp, "w") as handle:
                handle.write("ok\n")
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, path / MARKER)
            dirfd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(dirfd)
            finally:
                os.close(dirfd)
            assert self.dir is not None
            for old in complete_checkpoints(self.dir)[: -self.keep_last]:
                shutil.rmtree(old, ignore_errors=True)
        dist.barrier()


# ---------------------------------------------------------------------------------------------
# training


class Notice:
    """SIGTERM / SIGUSR1 set a flag; the loop checkpoints between steps and exits 0."""

    def __init__(self) -> None:
        self.signal: int | None = None
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, self._on)

    def _on(self, signum: int, frame: object) -> None:
        self.signal = self.signal or signum

    def agreed(self) -> bool:
        flag = torch.tensor([1 if self.signal is not None else 0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


def setup() -> tuple[int, int]:
    if "RANK" not in os.environ:  # python train.py: a group of one
        os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "0"})
        store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    else:
        dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size()


def autocast(precision: str) -> Any:
    if precision == "fp32":
        return torch.autocast("cpu", enabled=False)
    return torch.autocast("cpu", dtype=torch.bfloat16 if precision == "bf16" else torch.float16)


def train(args: argparse.Namespace, rank: int, world_size: int) -> None:
    torch.manual_seed(args.seed)
    torch.use_deterministic_algorithms(True)
    model = TinyLM(args.vocab, args.seq_len, args.dim, args.layers, args.heads, args.dropout)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    names = [name for name, _ in model.named_parameters()]
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.01)
    scheduler = LambdaLR(optimizer, warmup_cosine(args.warmup_steps, args.steps, args.min_lr_ratio))
    scaler = torch.amp.GradScaler("cpu") if args.precision == "fp16" else None
    ema = [p.detach().clone() for p in params]
    # every rank draws its own dropout masks
    torch.manual_seed(args.seed * 1000 + rank + 1)

    data = Sequences(args.dataset_size, args.seq_len, args.vocab)
    sampler = RankShare(len(data), args.global_batch, rank, world_size, args.seed)
    micro = args.global_batch // world_size // args.accum
    # its own generator: the workers' seeds drawn at each pass leave the dropout RNG alone
    loader = StatefulDataLoader(data, batch_size=micro, sampler=sampler, num_workers=args.num_workers,
                                generator=torch.Generator().manual_seed(args.seed))
    checkpointer = Checkpointer(args, rank)
    tokens_per_rank = args.global_batch // world_size * args.seq_len

    def state(progress: dict[str, int], with_rank_state: bool, at: tuple[Any, Any] | None = None) -> dict[str, Any]:
        """``at``: the (loader state, RNG state) of the step's start, for a save inside a step."""
        model_sd, optim_sd = get_state_dict(model, optimizer)
        out: dict[str, Any] = {
            "model": model_sd, "optim": optim_sd, "ema": dict(zip(names, ema, strict=True)),
            "scheduler": scheduler.state_dict(), "progress": progress,
        }
        if scaler is not None:
            out["scaler"] = scaler.state_dict()
        if with_rank_state:
            loader_state, rng_state = at if at is not None else (loader.state_dict(), torch.get_rng_state())
            out["rng"] = {f"rank{rank}": rng_state}
            out["loader"] = {f"rank{rank}": _blob(loader_state)}
        return out

    step, ema_updates, loader_restored = 0, 0, False
    found = complete_checkpoints(Path(args.ckpt_dir)) if args.resume else []
    if args.resume and not found and rank == 0:
        log.warning("--resume: no complete checkpoint in %s; starting from scratch", args.ckpt_dir)
    if found:
        path = found[-1]
        progress = {"step": 0, "world_size": 0, "ema_updates": 0}
        dcp.load({"progress": progress}, checkpoint_id=str(path))
        same = progress["world_size"] == world_size
        # placeholders for the rank's loader and RNG state: a StatefulDataLoader's state_dict()
        # before its first iteration starts an iterator at the sampler's epoch of that moment,
        # which the next iter() reuses (a resume at an epoch's end drew epoch 0's order again)
        target = state(dict(progress), with_rank_state=same, at=({}, torch.get_rng_state()))
        dcp.load(target, checkpoint_id=str(path))
        set_state_dict(model, optimizer, model_state_dict=target["model"], optim_state_dict=target["optim"])
        scheduler.load_state_dict(target["scheduler"])
        if scaler is not None:
            scaler.load_state_dict(target["scaler"])
        step, ema_updates = int(target["progress"]["step"]), int(target["progress"]["ema_updates"])
        if same:
            torch.set_rng_state(target["rng"][f"rank{rank}"])
            # at an epoch's end the next epoch starts afresh, as it would have
            if step % sampler.steps_per_epoch:
                loader.load_state_dict(_unblob(target["loader"][f"rank{rank}"]))
                loader_restored = True
        elif rank == 0:
            log.warning("%s was written by %d ranks, now %d: the ranks' RNG and loader states are not "
                        "restored (the data position is rebuilt from the step)",
                        path, progress["world_size"], world_size)
        if rank == 0:
            log.info("resuming from %s (step %d)", path, step)

    epoch, in_epoch = divmod(step, sampler.steps_per_epoch)
    # a restored loader skips what its epoch already gave by itself
    sampler.set_epoch(epoch, 0 if loader_restored else in_epoch)
    notice = Notice()
    batches = iter(loader)
    micro_batches = step * args.accum
    model.train()
    while step < args.steps:
        total = torch.zeros(1)
        # a checkpoint inside the step holds the weights from before it: its data position and
        # RNG state are the step's start, so a resume trains the whole step again (its
        # micro-batches and their dropout masks included)
        step_start = (loader.state_dict(), torch.get_rng_state()) if args.ckpt_every_micro else None
        for i in range(args.accum):
            try:
                inputs, targets = next(batches)
            except StopIteration:
                epoch += 1
                sampler.set_epoch(epoch)
                batches = iter(loader)
                inputs, targets = next(batches)
            model.set_requires_gradient_sync(i == args.accum - 1)
            with autocast(args.precision):
                logits = model(inputs)
            loss_sum = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="sum")
            loss = loss_sum / tokens_per_rank
            (scaler.scale(loss) if scaler is not None else loss).backward()
            total += loss_sum.detach()
            micro_batches += 1
            if args.ckpt_dir and args.ckpt_every_micro and micro_batches % args.ckpt_every_micro == 0:
                progress = {"step": step, "world_size": world_size, "ema_updates": ema_updates}
                checkpointer.save(state(progress, with_rank_state=True, at=step_start), step)
        if scaler is not None:
            scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        lr = scheduler.get_last_lr()[0]
        scheduler.step()
        # the EMA warms up: early updates weigh the weights more (decay (1 + n) / (10 + n))
        decay = min(args.ema_decay, (1 + ema_updates) / (10 + ema_updates))
        ema_updates += 1
        with torch.no_grad():
            for e, p in zip(ema, params, strict=True):
                e.lerp_(p.detach(), 1 - decay)
        step += 1
        dist.all_reduce(total)
        norm = torch.stack([e.to_local().float().pow(2).sum() for e in ema]).sum()
        dist.all_reduce(norm)
        stop = notice.agreed()
        if args.ckpt_dir and (step % args.ckpt_every == 0 or step == args.steps or stop):
            progress = {"step": step, "world_size": world_size, "ema_updates": ema_updates}
            checkpointer.save(state(progress, with_rank_state=True), step)
        if rank == 0:
            print(f"step {step} loss {total.item() / (args.global_batch * args.seq_len):.6f} lr {lr:.6g} "
                  f"ema_norm {norm.sqrt().item():.6f}", flush=True)
        if stop:
            checkpointer.wait()
            log.warning("notice (signal %s): checkpointed step %d, exiting", notice.signal, step)
            return
    checkpointer.wait()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(stream=sys.stderr, level=args.log_level.upper(),
                        format=f"%(asctime)s [rank{rank}] %(levelname)s %(name)s: %(message)s")
    rank, world_size = setup()
    try:
        train(args, rank, world_size)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
