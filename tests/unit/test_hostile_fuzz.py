"""The hostile-file fuzzer (issue 24, slow): random and mutated files under the names trainguard's
readers open -- checkpoint files, Trainer state, a Slurm job's log, a JSONL metrics file, sample
records -- read in a process of their own by ``tests/hostile_driver.py`` with the oracle of the
hostile corpus (tests/unit/test_hostile_files.py): exit 0 or 1, a report written, no marker file,
under the peak-RSS and wall-time caps. Mutations start from pickle gadgets that would touch the
marker, real file headers and log lines.
"""

from __future__ import annotations

import json
import shutil
import struct
import tempfile
from pathlib import Path

import pytest

from tests.helpers import attrgetter_gadget, call_gadget, read_hostile_corpus

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

MAX_RSS_MB = 400.0
SECONDS = 20.0

#: where each fuzzed file goes in a case (a checkpoint is its ``step-10``)
NAMES = ("step-10/model.safetensors", "step-10/.metadata", "step-10/__0_0.distcp",
         "step-10/trainer_state.json", "step-10/model.pt", "step-10/model.safetensors.index.json",
         "slurm.log", "metrics.jsonl", "trainguard-samples/rank0.jsonl")


def _seeds(marker: Path) -> list[bytes]:
    """Files to mutate: gadgets that would touch ``marker``, real headers, log and record lines."""
    touch = f"touch {marker}"
    header = json.dumps({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}).encode()
    return [
        attrgetter_gadget(touch),
        call_gadget("os", "system", touch, 2),
        call_gadget("torch.distributed.checkpoint.metadata", "os.system", touch, 4),
        struct.pack("<Q", len(header)) + header + b"\0" * 8,
        json.dumps({"global_step": 10, "log_history": [{"loss": 1.0, "step": 1}] * 3}).encode(),
        json.dumps({"weight_map": {"w": "model-00001.safetensors"}}).encode(),
        b"trainguard: attempt 0 of job 42 starts on node1 at 1.0\nstep 1 loss 0.5\nstep 2 loss 0.25\n",
        b'{"step": 1, "loss": 1.5}\n{"step": 2, "loss": 0.5}\n',
        b'{"loader": 0, "iter": 0, "batch": 0, "indices": [3, 1]}\n',
    ]


def _mutated(seed: bytes, flips: list[tuple[int, int]], cut: int | None, tail: bytes) -> bytes:
    data = bytearray(seed)
    for at, value in flips:
        if data:
            data[at % len(data)] = value
    if cut is not None:
        del data[cut % (len(data) + 1):]
    return bytes(data) + tail


#: one file: (name, seed index or None for random bytes, flips, cut, bytes appended)
FILE = st.tuples(st.sampled_from(NAMES), st.one_of(st.none(), st.integers(0, 8)),
                 st.lists(st.tuples(st.integers(0, 2**16), st.integers(0, 255)), max_size=8),
                 st.one_of(st.none(), st.integers(0, 2**16)), st.binary(max_size=512))
CASES = st.lists(st.lists(FILE, min_size=1, max_size=6), min_size=1, max_size=8)


@settings(max_examples=12, deadline=None, derandomize=False,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(cases=CASES)
def test_fuzzed_files_run_nothing_and_stay_within_the_caps(cases: list[list[tuple]]) -> None:
    root = Path(tempfile.mkdtemp(prefix="tg-fuzz-"))
    try:
        marker = root / "marker"
        seeds = _seeds(marker)
        corpus = root / "corpus"
        for i, files in enumerate(cases):
            (corpus / f"case{i}" / "step-10").mkdir(parents=True)
            for name, seed, flips, cut, tail in files:
                path = corpus / f"case{i}" / name
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(_mutated(seeds[seed], flips, cut, tail) if seed is not None else tail)
        read_hostile_corpus(corpus, MAX_RSS_MB, SECONDS)
        assert not marker.exists()
    finally:
        shutil.rmtree(root, ignore_errors=True)
