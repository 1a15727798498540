"""The launcher's line pump: lines cut as before, and ``caught_up`` true only once every line a
stopped writer printed was handed on, however late the reading thread runs."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from trainguard.launch.pump import LinePump
from trainguard.launch.ranklog import RankLog


def _pumped(tmp_path: Path, data: bytes, max_line: int) -> tuple[list[str], bytes]:
    read_end, write_end = os.pipe()
    os.write(write_end, data)
    os.close(write_end)
    lines: list[str] = []
    pump = LinePump(os.fdopen(read_end, "rb"), RankLog(tmp_path / "log"), lines.append, max_line)
    pump.run()
    return lines, (tmp_path / "log").read_bytes()


def test_lines_are_cut_at_newlines_and_at_the_longest_line(tmp_path: Path) -> None:
    data = b"step 1 loss 2.0\r\n" + b"x" * 25 + b"\nlast without newline"
    lines, log = _pumped(tmp_path, data, max_line=20)
    assert lines == ["step 1 loss 2.0", "x" * 20, "xxxxx", "last without newline"]
    assert log == data  # every byte logged as printed


def test_undecodable_bytes_are_replaced_not_an_error(tmp_path: Path) -> None:
    lines, _ = _pumped(tmp_path, b"\xff\xfe step\n", max_line=1024)
    assert lines == ["\ufffd\ufffd step"]


_WRITER = """
import os, signal, sys
for i in range({n}):
    os.write(1, f"step {{i}}\\n".encode())  # one write per line, as a flushed print makes
os.kill(os.getpid(), signal.SIGSTOP)
"""


@pytest.mark.timeout(60)
def test_caught_up_means_every_line_printed_before_the_stop_was_handed_on(tmp_path: Path) -> None:
    """The reading thread is slow (10 ms a line, as on a loaded machine): the writer printed 50
    lines and stopped itself; when caught_up answers, all 50 were handed on, not the few read by
    then."""
    proc = subprocess.Popen([sys.executable, "-c", _WRITER.format(n=50)], stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None
        lines: list[str] = []

        def slow(text: str) -> None:
            time.sleep(0.01)
            lines.append(text)

        pump = LinePump(proc.stdout, RankLog(tmp_path / "log"), slow, 1024)
        thread = threading.Thread(target=pump.run, daemon=True)
        thread.start()
        deadline = time.monotonic() + 30
        while _state(proc.pid) != "T" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _state(proc.pid) == "T"
        assert pump.caught_up(timeout=20)
        assert lines == [f"step {i}" for i in range(50)]
    finally:
        proc.kill()
        proc.wait(timeout=10)
    thread.join(timeout=10)
    assert not thread.is_alive()
    assert pump.caught_up(timeout=0.1)  # at its end: nothing more to read


@pytest.mark.timeout(60)
def test_caught_up_is_false_while_the_reader_cannot_hand_a_line_on(tmp_path: Path) -> None:
    read_end, write_end = os.pipe()
    release = threading.Event()
    pump = LinePump(os.fdopen(read_end, "rb"), RankLog(tmp_path / "log"), lambda text: release.wait(30), 1024)
    thread = threading.Thread(target=pump.run, daemon=True)
    thread.start()
    os.write(write_end, b"a line the monitor's full queue holds up\n")
    time.sleep(0.2)
    assert not pump.caught_up(timeout=0.3)
    release.set()
    assert pump.caught_up(timeout=20)
    os.close(write_end)
    thread.join(timeout=10)
    assert not thread.is_alive()


def _state(pid: int) -> str:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return fields[0]

