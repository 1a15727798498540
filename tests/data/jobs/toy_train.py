"""A fake training script for trainguard's own tests: pure Python, no torch, fast.

It behaves like a real training job as trainguard sees one: it reads the torchrun environment
(RANK, WORLD_SIZE, ...), prints ``step {n} loss {x:.6f}`` once per step, writes a checkpoint
every ``--ckpt-every`` steps and can resume from the newest one. The loss is a decaying curve
plus noise from an RNG seeded with ``--seed`` and the rank, so two runs with the same seed
print identical lines.

Flags plant one defect each, so a test can show that trainguard catches it:

--nondet                      the noise RNG is unseeded (determinism must fail)
--die-rank R --die-step K     rank R exits 3 at step K with a message on stderr
--hang-rank R --hang-step K   rank R stops at step K (SIGSTOP, or sleeps with --hang-mode sleep)
--no-ckpt                     never writes a checkpoint
--skip-step K                 trains step K but prints no line for it
--spawn-child                 starts a grandchild that sleeps 600 s (teardown must reap it)
--jsonl-dir D                 metrics go to D/metrics-rank{RANK}.jsonl instead of stdout
--faulthandler                SIGUSR1 prints every thread's stack to stderr (faulthandler)
--ckpt-at-exit-only           checkpoints only after the last step (a kill loses all progress)
--ckpt-inplace                writes each checkpoint straight to its final name (a failed write
                              leaves a torn checkpoint that a resume then reads)
--ckpt-keep-one               one checkpoint file per rank, replaced by every save (with
                              --ckpt-size-kb N its size: a rename over it frees its space)
--latest-pointer-first        updates a "latest" symlink (rank{R}-latest) to the new checkpoint
                              before writing it (the pointer names data that is not durable
                              yet); --resume then follows the pointer
--ckpt-verify MODE            what a resume does with a checkpoint it cannot read or whose
                              checksum (written with each save) does not match: none (loads the
                              newest and trusts it: a flipped digit is trained on), fail (exits 1
                              naming it), fallback (the newest step every rank's file of which
                              reads and verifies), scratch (the defect: starts again from step 1)
--print-at-exit               holds its metric lines and prints them all after the last step
                              (a logger flushed at exit): a kill "after step K" lands too late
--linger S                    sleeps S s after the last step before exiting (a slow teardown)
--drift-after-first DIR       every launch after the first (a marker file in DIR says one ran) that
                              does not resume adds 1e-4 to its loss: a defect only a second
                              uninterrupted run shows (determinism's; a shared reference hides it)
--swallow-oom                 catches MemoryError / torch.OutOfMemoryError in the training loop
                              and carries on (an OOM that never ends the job)

--work-ms N                   N ms of CPU work per step (a busy loop: a CPU quota slows it, a sleep not)
--workers N                   N data-loading worker processes (children, like a DataLoader's); step s
                              waits for worker s % N's item; a dead worker is noticed within 0.1 s
                              (an error, as PyTorch's DataLoader raises)
--worker-timeout 0            the defect: waits for a dead worker's item forever (no liveness check)
--exit-early-rank R --exit-early-step K  rank R leaves the loop and exits 0 at step K (a shard with
                              fewer batches): its peers wait for it at the next barrier
--on-notice MODE              what SIGTERM / SIGUSR1 (a scheduler's notice) does: die (Python's
                              default), save (finish the step, agree on it through --sync-dir,
                              checkpoint atomically, exit 0), ignore (SIG_IGN: train on until the
                              SIGKILL), save-slow-inplace (save in place, slower than any grace:
                              the SIGKILL tears it), rank0-saves (the other ranks exit at once,
                              rank 0 waits for them in a barrier before it saves)

--resume-sleep S (with --resume) seconds per step of a resumed run instead of --sleep: a drill needs
the slow pace only until its fault lands (so that trainguard, reading the output a second or two
behind on a loaded machine, still acts mid-run); a resumed run that no fault will hit can go fast

--sync-dir D makes every step end in a barrier of all ranks (files under D, like a collective):
a rank waits for its peers' step; --sync-timeout T makes it raise after T s waiting (a collective
timeout; the process's first barrier, its rendezvous, waits at least 60 s for its peers to start);
T 0 waits forever, which is the defect "hangs when a peer dies, without a timeout".
--on-sync-timeout MODE        how the timed-out rank then exits 1: raise (a RuntimeError's
                              traceback), say (one sentence of its own, in French, none of the
                              words "error", "timeout", ...), silent (writes nothing), progress
                              (writes only a tqdm bar and a warning: nothing that reports)
"""

