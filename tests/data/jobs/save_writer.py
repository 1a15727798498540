"""A tiny job whose only point is how it writes its checkpoint (tests of checks.crash_points).

Pure Python (it starts in a few hundredths of a second): the state is a number updated each
step; the loss printed is the state. Every ``--every`` steps it saves ``{"step", "w", "pad"}`` as
JSON (``pad`` spreads it over 3 writes of 4 KiB) to ``ckpt.json`` with ``--writer``:

* ``atomic``: a temp file, written, fsynced, renamed over ``ckpt.json``, the directory fsynced;
* ``rename``: a temp file, written and renamed, no fsync (safe from a process crash, not from a
  power loss);
* ``inplace``: ``ckpt.json`` truncated and written in place;
* ``unlink-first``: the old ``ckpt.json`` deleted, then the new one written atomically;
* ``timestamped``: as ``atomic``, its temporary file named by the time (a name no two runs share);
* ``pid``: as ``atomic``, its temporary file named by the writer's pid.

Launched with ``WORLD_SIZE`` 2 (each rank a process, no collectives), the sharded writers have
each rank keep its own state and print its own loss, and save ``ckpt-NNNN.rankR.json`` atomically,
the ranks in turn (rank 1 waits for rank 0's file, so a crash between them is one moment; the ranks
first meet through files in the run directory, so a rank that started late does not split the save):

* ``sharded-marker``: rank 0 then writes ``ckpt-NNNN.COMPLETE`` atomically once every rank's shard
  is in place; ``--resume`` loads the newest save that has its marker;
* ``sharded-newest``: no marker; ``--resume`` has each rank load its own newest shard (a crash
  between the ranks' renames resumes them from different steps).

Two writers keep a tracker file beside the state, as Megatron-LM and many hand-written loops do:

* ``megatron``: the state in ``iter_NNNNNNN/model.json`` (a folder per save), then the step in
  ``latest_checkpointed_iteration.txt``, written in place; ``--resume`` reads the tracker and,
  when it holds no number, prints ``ERROR: Invalid metadata file ... Exiting`` and exits 0, as
  Megatron's ``read_metadata`` does (no tracker: a fresh start);
* ``tracker-first``: the step in ``step.txt`` (atomically), then the state in ``weights.json``,
  in place; ``--resume`` with no step left exits 0 without loading the state.

Two writers save into a folder per save, ``step_NNNN/``, as DCP does: two part files (each
written and fsynced), then, for one of them, a marker:

* ``folder-marker``: ``COMPLETE`` written last; ``--resume`` deletes every folder without it (a
  save a crash cut short: ``shutil.rmtree``, which lists it) and loads the newest with it;
* ``folder-newest``: no marker; ``--resume`` loads the newest folder, whatever it holds (a part
  missing or torn: the job dies).

``--log`` appends a line to ``train.log`` in the checkpoint directory at every step (as the
output directories of Hugging Face and Lightning hold logs); ``--background PIDFILE`` starts a
process that leaves the job's process tree (a double fork) and appends to ``bg.log`` there every
0.2 s for at most 30 s, its pid written to ``PIDFILE``.

``--resume`` loads ``ckpt.json`` if there is one (a torn one fails to parse: the job dies).
``--inexact-resume`` plants a resume that never matches the uninterrupted run (the state it
loads is nudged by 1e-6), however the checkpoint was written.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

CHUNK = 4096


def write_all(path: str, data: bytes, *, sync: bool) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for i in range(0, len(data), CHUNK):
            os.write(fd, data[i:i + CHUNK])
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)


def sync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_with_tracker(ckpt_dir: str, step: int, w: float, writer: str) -> None:
    if writer == "megatron":
        folder = os.path.join(ckpt_dir, f"iter_{step:07d}")
        os.makedirs(folder, exist_ok=True)
        write_all(os.path.join(folder, "model.json"), json.dumps({"step": step, "w": w}).encode(), sync=False)
        with open(os.path.join(ckpt_dir, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(step))
        return
    tracker = os.path.join(ckpt_dir, "step.txt")
    write_all(tracker + ".tmp", str(step).encode(), sync=True)
    os.replace(tracker + ".tmp", tracker)
    write_all(os.path.join(ckpt_dir, "weights.json"), json.dumps({"w": w}).encode(), sync=False)


def load_with_tracker(ckpt_dir: str, writer: str, steps: int) -> dict | None:
    tracker = os.path.join(ckpt_dir, "latest_checkpointed_iteration.txt" if writer == "megatron" else "step.txt")
    if not os.path.exists(tracker):
        return None
    with open(tracker) as f:
        text = f.read().strip()
    if writer == "megatron":
        try:
            step = int(text)
        except ValueError:
            print(f"ERROR: Invalid metadata file {tracker}. Exiting", flush=True)
            sys.exit()
        with open(os.path.join(ckpt_dir, f"iter_{step:07d}", "model.json")) as f:
            return json.load(f)
    step = int(text)
    if step >= steps:
        print(f"training already finished at step {step}", flush=True)
        sys.exit()
    with open(os.path.join(ckpt_dir, "weights.json")) as f:
        return {"step": step, **json.load(f)}


def background(ckpt_dir: str, pidfile: str) -> None:
    """A process out of the job's tree: it outlives every rank unless someone ends it."""
    if os.fork():
        return
    os.setsid()
    if os.fork():
        os._exit(0)
    with open(pidfile, "a") as f:
        f.write(f"{os.getpid()}\n")
    for _ in range(150):
        try:
            with open(os.path.join(ckpt_dir, "bg.log"), "a") as f:
                f.write("still here\n")
        except OSError:
            pass
        time.sleep(0.2)
    os._exit(0)


