"""Evidence of a hang: each rank's CPU activity and state, and its Python stacks; and what an
early exit or a one-process job's death in distributed set-up usually means.

Collected by the launcher when no metric line arrived for ``stall_timeout`` seconds, before the
ranks are torn down. CPU time is not progress: NCCL busy-polls inside a stuck collective.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TypedDict

import psutil

from trainguard.launch.procs import RankProcess

__all__ = ["EARLY_EXIT_CAUSES", "EarlyExit", "RankActivity", "describe_early_exit", "distributed_env_hint", "dump_stacks", "early_exit", "handles_signal", "rank_activity", "sibling_script"]

#: what usually makes a rank leave the training loop early while its peers go on
EARLY_EXIT_CAUSES = ("uneven data across ranks (a shard with fewer batches: use "
                     "DistributedSampler(drop_last=True), the same number of batches on every rank, "
                     "or DDP's join() context)", "a rank-dependent break, return or sys.exit(0) in the loop")


class EarlyExit(TypedDict):
    """A rank that exited 0 while its peers went on (a run's evidence, ``early_exit``)."""

    rank: int
    last_step: int | None
    #: seconds into the run
    exited_at_s: float
    waiting_ranks: list[int]
    others_last_step: dict[int, int | None]
    likely_causes: list[str]


class RankActivity(TypedDict, total=False):
    """One rank's process over a short window (a hang's evidence, ``ranks``): its state
    (``gone`` when it exited), CPU use and threads."""

    rank: int
    pid: int
    state: str
    cpu_percent: float
    threads: int


def early_exit(exit_codes: dict[int, int | None], exited_at: dict[int, float],
               last_steps: dict[int, int], alive: list[int]) -> EarlyExit | None:
    """The first rank that exited 0 while others (``alive``) still ran, as evidence: its rank,
    last step, when it left, and who was left waiting. None when no rank did.

    A rank that leaves early with exit code 0 is not a failure to the launcher (nothing to tear
    down for), but its peers then wait for it in their next collective: what looks like a hang
    has this cause, and the report names it first."""
    if not alive:
        return None
    furthest = max((last_steps[r] for r in alive if r in last_steps), default=None)

    def left_early(rank: int) -> bool:
        # it left no further than the ranks still running: they can be waiting for it (a rank
        # that finished its steps while a peer fell behind or hung is not the cause)
        step = last_steps.get(rank)
        return step is None or furthest is None or step <= furthest

    early = sorted((t, r) for r, t in exited_at.items() if exit_codes.get(r) == 0 and left_early(r))
    if not early:
        return None
    t, rank = early[0]
    return {"rank": rank, "last_step": last_steps.get(rank), "exited_at_s": round(t, 3),
            "waiting_ranks": sorted(alive), "others_last_step": {r: last_steps.get(r) for r in sorted(alive)},
            "likely_causes": list(EARLY_EXIT_CAUSES)}


def describe_early_exit(found: EarlyExit) -> str:
    """One sentence for a run's reason."""
    step = found["last_step"]
    after = f"after its step {step}" if step is not None else "before its first step"
    waiting = ", ".join(map(str, found["waiting_ranks"]))
    return (f"rank {found['rank']} exited 0 {after} ({found['exited_at_s']:.1f} s into the run) while "
            f"rank(s) {waiting} went on: they wait for it in a collective. Most likely "
            f"{EARLY_EXIT_CAUSES[0]}")


def rank_activity(ranks: list[RankProcess], sample_s: float = 0.5) -> list[RankActivity]:
    """CPU use over a short window and process state per rank: evidence for a hang report.

    A rank burning 100% CPU is not necessarily making progress (NCCL busy-polls); a rank in
    state 'stopped' (SIGSTOP) or 'sleeping' with no CPU is waiting on something.
    """
    procs: dict[int, psutil.Process] = {}
    before: dict[int, float] = {}
    for rp in ranks:
        with contextlib.suppress(psutil.Error):
            proc = psutil.Process(rp.pid)
            times = proc.cpu_times()
            procs[rp.rank] = proc
            before[rp.rank] = times.user + times.system
    time.sleep(sample_s)
    out = []
    for rp in ranks:
        entry: RankActivity = {"rank": rp.rank, "pid": rp.pid}
        proc = procs.get(rp.rank)
        if proc is None:
            entry["state"] = "gone"
        else:
            try:
                times = proc.cpu_times()
                entry["state"] = proc.status()
                entry["cpu_percent"] = round(
                    100 * (times.user + times.system - before[rp.rank]) / sample_s, 1
                )
                entry["threads"] = proc.num_threads()
            except psutil.Error:
                entry["state"] = "gone"
        out.append(entry)
    return out


def dump_stacks(ranks: list[RankProcess], timeout: float = 15.0) -> dict[str, str]:
    """Python stacks of every rank via py-spy (needs root or ptrace rights here).

    ``--nonblocking`` reads a SIGSTOPped process too. Without py-spy the report says so; a
    script that calls ``faulthandler.register(signal.SIGUSR1)`` still prints its stacks to its
    stderr log when it gets SIGUSR1.
    """
    pyspy = shutil.which("py-spy") or sibling_script("py-spy")
    stacks: dict[str, str] = {}
    signalled = False
    dumps: dict[int, Future[str]] = {}
    with ThreadPoolExecutor(max_workers=max(len(ranks), 1), thread_name_prefix="trainguard-py-spy") as pool:
        for rp in ranks:
            if rp.popen.poll() is not None:
                stacks[str(rp.rank)] = f"(exited with {rp.popen.returncode} before the dump)"
            elif pyspy is None:
                stacks[str(rp.rank)] = "(py-spy not installed: `pip install py-spy` for stack dumps)"
                # SIGUSR1's default action terminates: send it only to a rank that handles it
                if handles_signal(rp.pid, signal.SIGUSR1):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(rp.pid, signal.SIGUSR1)
                        signalled = True
                    stacks[str(rp.rank)] += "; SIGUSR1 sent: see its stderr log"
            else:  # every rank at once: a hung job's ranks are dumped in the time of one
                dumps[rp.rank] = pool.submit(_py_spy_dump, pyspy, rp.pid, timeout)
        for rank, dump in dumps.items():
            stacks[str(rank)] = dump.result()
    if signalled:
        time.sleep(0.5)  # the teardown that follows must not cut the faulthandler dumps short
    return {str(rp.rank): stacks[str(rp.rank)] for rp in ranks}  # in rank order


def _py_spy_dump(pyspy: str, pid: int, timeout: float) -> str:
    try:
        done = subprocess.run([pyspy, "dump", "--pid", str(pid), "--nonblocking"], capture_output=True,
                              text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return f"(py-spy dump timed out after {timeout:g} s)"
    return (done.stdout or done.stderr).strip()[-8000:]


def handles_signal(pid: int, sig: int) -> bool:
    """Whether ``pid`` installed a handler for ``sig`` (Linux: SigCgt in /proc/PID/status)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    for line in status.splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    return False


def sibling_script(name: str) -> str | None:
    """The path of console script ``name`` installed next to this interpreter, or None."""
    candidate = Path(sys.executable).parent / name
    return str(candidate) if candidate.exists() else None


#: a one-process job that died here was setting up torch.distributed (or a device per rank)
_DIST_INIT_MARKERS = ("init_process_group", "torch.cuda.set_device", "ProcessGroupNCCL",
                      "NCCL", "c10d", "rendezvous", "MASTER_ADDR", "DistributedDataParallel",
                      "Torch not compiled with CUDA enabled", "Found no NVIDIA driver",
                      "TCPStore")

DISTRIBUTED_ENV_HINT = (
    "a one-process job died while setting up torch.distributed: trainguard sets RANK, "
    "WORLD_SIZE and MASTER_ADDR as torchrun does, so scripts that check for them take their "
    "distributed (often CUDA-only) branch; if the job runs as a plain `python train.py`, set "
    "`job.distributed_env: false` (docs/launcher.md)"
)


def distributed_env_hint(stderr: str) -> str | None:
    """The hint for a one-process run that died in distributed set-up, from its stderr."""
    return DISTRIBUTED_ENV_HINT if any(m in stderr for m in _DIST_INIT_MARKERS) else None