from __future__ import annotations

import argparse
import faulthandler
import hashlib
import json
import math
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

TORCHRUN_VARS = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_RUN_ID",
    "TRAINGUARD_RUN_DIR",
)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ckpt-dir", default=None)
    p.add_argument("--ckpt-every", type=int, default=5)
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint")
    p.add_argument("--sleep", type=float, default=0.0, help="seconds per step")
    p.add_argument("--resume-sleep", type=float, default=None, help="seconds per step of a resumed run")
    p.add_argument("--tag", default="", help="free text; tests put a unique marker here")
    p.add_argument("--print-env", action="store_true", help="print the torchrun variables as JSON")
    p.add_argument("--nondet", action="store_true")
    p.add_argument("--die-rank", type=int, default=None)
    p.add_argument("--die-step", type=int, default=None)
    p.add_argument("--hang-rank", type=int, default=None)
    p.add_argument("--hang-step", type=int, default=None)
    p.add_argument("--hang-mode", choices=("stop", "sleep"), default="stop")
    p.add_argument("--no-ckpt", action="store_true")
    p.add_argument("--skip-step", type=int, action="append", default=[])
    p.add_argument("--spawn-child", action="store_true")
    p.add_argument("--jsonl-dir", default=None)
    p.add_argument("--faulthandler", action="store_true")
    p.add_argument("--ckpt-at-exit-only", action="store_true")
    p.add_argument("--ckpt-inplace", action="store_true")
    p.add_argument("--ckpt-size-kb", type=int, default=0, help="pad each checkpoint to about this size")
    p.add_argument("--ckpt-keep-one", action="store_true", help="one checkpoint file, replaced by each save")
    p.add_argument("--swallow-oom", action="store_true")
    p.add_argument("--drift-after-first", default=None)
    p.add_argument("--print-at-exit", action="store_true")
    p.add_argument("--linger", type=float, default=0.0)
    p.add_argument("--latest-pointer-first", action="store_true")
    p.add_argument("--ckpt-verify", choices=("none", "fail", "fallback", "scratch"), default="none")
    p.add_argument("--work-ms", type=float, default=0.0)
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--worker-timeout", type=float, default=5.0, help="0: wait for a worker forever")
    p.add_argument("--exit-early-rank", type=int, default=None)
    p.add_argument("--exit-early-step", type=int, default=None)
    p.add_argument("--on-notice", choices=("die", "save", "ignore", "save-slow-inplace", "rank0-saves"),
                   default="die")
    p.add_argument("--sync-dir", default=None)
    p.add_argument("--sync-timeout", type=float, default=0.0, help="0: wait for peers forever")
    p.add_argument("--on-sync-timeout", choices=("raise", "say", "silent", "progress"), default="raise")
    return p.parse_args()


def checkpoint_path(ckpt_dir: Path, rank: int, step: int, keep_one: bool = False) -> Path:
    if keep_one:  # one file, replaced by every save (its old space is freed by the rename)
        return ckpt_dir / f"rank{rank}-step-latest.json"
    return ckpt_dir / f"rank{rank}-step{step:06d}.json"


def _checksum(step: int, rng_state: object) -> str:
    return hashlib.sha256(json.dumps([step, rng_state]).encode()).hexdigest()


def save_checkpoint(ckpt_dir: Path, rank: int, step: int, rng: random.Random, inplace: bool = False,
                    size_kb: int = 0, keep_one: bool = False, checksum: bool = False,
                    pointer_first: bool = False) -> None:
    # temp file + fsync + rename: a run killed mid-write never leaves a torn checkpoint behind
    target = checkpoint_path(ckpt_dir, rank, step, keep_one)
    data: dict[str, object] = {"step": step, "rng": rng.getstate(), "pad": "x" * (size_kb * 1024)}
    if checksum:
        data["sha256"] = _checksum(step, json.loads(json.dumps(data["rng"])))
    text = json.dumps(data)
    if pointer_first:  # the defect: "latest" names the new checkpoint before it is written
        link = ckpt_dir / f"rank{rank}-latest"
        tmp_link = ckpt_dir / f".rank{rank}-latest.tmp"
        tmp_link.unlink(missing_ok=True)
        os.symlink(target.name, tmp_link)
        os.replace(tmp_link, link)
    if inplace:  # the defect: open(target, "w") truncates first, a failed write leaves it torn
        with open(target, "w") as f:
            f.write(text)
        return
    tmp = target.with_name("." + target.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, target)