def save(ckpt_dir: str, step: int, w: float, writer: str) -> None:
    final = os.path.join(ckpt_dir, "ckpt.json")
    state = {"step": step, "w": w}
    data = json.dumps({**state, "pad": "x" * (3 * CHUNK - len(json.dumps(state)) - 12)}).encode()
    if writer == "inplace":
        write_all(final, data, sync=False)
        return
    if writer == "unlink-first" and os.path.exists(final):
        os.unlink(final)
    tmp = final + {"timestamped": f".{time.time_ns()}.tmp", "pid": f".{os.getpid()}.tmp"}.get(writer, ".tmp")
    careful = writer in ("atomic", "unlink-first", "timestamped", "pid")
    write_all(tmp, data, sync=careful)
    os.replace(tmp, final)
    if careful:
        sync_dir(ckpt_dir)


def _wait_for(path: str) -> None:
    deadline = time.monotonic() + 30
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            sys.exit(f"save_writer: {path} never appeared")
        time.sleep(0.002)


def _meet(step: int, rank: int, world: int) -> None:
    """The ranks of one launch meet before each save, through files in its run directory (not the
    checkpoint directory: no part of the save), so a rank that started late does not begin its
    part of the save more than ``gap_s`` after the other ended its own on a loaded machine (the
    save would be explored as two). Not for long: a rank resumed from another step than the
    others (a torn restart) saves alone."""
    folder = os.environ.get("TRAINGUARD_RUN_DIR")
    if not folder or world < 2:
        return
    open(os.path.join(folder, f"save-{step}.rank{rank}"), "w").close()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not all(
            os.path.exists(os.path.join(folder, f"save-{step}.rank{r}")) for r in range(world)):
        time.sleep(0.002)


def save_shard(ckpt_dir: str, step: int, w: float, writer: str, rank: int, world: int) -> None:
    _meet(step, rank, world)
    name = os.path.join(ckpt_dir, f"ckpt-{step:04d}")
    if rank > 0:
        _wait_for(f"{name}.rank{rank - 1}.json")
    shard = f"{name}.rank{rank}.json"
    write_all(shard + ".tmp", json.dumps({"step": step, "w": w}).encode(), sync=True)
    os.replace(shard + ".tmp", shard)
    sync_dir(ckpt_dir)
    if writer == "sharded-marker" and rank == 0:
        for other in range(1, world):
            _wait_for(f"{name}.rank{other}.json")
        write_all(name + ".COMPLETE.tmp", b"ok\n", sync=True)
        os.replace(name + ".COMPLETE.tmp", name + ".COMPLETE")
        sync_dir(ckpt_dir)


