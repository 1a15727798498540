"""Drives one fault through its life on real rank processes, as a drill does (fault tests).

setup -> launch_env/preexec -> Launcher with an on_metric callback that injects when the target
rank prints step ``after_step`` -> classify/evidence -> teardown (always). Plus the scans that
prove nothing was left behind (cgroups, mounts, processes).
"""

from __future__ import annotations

import contextlib
import os
import sys
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from trainguard.faults.base import Fault, FaultContext
from trainguard.launch import Launcher, LaunchSpec, RunResult

HERE = Path(__file__).resolve().parent
LOSS = r"step (?P<step>\d+) loss (?P<value>[-+0-9.eE]+)"


@dataclass
class Drive:
    result: RunResult
    classification: str
    evidence: dict[str, Any]
    ctx: FaultContext
    tag: str
    during: dict[str, Any] = field(default_factory=dict)


def drive(
    fault: Fault,
    tmp_path: Path,
    script: str,
    args: Callable[[FaultContext], Sequence[str]],
    *,
    world_size: int = 1,
    timeout: float = 90.0,
    during: Callable[[Fault, FaultContext], dict[str, Any]] | None = None,
    after: Callable[[Fault, FaultContext, RunResult], dict[str, Any]] | None = None,
) -> Drive:
    """``during`` runs after setup, before the launch; ``after`` after the run, before the
    teardown (e.g. to read a checkpoint on a tmpfs the teardown unmounts)."""
    tag = f"tgfault-{uuid.uuid4().hex[:10]}"
    ctx = FaultContext(work_dir=tmp_path / "fault", checkpoint_dir=tmp_path / "ckpt",
                       world_size=world_size)
    seen: dict[str, Any] = {}
    fault.setup(ctx)
    try:
        if during is not None:
            seen.update(during(fault, ctx))
        spec = LaunchSpec(
            argv=[sys.executable, str(HERE / script), *args(ctx), "--tag", tag],
            run_dir=tmp_path / "run",
            world_size=world_size,
            env=fault.launch_env(ctx),
            metric_regexes={"loss": LOSS},
            timeout=timeout,
            stall_timeout=30.0,
            grace_period=2.0,
            preexec=fault.preexec if fault.needs_preexec else None,
        )
        launcher = Launcher(spec)

        def on_metric(point: Any, launcher: Launcher) -> None:
            if (point.rank == fault.rank and point.step >= fault.after_step
                    and fault.injected_at is None):
                fault.inject(launcher)

        launcher.on_metric.append(on_metric)
        result = launcher.run()
        fault.clear()
        classification = fault.classify(result)
        evidence = fault.evidence().to_dict()
        if after is not None:
            seen.update(after(fault, ctx, result))
    finally:
        fault.teardown()
    return Drive(result, classification, evidence, ctx, tag, seen)


def processes_with(tag: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error):
            if tag in " ".join(proc.info["cmdline"] or []) and proc.pid != os.getpid():
                found.append(proc)
    return found


def our_mounts(sources: tuple[str, ...] = ("trainguard-fuse", "trainguard-disk-full")) -> list[str]:
    """FUSE layers and tmpfs mounts of the faults made by this test process (under pytest-xdist,
    the other worker's mounts are under its own ``popen-gwN`` temp dir and not ours to judge)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    return [line for line in Path("/proc/mounts").read_text().splitlines()
            if line.split()[0] in sources and (worker is None or f"/popen-{worker}/" in line.split()[1])]


def our_cgroups() -> list[Path]:
    """trainguard-* cgroups made by this process (v1 memory hierarchy here)."""
    root = Path("/sys/fs/cgroup/memory")
    if not root.is_dir():
        return []
    return [p for p in root.rglob(f"trainguard-{os.getpid()}-*") if p.is_dir()]


def assert_nothing_left(tag: str) -> None:
    procs = processes_with(tag)
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    assert not procs, f"processes outlived the drive: {[p.pid for p in procs]}"
    assert not our_mounts(), f"tmpfs mounts left: {our_mounts()}"
    assert not our_cgroups(), f"cgroups left: {our_cgroups()}"