def _read(path: Path, verify: bool) -> dict:
    data = json.loads(path.read_text())
    if verify and data.get("sha256") != _checksum(data["step"], data["rng"]):
        raise ValueError(f"checksum mismatch in {path}: the checkpoint is corrupt")
    return data


def load_latest(ckpt_dir: Path, rank: int, verify: str = "none", world_size: int = 1) -> tuple[int, random.Random] | None:
    link = ckpt_dir / f"rank{rank}-latest"
    if link.is_symlink():  # --latest-pointer-first: trust the pointer
        found = [ckpt_dir / os.readlink(link)]
    else:
        found = sorted(ckpt_dir.glob(f"rank{rank}-step*.json"))
    if not found:
        return None
    if verify == "none":
        data = json.loads(found[-1].read_text())
    elif verify == "fail":
        try:
            data = _read(found[-1], True)
        except (OSError, ValueError) as exc:
            print(f"toy_train: rank {rank}: cannot resume from {found[-1].name}: {exc}", file=sys.stderr, flush=True)
            raise SystemExit(1) from None
    else:
        data = None
        for path in reversed(found):  # the newest step whose every rank's file reads and verifies
            try:
                every = [_read(path.with_name(path.name.replace(f"rank{rank}-", f"rank{r}-")), True)
                         for r in range(world_size)]
            except (OSError, ValueError) as exc:
                if verify == "scratch":  # the defect: drop everything, start again
                    return None
                print(f"toy_train: rank {rank}: skipping {path.name}: {exc}", file=sys.stderr, flush=True)
                continue
            data = every[rank]
            break
        if data is None:
            return None
    version, internal, gauss = data["rng"]
    rng = random.Random()
    rng.setstate((version, tuple(internal), gauss))
    return int(data["step"]), rng


#: how long the first barrier of a process waits for its peers to start, whatever --sync-timeout
STARTUP_GRACE_S = 60.0
_MET = False


def barrier(sync_dir: Path, rank: int, world_size: int, step: int, timeout: float, flag: bool = False,
            on_timeout: str = "raise") -> bool:
    """Wait until every rank has reached ``step`` (per attempt: TORCHELASTIC_RUN_ID); True when
    any rank came with ``flag`` set (an all-reduce of the flag, like a real job's stop flag)."""
    where = sync_dir / os.environ.get("TORCHELASTIC_RUN_ID", "run")
    where.mkdir(parents=True, exist_ok=True)
    mark = where / f"step{step}.rank{rank}"
    tmp = mark.with_name("." + mark.name)
    tmp.write_text("1" if flag else "")
    os.replace(tmp, mark)
    started = time.monotonic()
    # the process's first barrier is its rendezvous: its peers may still be starting (a loaded
    # machine once took over 2 s to start rank 1), as a real job's init has a timeout of its own
    global _MET
    limit = max(timeout, STARTUP_GRACE_S) if timeout and not _MET else timeout
    _MET = True
    while not all((where / f"step{step}.rank{r}").exists() for r in range(world_size)):
        if limit and time.monotonic() - started > limit:
            if on_timeout != "raise":
                _exit_on_sync_timeout(on_timeout, rank, step, limit)
            raise RuntimeError(
                f"toy_train: rank {rank}: collective timed out after {limit:g} s waiting for "
                f"peers at step {step}"
            )
        time.sleep(0.005)
    return any((where / f"step{step}.rank{r}").read_text() == "1" for r in range(world_size))


