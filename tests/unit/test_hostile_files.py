"""A corpus of hostile files read as trainguard's callers read them (issue 24).

Each case is a directory with a ``checkpoint`` in it, read in a process of its own
(``tests/hostile_driver.py``: the inventory and the comparison of the case with itself) under a
peak-RSS cap and a wall-time cap. Pass: exit 0 or 1, a report written, no marker file, under
both caps. The slow fuzzer feeds random bytes to the same readers with the same oracle.
"""

from __future__ import annotations

import json
import os
import pickle
import struct
import warnings
from pathlib import Path

import torch

from tests.helpers import attrgetter_gadget, call_gadget, read_hostile_corpus

#: what a case may grow the reading process by, and take
MAX_RSS_MB = 400.0
SECONDS = 20.0


def _dcp(directory: Path) -> Path:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": {"w": torch.ones(4)}, "step": 3}, checkpoint_id=str(directory), no_dist=True)
    return directory


def _rewrite_storage(directory: Path, **changes: object) -> None:
    """Every storage entry of the (trusted, just written) metadata changed as given."""
    with open(directory / ".metadata", "rb") as handle:
        metadata = pickle.load(handle)  # written by _dcp above in this process
    for info in metadata.storage_data.values():
        for name, value in changes.items():
            setattr(info, name, value)
    (directory / ".metadata").write_bytes(pickle.dumps(metadata, protocol=4))


class _Reduce:
    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self) -> tuple[object, ...]:
        return (os.system, (self.command,))


def _nested_pickle(depth: int) -> bytes:
    return b"\x80\x02" + b"]" * depth + b"a" * (depth - 1) + b"."


def build_corpus(root: Path, marker: Path) -> None:
    touch = f"touch {marker}"

    def case(name: str) -> Path:
        path = root / name / "step-10"
        path.mkdir(parents=True)
        return path

    c = _dcp(case("dcp_gadget_p4"))
    (c / ".metadata").write_bytes(attrgetter_gadget(touch))
    c = _dcp(case("dcp_gadget_p2"))
    (c / ".metadata").write_bytes(call_gadget("os", "system", touch, 2))
    torch.save({"x": _Reduce(touch)}, case("pt_reduce") / "model.pt")
    _rewrite_storage(_dcp(case("dcp_points_outside")), relative_path="../../outside.bin")
    (root / "dcp_points_outside" / "outside.bin").write_bytes(b"secret" * 100)
    _rewrite_storage(_dcp(case("dcp_points_at_a_device")), relative_path="/dev/zero", length=2**40)
    _rewrite_storage(_dcp(case("dcp_huge_length")), length=2**62)
    _rewrite_storage(_dcp(case("dcp_negative_offset")), offset=-5)
    c = case("safetensors_huge_header")
    (c / "model.safetensors").write_bytes(struct.pack("<Q", 2**63) + b"{}")
    c = case("safetensors_bad_offsets")
    header = json.dumps({"w": {"dtype": "F32", "shape": [2**40], "data_offsets": [0, 2**42]}}).encode()
    (c / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 16)
    c = case("json_deep")
    (c / "trainer_state.json").write_text("[" * 200_000 + "]" * 200_000)
    c = case("pickle_deep")
    (c / "model.pt").write_bytes(_nested_pickle(50_000))
    c = case("index_wrong_types")
    (c / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": ["a", {"b": 1}]}}))
    c = case("index_names_outside")
    (c / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "../../x.safetensors"}}))
    c = case("fifos")
    os.mkfifo(c / "model.pt")
    os.mkfifo(c / "trainer_state.json")
    c = case("dcp_metadata_fifo")
    os.mkfifo(c / ".metadata")
    c = case("symlinks_out")
    (root / "symlinks_out" / "secret.pt").write_bytes(b"\0")
    torch.save({"w": torch.ones(2)}, root / "symlinks_out" / "secret_state.pt")
    (c / "model.pt").symlink_to(root / "symlinks_out" / "secret_state.pt")
    (c / "etc").symlink_to("/etc")
    (c / "loop_a.pt").symlink_to(c / "loop_b.pt")
    (c / "loop_b.pt").symlink_to(c / "loop_a.pt")
    (c / "dirloop").symlink_to(c)
    c = case("non_utf8_names")
    torch.save({"w": torch.ones(2)}, os.fsdecode(bytes(c) + b"/mod\xffel.pt"))
    os.mkdir(os.fsdecode(bytes(c) + b"/sub\xfe"))
    c = case("many_files")
    # three times the read limit (read_max_files, 10,000 by default): 100,000 took ~5 s to make
    for i in range(30_000):
        os.close(os.open(c / f"f{i}.pt", os.O_CREAT | os.O_WRONLY, 0o644))


def test_hostile_corpus_runs_nothing_and_stays_within_its_caps(tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    build_corpus(corpus, marker)
    rows = read_hostile_corpus(corpus, MAX_RSS_MB, SECONDS)
    assert not marker.exists()
    reports = {r["case"]: json.loads((corpus / f"{r['case']}.report.json").read_text()) for r in rows}
    outside = reports["dcp_points_outside"]["inventory"]["skipped"][".metadata"]
    assert outside.startswith("unreadable: ") and "outside the checkpoint" in outside
    assert "leads outside" in reports["symlinks_out"]["inventory"]["skipped"]["model.pt"]
    assert "model.pt" not in reports["symlinks_out"]["inventory"]["files"]  # the outside file is never read
    assert "over the limit" in str(reports["many_files"]["inventory"]["skipped"])
    assert not reports["many_files"]["ok"]  # skipped for a limit: never equal
    assert "refused" in reports["pt_reduce"]["inventory"]["skipped"]["model.pt"]
    assert "weights_only=False" not in json.dumps(reports)


def test_fifos_and_links_out_are_named_and_never_opened(tmp_path: Path) -> None:
    from trainguard.unit.checkpoints import read_checkpoint

    os.mkfifo(tmp_path / "model.pt")
    os.mkfifo(tmp_path / "trainer_state.json")
    (tmp_path / "optimizer.pt").symlink_to("/etc/hostname")
    skipped = read_checkpoint(tmp_path).skipped  # would block forever on an open of the FIFO
    assert skipped["model.pt"] == "unreadable: model.pt is a FIFO, not a regular file; not opened"
    assert "a FIFO" in skipped["trainer_state.json"]
    assert "leads outside" in skipped["optimizer.pt"]
