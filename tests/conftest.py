"""Suite-wide fixtures."""

from __future__ import annotations

import http.server
import os
import shutil
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest


@pytest.fixture(autouse=True)
def _environment_restored() -> Iterator[None]:
    """Each test's process environment is put back after it: library code sets variables for
    the processes it spawns (``track.init`` exports ``MLFLOW_TRACKING_URI``), and a variable left
    behind reaches every later test of the worker (it sent test_network_fault's job to MLflow).
    Session fixtures set theirs before this snapshot, so theirs stay."""
    saved = dict(os.environ)
    yield
    if os.environ != saved:
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture(autouse=True)
def _read_limits_restored() -> Iterator[None]:
    """Each test's read limits are put back after it: a runner makes its settings' limits the
    process's (``use_limits``), and a test's runner with ``read_max_mb`` of 2 KB left them to
    every later test of the worker (test_false_pass before test_baseline failed 7 tests)."""
    from trainguard._internal.readers import active_limits, use_limits

    saved = active_limits()
    yield
    use_limits(saved)


@pytest.fixture(autouse=True)
def _tracking_off_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """MLflow tracking is tested by tests/unit/test_tracking.py (which turns it on); elsewhere it
    would only add its import and flush time to every check."""
    monkeypatch.setenv("TRAINGUARD_TRACKING", "off")


class _Hello(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = b"hello"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def http_service() -> Iterator[str]:
    """A tiny real HTTP service on loopback (``host:port``) answering ``hello``: the upstream a
    job calls, for the network fault's tests."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Hello)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


#: modules of over a minute that collection order would start last (tests/unit comes late): under
#: `-n 2` a whole module runs on one worker (pyproject.toml's --dist loadscope), so a long one at
#: the end leaves the other worker idle; these start first
_LONG_MODULES_FIRST = ("tests/unit/test_tracking.py",)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    first = {path: i for i, path in enumerate(_LONG_MODULES_FIRST)}
    items.sort(key=lambda item: first.get(item.nodeid.split("::")[0], len(first)))  # stable: the rest keep their order


@pytest.fixture
def layer(tmp_path: Any) -> Iterator[Any]:
    """A FUSE layer with the ``rules`` policy mounted over ``tmp_path/backing`` at
    ``tmp_path/mnt`` (skipped, saying why, where FUSE is unavailable); unmounted after."""
    from trainguard.faults.fusefs import FuseLayer, fuse_unavailable

    why = fuse_unavailable()
    if why is not None:
        pytest.skip(f"no FUSE layer on this machine: {why}")
    mounted = FuseLayer(tmp_path / "backing", tmp_path / "mnt", policy="rules", state_dir=tmp_path)
    mounted.mount()
    try:
        yield mounted
    finally:
        assert mounted.unmount() is None


@pytest.fixture(scope="session")
def mlflow_store_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An empty MLflow sqlite store, its schema made once for the test session (per xdist worker).

    MLflow makes a new store by running its ~100 schema migrations, each committed and synced on
    its own: 5-7 s of a test's wall clock on 2 busy cores, for what every new store holds alike.
    Tests that track into a new store start from a copy (:func:`new_mlflow_store`) instead; the
    first test of tests/unit/test_tracking.py still makes its store from nothing."""
    pytest.importorskip("mlflow")
    from mlflow import MlflowClient

    folder = tmp_path_factory.mktemp("mlflow-template")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(folder)  # MLflow names ./mlruns the default experiment's artifact location
        MlflowClient(f"sqlite:///{folder / 'mlflow.db'}").search_experiments()
    return folder / "mlflow.db"


@pytest.fixture
def new_mlflow_store(mlflow_store_template: Path) -> Callable[[Path], Path]:
    """``new_mlflow_store(path)`` puts a copy of the empty store at ``path`` (its folder made) and
    returns ``path``: a store that MLflow, and trainguard, then open as they open one of their own
    making (``.trainguard/mlflow.db`` beside a job file is trainguard's default)."""

    def copy(path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(mlflow_store_template, path)
        return path

    return copy