def _exit_on_sync_timeout(mode: str, rank: int, step: int, timeout: float) -> None:
    """Exit 1 the way ``--on-sync-timeout`` says (after a metric line, as a job's last words)."""
    if mode == "say":
        print(f"toy_train : rang {rank} : aucun pair n'a répondu en {timeout:g} s à l'étape {step}, "
              "on s'arrête", file=sys.stderr, flush=True)
    elif mode == "progress":
        import warnings

        for done in range(0, 11, 5):
            bar = "#" * done + " " * (10 - done)
            sys.stderr.write(f"\r{done * 10:3d}%|{bar}| {done}/10 [00:0{done // 5}<00:01, 4.97it/s]")
        sys.stderr.write("\n")
        warnings.warn("peers are slow", UserWarning, stacklevel=1)
        sys.stderr.flush()
    raise SystemExit(1)


def _produce(queue: object, index: int) -> None:
    """A data-loading worker: its items, forever (the rank's loop takes one per step)."""
    n = 0
    while True:
        queue.put((index, n))  # type: ignore[attr-defined]
        n += 1


def next_item(queues: list, procs: list, step: int, timeout: float) -> object:
    """The item of step ``step`` from worker ``step % N``; with a timeout, a dead worker is an
    error (as PyTorch's DataLoader reports one), without one the wait never ends."""
    import queue as queue_module

    index = step % len(queues)
    if not timeout:
        return queues[index].get()
    waited = 0.0
    while True:
        try:
            return queues[index].get(timeout=0.1)
        except queue_module.Empty:
            waited += 0.1
            if not procs[index].is_alive():
                raise RuntimeError(f"toy_train: data worker {index} (pid {procs[index].pid}) exited "
                                   f"unexpectedly with exit code {procs[index].exitcode}") from None
            if waited > timeout:
                raise RuntimeError(f"toy_train: data worker {index} gave nothing for {timeout:g} s") from None


NOTICE: list[int] = []


def _on_notice(signum: int, frame: object) -> None:
    NOTICE.append(signum)