def load_shard(ckpt_dir: str, writer: str, rank: int) -> dict | None:
    names = sorted(os.listdir(ckpt_dir))
    if writer == "sharded-marker":
        saves = [n[: -len(".COMPLETE")] for n in names if n.endswith(".COMPLETE")]
        chosen = f"{saves[-1]}.rank{rank}.json" if saves else None
    else:
        mine = [n for n in names if n.endswith(f".rank{rank}.json")]
        chosen = mine[-1] if mine else None
    if chosen is None:
        return None
    with open(os.path.join(ckpt_dir, chosen)) as f:
        return json.load(f)


def save_folder(ckpt_dir: str, step: int, w: float, writer: str) -> None:
    folder = os.path.join(ckpt_dir, f"step_{step:04d}")
    os.mkdir(folder)
    for part, value in enumerate((step, w)):
        write_all(os.path.join(folder, f"part{part}.json"), json.dumps({"value": value, "pad": "x" * 5000}).encode(),
                  sync=True)
    if writer == "folder-marker":
        write_all(os.path.join(folder, "COMPLETE"), b"ok\n", sync=True)
    sync_dir(ckpt_dir)


def load_folder(ckpt_dir: str, writer: str) -> dict | None:
    folders = sorted(n for n in os.listdir(ckpt_dir) if n.startswith("step_"))
    if writer == "folder-marker":
        for name in folders:
            if not os.path.exists(os.path.join(ckpt_dir, name, "COMPLETE")):
                shutil.rmtree(os.path.join(ckpt_dir, name))
        folders = [n for n in folders if os.path.exists(os.path.join(ckpt_dir, n))]
    if not folders:
        return None
    values = []
    for part in range(2):
        with open(os.path.join(ckpt_dir, folders[-1], f"part{part}.json")) as f:  # missing or torn: raises
            values.append(json.load(f)["value"])
    return {"step": values[0], "w": values[1]}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ckpt-dir", required=True)
    p.add_argument("--every", type=int, default=5)
    p.add_argument("--writer", default="atomic",
                   choices=("atomic", "rename", "inplace", "unlink-first", "timestamped", "pid", "sharded-marker",
                            "sharded-newest", "megatron", "tracker-first", "folder-marker", "folder-newest"))
    p.add_argument("--sleep", type=float, default=0.02)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--inexact-resume", action="store_true")
    p.add_argument("--log", action="store_true")
    p.add_argument("--background", default=None)
    args = p.parse_args()
    os.makedirs(args.ckpt_dir, exist_ok=True)
    if args.background:
        background(args.ckpt_dir, args.background)
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    sharded = args.writer.startswith("sharded")
    tracked = args.writer in ("megatron", "tracker-first")
    foldered = args.writer.startswith("folder")
    done, w = 0, 1.0 + args.seed + rank
    path = os.path.join(args.ckpt_dir, "ckpt.json")
    state = None
    if args.resume and sharded:
        state = load_shard(args.ckpt_dir, args.writer, rank)
    elif args.resume and tracked:
        state = load_with_tracker(args.ckpt_dir, args.writer, args.steps)
    elif args.resume and foldered:
        state = load_folder(args.ckpt_dir, args.writer)
    elif args.resume and os.path.exists(path):
        with open(path) as f:
            state = json.load(f)  # a torn checkpoint raises here
    if state is not None:
        done, w = int(state["step"]), float(state["w"]) + (1e-6 if args.inexact_resume else 0.0)
    for step in range(done + 1, args.steps + 1):
        w = w * 0.9 + 0.01 * step
        time.sleep(args.sleep)
        if step % args.every == 0 and sharded:
            save_shard(args.ckpt_dir, step, w, args.writer, rank, world)
        elif step % args.every == 0 and tracked:
            save_with_tracker(args.ckpt_dir, step, w, args.writer)
        elif step % args.every == 0 and foldered:
            save_folder(args.ckpt_dir, step, w, args.writer)
        elif step % args.every == 0:
            save(args.ckpt_dir, step, w, args.writer)
        if args.log:
            with open(os.path.join(args.ckpt_dir, "train.log"), "a") as f:
                f.write(f"step {step} loss {w:.10f}\n")
        print(f"step {step} loss {w:.10f}", flush=True)
    sys.exit(0)


if __name__ == "__main__":
    main()
