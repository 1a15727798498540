"""The step records of a run read back as typed records: bounded, and never trusting a line."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from tests.steplines import PARAMS, Step, restore, save, trajectory, write_rank
from trainguard.launch.hook import STEPS_DIR
from trainguard.launch.steps import Fingerprint, read_steps


def test_steps_saves_restores_and_seeds_are_read_as_records(tmp_path: Path) -> None:
    seed = {"k": "seed", "t": 0.1, "call": "torch.manual_seed"}
    write_rank(tmp_path, 0, trajectory(1, 3, scale=65536.0), before=[seed, *restore("Optimizer.load_state_dict")],
               extra=[save("model", "optimizer", "rng")])
    write_rank(tmp_path, 1, trajectory(1, 2))
    records = read_steps(tmp_path)
    assert sorted(records.ranks) == [0, 1] and records.has_steps
    rank0 = records.ranks[0]
    step = rank0.of(0)[2]
    assert step.groups[0].lr == 1e-3 * 0.9 ** 2 and step.groups[0].get("betas") == (0.9, 0.999)
    assert step.groups[0].get("foreach") is None  # a value of no compared type is left out
    assert set(step.param) == set(PARAMS) and isinstance(step.param["fc1.weight"], Fingerprint)
    assert step.param["fc1.weight"].fp == 2000 and step.rng is not None and step.rng.cpu == f"{2:016x}"
    assert step.scaler is not None and step.scaler.scale == 65536.0 and not step.scaler.skipped
    assert step.backward == 1
    assert records.restore_calls() == {"Optimizer.load_state_dict"}
    assert records.seed_calls() == {"torch.manual_seed"}
    assert records.saved_owners() == {"model", "optimizer", "rng"}
    assert rank0.processes == 1 and rank0.malformed == 0 and rank0.cut_at is None and not rank0.truncated
    assert records.notes() == []


def test_a_run_without_records_reads_as_none(tmp_path: Path) -> None:
    records = read_steps(tmp_path)
    assert not records.ranks and not records.has_steps and records.saved_owners() is None


def test_every_line_of_the_wrong_shape_is_counted_and_skipped(tmp_path: Path) -> None:
    good = Step(1).line()
    bad = [
        "not json", "[1, 2]", json.dumps({"no": "kind"}),
        json.dumps({**good, "n": 0}), json.dumps({**good, "n": True}), json.dumps({**good, "opt": "0"}),
        json.dumps({**good, "param": {"w": ["xyz", 1.0]}}),  # not 16 hex digits
        json.dumps({**good, "param": {"w": ["0" * 16, "many"]}}),  # a string that is not nan/inf
        json.dumps({**good, "grad": ["w"]}), json.dumps({**good, "groups": {"lr": 1}}),
        json.dumps({**good, "rng": {"cpu": 5}}), json.dumps({**good, "scaler": {"scale": "big"}}),
        json.dumps({"k": "save", "keys": {"model": 3}}), json.dumps({"k": "restore", "call": None}),
        json.dumps({"k": "step", "opt": 0, "n": 2, "t": 1.0, "placement": {"w": 1}}),
        '{"k": "step", "opt": 0, "n": 3, "param": {"w": ["00000000000000ff", 1.0]',  # cut short by a kill
    ]
    write_rank(tmp_path, 0, [Step(1)])
    path = tmp_path / STEPS_DIR / "rank0.jsonl"
    with open(path, "a") as handle:
        handle.write("\n".join(bad) + "\n")
        handle.write(json.dumps({"k": "newer-kind", "x": 1}) + "\n")  # unknown kinds are ignored
        handle.write(json.dumps({**good, "n": 4, "new_key": [1], "param": {"w": ["00000000000000ff", "nan"]}}) + "\n")
    rank = read_steps(tmp_path).ranks[0]
    assert rank.malformed == len(bad), rank.malformed
    assert sorted(rank.of(0)) == [1, 4]
    assert math.isnan(rank.of(0)[4].param["w"].ss)


def test_a_file_over_the_cap_is_read_up_to_it_and_says_so(tmp_path: Path) -> None:
    path = write_rank(tmp_path, 0, trajectory(1, 50))
    size = path.stat().st_size
    cap = size // 2
    rank = read_steps(tmp_path, max_bytes=cap).ranks[0]
    assert 0 < len(rank.steps) < 50 and rank.cut_at == cap
    assert rank.malformed == 0  # the line the cap cut is left out, not counted malformed
    assert any("read up to" in note for note in read_steps(tmp_path, max_bytes=cap).notes())
    assert len(read_steps(tmp_path).ranks[0].steps) == 50
    # two runs compared over what was read say that the rest was not
    from trainguard.checks.divergence import Agreement, first_divergence

    agreed = first_divergence(read_steps(tmp_path, max_bytes=cap), read_steps(tmp_path))
    assert isinstance(agreed, Agreement) and agreed.compared_steps == len(rank.steps)
    assert "its steps after that are not compared" in agreed.sentence()


def test_the_agents_own_truncation_is_said(tmp_path: Path) -> None:
    write_rank(tmp_path, 0, trajectory(1, 2), extra=[{"k": "truncated", "bytes": 100}])
    records = read_steps(tmp_path)
    assert records.ranks[0].truncated and any("reached its cap" in n for n in records.notes())


def test_a_record_that_is_not_a_regular_file_inside_the_folder_is_named_not_read(tmp_path: Path) -> None:
    folder = tmp_path / STEPS_DIR
    folder.mkdir()
    os.mkfifo(folder / "rank0.jsonl")  # would block an open
    outside = tmp_path / "elsewhere.jsonl"
    outside.write_text(json.dumps(Step(1).line()) + "\n")
    (folder / "rank1.jsonl").symlink_to(outside)
    records = read_steps(tmp_path)
    assert not records.ranks, records.ranks
    assert len(records.unreadable) == 2 and any("FIFO" in u for u in records.unreadable), records.unreadable
