"""The DCP ``.metadata`` unpickler against real saves and crafted pickles (issue 24, item 1).

Real saves of torch on CPU over gloo (plain DDP state and FSDP2/DTensor state through
``dcp.save``, and ``dcp.async_save``) must all read; pickles that reach ``os.system`` through a
dotted name (protocol 4), a plain global (protocol 2) or ``__reduce__``, or that set attributes
on an admitted class, must run nothing and be reported as unreadable with the global named.
"""

from __future__ import annotations

import os
import pickle
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import DCP_METADATA_MODULE, attrgetter_gadget, binunicode, call_gadget
from trainguard.unit.checkpoints import (
    checkpoint_inventory,
    compare_checkpoint_dirs,
    read_checkpoint,
)
from trainguard.unit.checkpoints.dcp import DCP_GLOBALS

DATA = Path(__file__).parents[1] / "data"
META = DCP_METADATA_MODULE


@pytest.fixture(scope="module")
def real_saves(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """DDP, FSDP2 and async saves made by 2 real ranks over gloo (about 8 s)."""
    out = tmp_path_factory.mktemp("dcp_saves")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for _ in range(2):  # once more after torch's own abort at exit ("terminate called without an
        # active exception", a rank's save thread; seen once in a full run): the saves are the data
        # these tests read, not what they test
        result = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
             str(DATA / "dcp_saves.py"), str(out)],
            capture_output=True, text=True, timeout=120, env=env, check=False)
        if result.returncode == 0 or "terminate called without an active exception" not in result.stderr:
            break
        shutil.rmtree(out)
        out.mkdir()
    assert result.returncode == 0, result.stderr[-3000:]
    return out


@pytest.mark.parametrize("kind", ["ddp", "fsdp2", "async"])
def test_real_dcp_saves_read_whole(real_saves: Path, kind: str) -> None:
    contents = read_checkpoint(real_saves / kind)
    assert contents.skipped == {} and contents.files == [""]
    state = contents.parts[""]
    assert {"model", "optim", "step"} <= set(state)
    inventory = checkpoint_inventory(real_saves / kind)
    assert inventory.details["model"] == "4 tensors, 212 elements"
    assert inventory.details["optimizer"].startswith("state for 4 parameters")


def test_fsdp2_shards_compare_with_the_whole_tensors_one_process_saved(real_saves: Path) -> None:
    """2 ranks' DTensor shards and one process's whole tensors are the same logical state; a
    moved moment is named by its parameter and its name."""
    same = compare_checkpoint_dirs(real_saves / "fsdp2", real_saves / "fsdp2_whole")
    assert same.compared and same.ok and same.compared_keys >= 14, same.as_evidence()
    moved = compare_checkpoint_dirs(real_saves / "fsdp2", real_saves / "fsdp2_whole_moved")
    assert [k for k, _ in moved.differing] == ["optim.state.2.weight.exp_avg"], moved.differing
    assert moved.summary() == "optimizer (state.2.weight.exp_avg)"
    assert "1 of 64 elements differ" in moved.differing[0][1] and "(1, 3)" in moved.differing[0][1]


def test_real_saves_name_only_listed_globals(real_saves: Path) -> None:
    named: set[tuple[str, str]] = set()

    class Recording(pickle.Unpickler):  # these files were written by this test: safe to load
        def find_class(self, module: str, name: str) -> object:
            named.add((module, name))
            return super().find_class(module, name)

    for kind in ("ddp", "fsdp2", "async"):
        with open(real_saves / kind / ".metadata", "rb") as handle:
            Recording(handle).load()
    assert named <= DCP_GLOBALS
    assert (META, "Metadata") in named and ("torch.distributed.checkpoint.filesystem", "_StorageInfo") in named


class _Reduce:
    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self) -> tuple[object, ...]:
        return (os.system, (self.command,))


def _gadgets(marker: Path) -> Iterator[tuple[str, bytes]]:
    touch = f"touch {marker}"
    yield "protocol 4, a dotted name to a type (attrgetter) and on to os.system", attrgetter_gadget(touch)
    yield "protocol 4, a dotted name from the metadata module", call_gadget(META, "os.system", touch, 4)
    yield "protocol 4, a dotted name through a class", call_gadget(META, "Metadata.__init__.__globals__", touch, 4)
    yield "protocol 2, os.system", call_gadget("os", "system", touch, 2)
    yield "protocol 2, a dotted name", call_gadget(META, "os.system", touch, 2)
    yield "protocol 4, builtins.eval", call_gadget("builtins", "eval", f"__import__('os').system({touch!r})", 4)
    yield "__reduce__, protocol 2", pickle.dumps(_Reduce(touch), protocol=2)
    yield "__reduce__, protocol 4", pickle.dumps(_Reduce(touch), protocol=4)
    # BUILD on an admitted class: (None, {"__eq__": set}) would set _StorageInfo.__eq__
    storage = binunicode("torch.distributed.checkpoint.filesystem") + binunicode("_StorageInfo") + b"\x93"
    setter = binunicode("builtins") + binunicode("set") + b"\x93"
    yield "BUILD on a class", b"\x80\x04" + storage + b"N}" + binunicode("__eq__") + setter + b"s\x86b."


def test_crafted_metadata_pickles_run_nothing(tmp_path: Path) -> None:
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    eq_before = _StorageInfo.__eq__
    marker = tmp_path / "marker"
    for i, (what, payload) in enumerate(_gadgets(marker)):
        directory = tmp_path / f"step-{i}"
        directory.mkdir()
        (directory / "__0_0.distcp").write_bytes(b"")
        (directory / ".metadata").write_bytes(payload)
        contents = read_checkpoint(directory)
        inventory = checkpoint_inventory(directory)
        comparison = compare_checkpoint_dirs(directory, directory)
        assert not marker.exists(), what
        assert contents.parts == {} and inventory.files == [] and not comparison.compared, what
        assert contents.skipped[".metadata"].startswith("unreadable: "), what
        assert "refused" in contents.skipped[".metadata"], (what, contents.skipped)
    assert _StorageInfo.__eq__ is eq_before


def test_a_dotted_name_is_refused_by_name(tmp_path: Path) -> None:
    (tmp_path / ".metadata").write_bytes(call_gadget(META, "os.system", "true", 4))
    why = read_checkpoint(tmp_path).skipped[".metadata"]
    assert f"the global {META}.os.system has no place" in why and "nothing from the file ran" in why