def main() -> int:
    args = parse_args()
    if args.faulthandler:
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    print(f"toy_train: rank {rank}/{world_size} starting (tag {args.tag})", flush=True)
    if args.print_env:
        env = {k: os.environ.get(k) for k in TORCHRUN_VARS}
        print("env " + json.dumps({**env, "executable": sys.executable}), flush=True)

    if args.spawn_child:
        # Like a DataLoader worker: it stays in our process group and holds our stdout/stderr
        # pipes open, so only a teardown of the whole group ends it and closes the pipes.
        child = subprocess.Popen(
            [sys.executable, "-c", "import time; time.sleep(600)", f"grandchild-{args.tag}"],
            stdin=subprocess.DEVNULL,
        )
        print(f"toy_train: rank {rank} spawned grandchild {child.pid}", flush=True)

    if args.on_notice == "ignore":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    elif args.on_notice != "die":
        signal.signal(signal.SIGTERM, _on_notice)
        signal.signal(signal.SIGUSR1, _on_notice)

    ckpt_dir = Path(args.ckpt_dir) if args.ckpt_dir else None
    if ckpt_dir is not None:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
    start = 1
    rng = random.Random() if args.nondet else random.Random(args.seed * 1000 + rank)
    drift = 0.0
    if args.drift_after_first and not args.resume:
        try:  # the first launch to create the marker is the first; two starting at once differ too
            os.close(os.open(Path(args.drift_after_first) / f"launched-rank{rank}", os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            drift = 1e-4
    if args.resume and ckpt_dir is not None:
        loaded = load_latest(ckpt_dir, rank, args.ckpt_verify, world_size)
        if loaded is not None:
            last, rng = loaded
            start = last + 1
            print(f"toy_train: rank {rank} resumed after step {last}", flush=True)

    queues: list = []
    procs: list = []
    if args.workers:
        import multiprocessing

        mp = multiprocessing.get_context("fork")
        queues = [mp.Queue(maxsize=2) for _ in range(args.workers)]
        procs = [mp.Process(target=_produce, args=(q, i), daemon=True) for i, q in enumerate(queues)]
        for proc in procs:
            proc.start()

    jsonl = None
    if args.jsonl_dir:
        Path(args.jsonl_dir).mkdir(parents=True, exist_ok=True)
        jsonl = open(Path(args.jsonl_dir) / f"metrics-rank{rank}.jsonl", "a")  # noqa: SIM115

    held: list[str] = []  # --print-at-exit: the metric lines not printed yet
    sleep = args.resume_sleep if args.resume and args.resume_sleep is not None else args.sleep
    for step in range(start, args.steps + 1):
        if sleep:
            _swallowing(args, rank, time.sleep, sleep)
        if rank == args.die_rank and step == args.die_step:
            print(
                f"toy_train: rank {rank}: planted failure at step {step}",
                file=sys.stderr,
                flush=True,
            )
            return 3
        if rank == args.exit_early_rank and step == args.exit_early_step:
            print(f"toy_train: rank {rank} has no more data at step {step}", flush=True)
            return 0
        if rank == args.hang_rank and step == args.hang_step:
            print(f"toy_train: rank {rank}: hanging at step {step}", file=sys.stderr, flush=True)
            if args.hang_mode == "stop":
                os.kill(os.getpid(), signal.SIGSTOP)
            while True:
                time.sleep(3600)
        if queues:
            next_item(queues, procs, step, args.worker_timeout)
        if args.work_ms:
            busy_until = time.process_time() + args.work_ms / 1000
            while time.process_time() < busy_until:
                pass
        loss = 2.0 * math.exp(-0.05 * step) + 0.01 * rng.random() + drift
        stop = bool(NOTICE)
        if args.sync_dir:
            stop = _swallowing(args, rank, barrier, Path(args.sync_dir), rank, world_size, step, args.sync_timeout,
                               stop, args.on_sync_timeout)
        if step not in args.skip_step:
            if jsonl is not None:
                jsonl.write(json.dumps({"step": step, "loss": loss}) + "\n")
                jsonl.flush()
            else:
                held.append(f"step {step} loss {loss:.6f}")
                if not args.print_at_exit:
                    print(held.pop(), flush=True)
        due = step == args.steps if args.ckpt_at_exit_only else step % args.ckpt_every == 0
        if ckpt_dir is not None and not args.no_ckpt and due:
            save_checkpoint(ckpt_dir, rank, step, rng, inplace=args.ckpt_inplace,
                            size_kb=args.ckpt_size_kb, keep_one=args.ckpt_keep_one,
                            checksum=args.ckpt_verify != "none", pointer_first=args.latest_pointer_first)
        if stop and ckpt_dir is not None:
            return _save_on_notice(args, ckpt_dir, rank, world_size, step, rng)
    if held:
        print("\n".join(held), flush=True)
    if args.linger:
        time.sleep(args.linger)
    print(f"toy_train: rank {rank} done", flush=True)
    return 0


def _swallowing(args: argparse.Namespace, rank: int, fn: Any, *call: Any) -> Any:
    """``fn(*call)``; with ``--swallow-oom`` an OOM raised in it (the drill raises it in the main
    thread wherever it is: the sleep or the barrier's poll) is caught and the call made again,
    as a job that skips a batch on OOM and still meets its peers would."""
    while True:
        try:
            return fn(*call)
        except (MemoryError, RuntimeError) as exc:  # torch.OutOfMemoryError is a RuntimeError
            if not args.swallow_oom or not ("OutOfMemory" in type(exc).__name__ or isinstance(exc, MemoryError)):
                raise
            print(f"toy_train: rank {rank}: caught {type(exc).__name__}; carrying on", file=sys.stderr, flush=True)


def _save_on_notice(args: argparse.Namespace, ckpt_dir: Path, rank: int, world_size: int, step: int,
                    rng: random.Random) -> int:
    """The notice came: save this step's state the way ``--on-notice`` says, then exit."""
    if args.on_notice == "rank0-saves":
        if rank != 0:
            print(f"toy_train: rank {rank} exits on the notice without waiting", flush=True)
            return 0
        if args.sync_dir:  # rank 0 waits for peers that have left: a collective with no one
            barrier(Path(args.sync_dir), rank, world_size, -step, 0.0)
    if args.on_notice == "save-slow-inplace":
        target = checkpoint_path(ckpt_dir, rank, step)
        with open(target, "w") as f:  # truncates in place, then a slow write
            f.write('{"step": ')
            f.flush()
            time.sleep(3600)
        return 0
    save_checkpoint(ckpt_dir, rank, step, rng)
    print(f"toy_train: rank {rank} saved step {step} on the notice and exits", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
