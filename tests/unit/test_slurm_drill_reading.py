"""`trainguard slurm-drill` reads its record, its reference and the job's log as data (issue 24,
item 8): through the reader layer (regular files only, one bounded line at a time, within the
deadline); a bad or group-less ``--metric-regex`` and a record nested too deep are usage errors
naming the option or the file. No Slurm here: the files are made in tmp_path and ``scontrol`` is
kept off PATH (the job's state is then ``unknown``, never terminal).
"""

from __future__ import annotations

import json
import os
import time
import tracemalloc
from pathlib import Path

import pytest

from tests.helpers import time_limit
from trainguard._internal.readers import LineTail, OverLimit, ReadLimits, Unreadable
from trainguard.cli import main
from trainguard.queue.base import SubmissionError
from trainguard.queue.slurm_drill import SlurmDrill, read_attempts

LOSS = r"step (?P<step>\d+) loss (?P<value>\S+)"


@pytest.fixture
def no_slurm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    empty = tmp_path / "no-slurm-bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))


def _drill_args(tmp_path: Path, *, log: Path | None = None, record: object = None,
                reference: Path | None = None, regex: str = LOSS) -> list[str]:
    if reference is None:
        reference = tmp_path / "reference.out"
        reference.write_text("".join(f"step {i} loss {1 / i}\n" for i in range(1, 11)))
    path = tmp_path / "submission-42.json"
    data = record if record is not None else {"job_id": "42", "links": {"log": str(log or tmp_path / "log")}}
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return ["slurm-drill", str(path), "--fault", "requeue", "--after-step", "3", "--steps", "10",
            "--reference", str(reference), "--metric-regex", regex, "--timeout", "30"]


@pytest.mark.parametrize(("regex", "said"), [
    ("step (?P<step>\\d+ loss", "is not a valid regular expression"),
    (r"step (\d+) loss (\S+)", "lacks the named group(s) step, value"),
    (r"step (?P<step>\d+) loss \S+", "lacks the named group(s) value"),
])
def test_a_bad_or_groupless_metric_regex_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], regex: str, said: str
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(_drill_args(tmp_path, regex=regex))
    err = capsys.readouterr().err
    assert exited.value.code == 2, err
    assert "argument --metric-regex" in err and said in err and "(?P<" in err, err
    assert "Traceback" not in err and "step: count" not in err  # no step-less lines in a Slurm log


def test_the_library_refuses_a_groupless_regex_by_name() -> None:
    with pytest.raises(SubmissionError, match=r"metric_regex: regex .* lacks the named group\(s\) step"):
        SlurmDrill(name="d", fault="requeue", after_step=1, steps=3, metric_regex=r"loss (?P<value>\S+)")


def test_a_record_nested_too_deep_is_unreadable_not_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(_drill_args(tmp_path, record="[" * 100_000 + "]" * 100_000))
    err = capsys.readouterr().err
    assert code == 2, err
    assert "submission-42.json: unreadable: " in err and "nests too deep" in err, err


def test_a_record_or_reference_that_is_a_fifo_is_refused_not_waited_on(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], no_slurm: None
) -> None:
    fifo = tmp_path / "reference.fifo"
    os.mkfifo(fifo)
    with time_limit(10):
        code = main(_drill_args(tmp_path, reference=fifo))
    err = capsys.readouterr().err
    assert code == 2 and "reference.fifo: unreadable: " in err and "a FIFO" in err, err


def test_a_log_that_is_a_fifo_ends_the_drill_within_its_timeout(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], no_slurm: None
) -> None:
    log = tmp_path / "slurm-42.out"
    os.mkfifo(log)
    started = time.monotonic()
    with time_limit(10):  # the open of the FIFO blocked past --timeout 30
        code = main(_drill_args(tmp_path, log=log))
    out = capsys.readouterr().out
    assert code == 1 and time.monotonic() - started < 5, out
    assert out.startswith("ERROR   drill:slurm-requeue: the job's log") and "is a FIFO" in out, out


def test_the_log_is_read_one_line_at_a_time(tmp_path: Path) -> None:
    log = tmp_path / "slurm-42.out"
    noise = "x" * 999 + "\n"
    with open(log, "w") as handle:
        handle.write("trainguard: attempt 0 of job 42 starts on node1 at 1.0\n")
        for i in range(1, 21):
            handle.write(noise * 1000 + f"step {i} loss {1 / i}\n")  # 20 MB in all
        handle.write("y" * 5_000_000 + "\nstep 21 loss 0.5\n")  # one line of 5 MB
    tracemalloc.start()
    try:
        attempts = read_attempts(log, LOSS)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert [p.step for p in attempts[0].points] == list(range(1, 22))
    assert peak < 2_000_000, peak  # the whole log was read into memory (several times its size)


def test_line_tail_follows_a_growing_file(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    tail = LineTail(path, max_line=8)
    assert list(tail.lines()) == [] and tail.caught_up  # not there yet
    path.write_bytes(b"a\nbb")
    assert list(tail.lines()) == [b"a"]  # bb waits for its newline
    with open(path, "ab") as handle:
        handle.write(b"b\n" + b"c" * 20 + b"\nd\n")
    assert list(tail.lines()) == [b"bbb", b"c" * 8, b"d"]  # a long line cut to max_line
    assert list(tail.lines(until=time.monotonic() - 1)) == [] and not tail.caught_up
    path.write_bytes(b"z" * 100)
    with pytest.raises(OverLimit, match="over the limit"):
        list(LineTail(path, ReadLimits(max_bytes=10)).lines())
    path.unlink()
    os.mkfifo(path)
    with pytest.raises(Unreadable, match="a FIFO"):
        list(tail.lines())


def test_a_jsonl_metrics_file_is_read_as_data(tmp_path: Path) -> None:
    from trainguard.launch.metrics import JsonlTail

    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"step": 1, "loss": 1.5}\n' + b"[" * 100_000 + b"\n"  # nested too deep
                     + b'{"step": "x", "loss": 1}\n{"step": 1e999, "loss": 1}\n{"step": [], "loss": 1}\n'
                     + b'{"step": 2, "loss": 0.5}\n')
    assert [(p.step, p.value) for p in JsonlTail(path, ["loss"], rank=0).poll(1.0)] == [(1, 1.5), (2, 0.5)]
    fifo = tmp_path / "fifo.jsonl"
    os.mkfifo(fifo)
    tail = JsonlTail(fifo, ["loss"], rank=0)
    with time_limit(10):  # the open blocked the launcher's loop for good
        assert tail.poll(1.0) == []
    assert tail.unreadable is not None and "a FIFO" in tail.unreadable


def test_sample_records_are_read_as_data(tmp_path: Path) -> None:
    from trainguard.launch.hook import SAMPLES_DIR
    from trainguard.launch.samples import read_samples

    folder = tmp_path / SAMPLES_DIR
    folder.mkdir()
    good = b'{"loader": 0, "iter": 0, "batch": 0, "indices": [3, 1]}\n'
    (folder / "rank0.jsonl").write_bytes(good + b"[" * 100_000 + b"\n" + good)  # one line nested too deep
    os.mkfifo(folder / "rank1.jsonl")
    outside = tmp_path / "elsewhere.jsonl"
    outside.write_bytes(good)
    (folder / "rank2.jsonl").symlink_to(outside)
    with time_limit(10):  # the FIFO's open blocked the check for good
        samples = read_samples(tmp_path)
    assert list(samples) == [0] and [b.indices for b in samples[0]] == [[3, 1], [3, 1]]
