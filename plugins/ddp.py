"""``@pytest.mark.ddp(world_size=N)``: run a test function on N ranks with a process group.

The test runs in N fresh pytest processes (one per rank, started by trainguard's launcher with
the torchrun environment), each initializing ``torch.distributed`` before the test and
destroying the group after, so fixtures work inside every rank as usual. The parent test passes
when every rank passed, fails with each failing rank's traceback otherwise, and is skipped when a
rank skipped (e.g. missing GPUs). A hang is bounded by ``--trainguard-ddp-timeout``: the ranks'
stacks are dumped, they are torn down, and the session goes on.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Generator
from pathlib import Path
from typing import Any

import pytest
from trainguard.plugins.markers import validate_marker

from trainguard._internal import envvars

__all__ = ["CHILD_ENV", "child_call", "parent_call", "request_parent_fixtures"]

#: set in a rank's environment: this pytest process is one rank of a ddp test
CHILD_ENV = envvars.DDP_CHILD
_RESULT_NAME = "rank{rank}.result.json"


def _choose_backend(requested: str | None, world_size: int) -> tuple[str, str | None]:
    """(backend, skip reason or None). nccl needs one GPU per rank."""
    from trainguard._internal.machine import gpu_inventory

    if requested in (None, "nccl"):
        inventory = gpu_inventory()
        if inventory.count >= world_size:
            return "nccl", None
        if requested == "nccl":
            return "nccl", (
                f"ddp(backend='nccl', world_size={world_size}) needs {world_size} GPU(s), "
                f"found {inventory.count} ({inventory.how})"
            )
    return requested or "gloo", None


def request_parent_fixtures(item: pytest.Item) -> None:
    """Make a ``ddp`` test also request the fixtures :func:`parent_call` uses
    (``tmp_path_factory``, for the ranks' run directory), so pytest sets them up with the
    test's own (called at collection, from ``pytest_collection_modifyitems``)."""
    if not isinstance(item, pytest.Function) or item.get_closest_marker("ddp") is None:
        return
    if "tmp_path_factory" not in item.fixturenames:
        item.fixturenames.append("tmp_path_factory")


def parent_call(item: pytest.Function) -> None:
    """Launch ``world_size`` rank processes running this one test and judge their outcomes."""
    from trainguard.plugins.session import get_session

    from trainguard.launch import Launcher, LaunchSpec

    marker = item.get_closest_marker("ddp")
    assert marker is not None
    bound = validate_marker("ddp", marker.args, marker.kwargs).arguments
    world_size, requested = bound["world_size"], bound["backend"]
    backend, skip = _choose_backend(requested, world_size)
    if skip:
        pytest.skip(skip)
    settings = get_session(item.config).settings
    factory = item.funcargs["tmp_path_factory"]  # requested by request_parent_fixtures
    assert isinstance(factory, pytest.TempPathFactory)
    run_dir = factory.mktemp("ddp", numbered=True)
    config = item.config
    argv = [
        sys.executable, "-m", "pytest", item.nodeid,
        "-p", "no:cacheprovider", "-o", "addopts=", "-q", "--tb=short", "-rN",
        "--rootdir", str(config.rootpath),
        f"--import-mode={config.option.importmode}",
        "-W", "ignore::pytest.PytestUnknownMarkWarning",
    ]
    if config.inipath is not None:
        argv += ["-c", str(config.inipath)]
    if config.pluginmanager.has_plugin("xdist"):
        argv += ["-p", "no:xdist"]
    argv += ["--trainguard-seed", str(settings.seed)]
    timeout = settings.ddp_timeout * settings.timeout_scale
    spec = LaunchSpec(
        argv=argv,
        run_dir=run_dir,
        world_size=world_size,
        cwd=config.rootpath,
        env={CHILD_ENV: backend, "TRAINGUARD_DDP_TIMEOUT": str(timeout)},
        timeout=timeout,
        stall_timeout=None,
        grace_period=3.0,
        label=item.name,
    )
    result = Launcher(spec).run()
    outcomes = []
    for rank in range(world_size):
        path = run_dir / _RESULT_NAME.format(rank=rank)
        try:
            outcomes.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            outcomes.append({"outcome": "missing", "longrepr": ""})
    if result.outcome == "timeout":
        stacks = "\n".join(
            f"--- rank {r} stack ---\n{text}" for r, text in result.evidence.get("stacks", {}).items()
        )
        pytest.fail(
            f"ddp(world_size={world_size}): the ranks did not finish within {timeout:g} s "
            f"(--trainguard-ddp-timeout); they were torn down.\n{stacks}\nlogs: {run_dir}",
            pytrace=False,
        )
    failed = [
        (rank, o) for rank, o in enumerate(outcomes) if o["outcome"] in ("failed", "missing")
    ]
    if failed or not result.ok:
        parts = [
            f"ddp(world_size={world_size}, backend={backend!r}): "
            + (", ".join(f"rank {r} {o['outcome']}" for r, o in failed) or result.reason)
        ]
        for rank, outcome in failed:
            text = outcome["longrepr"] or _tail(run_dir / f"rank{rank}.stdout.log")
            stderr = _tail(run_dir / f"rank{rank}.stderr.log", 15)
            parts.append(f"--- rank {rank} ---\n{text}" + (f"\n[stderr]\n{stderr}" if stderr else ""))
        if result.reason and result.outcome == "failed":
            parts.append(f"launcher: {result.reason}")
        parts.append(f"logs: {run_dir}")
        pytest.fail("\n".join(parts), pytrace=False)
    skipped = [o for o in outcomes if o["outcome"] == "skipped"]
    if skipped:
        pytest.skip(f"skipped on a rank: {skipped[0]['longrepr']}")


def _tail(path: Path, lines: int = 60) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def child_call(item: pytest.Function) -> Generator[None, Any, Any]:
    """Inside a rank: initialize the process group around the test call."""
    import datetime

    import torch
    import torch.distributed as dist

    backend = os.environ[CHILD_ENV]
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    timeout = float(os.environ.get("TRAINGUARD_DDP_TIMEOUT", "120"))
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout))
    try:
        return (yield)
    finally:
        dist.destroy_process_group()


class ChildRecorder:
    """Registered in rank processes: a process group around ddp tests, and this rank's outcome
    written for the parent to read."""

    @pytest.hookimpl(wrapper=True)
    def pytest_pyfunc_call(self, pyfuncitem: pytest.Function) -> Generator[None, Any, Any]:
        if pyfuncitem.get_closest_marker("ddp") is None:
            return (yield)
        return (yield from child_call(pyfuncitem))

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.when == "call" or report.outcome != "passed":
            rank = os.environ.get("RANK", "0")
            path = Path(os.environ[envvars.RUN_DIR]) / _RESULT_NAME.format(rank=rank)
            previous = json.loads(path.read_text()) if path.exists() else None
            if previous is not None and previous["outcome"] != "passed":
                return  # keep the first failure (a teardown error after a call failure)
            longrepr = ""
            if report.longrepr is not None:
                if isinstance(report.longrepr, tuple):  # skip: (file, line, reason)
                    longrepr = str(report.longrepr[2])
                else:
                    longrepr = str(report.longrepr)
            path.write_text(json.dumps({"outcome": report.outcome, "when": report.when, "longrepr": longrepr}))
