"""One real local Slurm cluster per test session (tests/slurm/cluster.py), shared by the
pytest-xdist workers: the first worker that needs it starts it, the last one to finish stops it
(by pid) and proves that no daemon of it is left and its directory is gone. Skipped, saying why,
where the tests do not run as root or Debian's ``slurm-wlm``/``munge`` are not installed.

Clients reach it only through ``SLURM_CONF`` (set for the session's tests by ``slurm_env``);
``/etc/slurm`` is never read.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.slurm.cluster import SlurmCluster, missing_requirements, our_daemons, shared_cluster


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    """The started cluster (``.conf``, ``.node``, ``.partition``, ``.run(...)``)."""
    why = missing_requirements()
    if why:
        pytest.skip(why)
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):  # the workers' temp dirs share this parent
        base = base.parent
    with shared_cluster(base) as (cluster, started_here):
        if started_here:
            print(f"\nlocal Slurm cluster: started in {cluster.start_s:.1f} s at {cluster.root}")
        yield cluster
    if not (cluster.root / "ready.json").exists():  # this worker was the last: it stopped it
        left = our_daemons(cluster.root)
        print(f"\nlocal Slurm cluster: stopped; daemons left: {left}")
        assert not left, f"Slurm daemons left behind: {left}"


def _env(cluster: SlurmCluster, monkeypatch: pytest.MonkeyPatch) -> SlurmCluster:
    monkeypatch.setenv("SLURM_CONF", str(cluster.conf))
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    return cluster


@contextlib.contextmanager
def _node_lock(cluster: SlurmCluster, mode: int) -> Iterator[None]:
    with open(cluster.root / "node.lock", "a+") as fh:
        fcntl.flock(fh, mode)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


@pytest.fixture
def slurm_env(slurm_cluster: SlurmCluster, monkeypatch: pytest.MonkeyPatch) -> Iterator[SlurmCluster]:
    """The cluster, with ``SLURM_CONF`` set for this test and this venv's ``bin`` first on PATH
    (a job's ``python``/``torchrun`` are this interpreter's, as on a site with the env active).
    Shares the node with other such tests (xdist), never with a node-down drill."""
    with _node_lock(slurm_cluster, fcntl.LOCK_SH):
        yield _env(slurm_cluster, monkeypatch)


@pytest.fixture
def slurm_node_alone(slurm_cluster: SlurmCluster, monkeypatch: pytest.MonkeyPatch) -> Iterator[SlurmCluster]:
    """As ``slurm_env``, with the node to itself: a drill that marks it DOWN kills every job on
    it, so it waits for the other tests' jobs and they wait for it."""
    with _node_lock(slurm_cluster, fcntl.LOCK_EX):
        yield _env(slurm_cluster, monkeypatch)
