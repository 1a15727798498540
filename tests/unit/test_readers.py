"""The bounded reads of trainguard's own files and of those it did not write
(trainguard/_internal/readers.py), and the readers of its reports: a file costs what it holds,
never its limit, and a report that is not one trainguard wrote is a clear error, never a traceback.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from trainguard._internal.readers import OWN_FILE_LIMITS, ReadLimits, read_at_most, read_bytes
from trainguard.cli import main
from trainguard.errors import ConfigError
from trainguard.evidence import Recorded
from trainguard.report import CheckResult, Report, load_report

REPO = Path(__file__).resolve().parents[2]
JOBS = REPO / "tests" / "data" / "jobs"

#: a 3 KB file read with read_max_mb 30000, in a process of at most 1 GiB of address space
SMALL_UNDER_A_HUGE_LIMIT = textwrap.dedent("""
    import resource, sys
    from pathlib import Path
    resource.setrlimit(resource.RLIMIT_AS, (2**30, 2**30))
    from trainguard._internal.readers import ReadLimits, read_bytes
    print(len(read_bytes(Path(sys.argv[1]), ReadLimits(max_bytes=30000 * 2**20))))
""")


def test_a_small_file_under_a_30000_mb_limit_is_read_in_a_process_of_1_gib(tmp_path: Path) -> None:
    """``read_bytes`` allocated the limit plus one byte up front: a MemoryError for a 3 KB file
    with read_max_mb 30000 (TRAINGUARD_READ_MAX_MB), or under `ulimit -v`. It reads what the
    file holds."""
    path = tmp_path / "small.bin"
    path.write_bytes(b"x" * 3000)
    done = subprocess.run([sys.executable, "-c", SMALL_UNDER_A_HUGE_LIMIT, str(path)], capture_output=True,
                          text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["3000"]


@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="no /proc")
def test_a_file_that_reports_no_size_is_read_whole_up_to_the_limit() -> None:
    """/proc's files say 0 bytes and hold more: what is past the size is read in chunks."""
    data = read_bytes(Path("/proc/self/status"))
    assert b"Name:" in data and data.endswith(b"\n")
    with pytest.raises(ValueError, match="grew past the limit of 10 bytes"):
        read_bytes(Path("/proc/self/status"), ReadLimits(max_bytes=10))


def test_read_at_most_reads_what_there_is_and_stops_at_the_bound() -> None:
    assert read_at_most(io.BytesIO(b"abc"), 2**40) == b"abc"
    assert read_at_most(io.BytesIO(b"x" * (3 * 2**20)), 2**20 + 5) == b"x" * (2**20 + 5)


# --------------------------------------------------------------------------------------------
# Reports read back: the file, the key and the fix
# --------------------------------------------------------------------------------------------


def _report(tmp_path: Path) -> Path:
    report = Report(job="toy", checks=[CheckResult("smoke", "passed", "5 steps", duration_s=1.5),
                                       CheckResult("determinism", "failed", "step 3 differs")])
    return report.write(tmp_path / "report.json")


HOSTILE_REPORTS = {
    "nested 1000 deep": ('{"job": "toy", "checks": [{"name": "smoke", "evidence": ' + "[" * 1000 + "]" * 1000 + "}]}",
                         "nests too deep to parse"),
    "a JSON list": ("[1, 2]", "not a report: no JSON object"),
    "checks not a list": ('{"job": "toy", "checks": {"a": 1}}', "not a report: no JSON object"),
    "a check not an object": ('{"job": "toy", "checks": [7]}', "checks[0]: a int, not a check object"),
    "evidence not an object": ('{"job": "toy", "checks": [{"name": "a", "status": "passed", "summary": "",'
                               ' "evidence": [1]}]}', "checks[0].evidence: expected a dict, got [1]"),
    "an infinite duration": ('{"job": "toy", "checks": [{"name": "a", "status": "passed", "summary": "",'
                             ' "duration_s": Infinity}]}', "checks[0].duration_s: expected a finite number"),
    "a huge integer": ('{"job": "toy", "created_at": 1' + "0" * 400 + "}", "created_at: expected a finite number"),
    "an integer past Python's digits": ('{"job": "toy", "created_at": 1' + "0" * 5000 + "}", "is not JSON"),
    "an unknown status": ('{"job": "toy", "checks": [{"name": "a", "status": "fine", "summary": ""}]}',
                          "checks[0]: status must be one of"),
    "an unknown key": ('{"job": "toy", "extra": 1}', "extra: unknown key"),
    "a mistyped key": ('{"job": 5}', "job: expected a str, got 5"),
    "a check without its name": ('{"job": "toy", "checks": [{"status": "passed", "summary": ""}]}',
                                 "checks[0]: missing name"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE_REPORTS))
def test_a_report_that_is_not_one_trainguard_wrote_is_a_clear_error(tmp_path: Path, case: str) -> None:
    text, words = HOSTILE_REPORTS[case]
    path = tmp_path / "report.json"
    path.write_text(text)
    with pytest.raises(ConfigError) as caught:
        load_report(path)
    message = str(caught.value)
    assert message.startswith(f"{path}: ") and words in message, message
    assert "run `trainguard check` again" in message


def test_a_report_over_the_own_file_limit_is_not_read(tmp_path: Path) -> None:
    path = tmp_path / "report.json"
    with open(path, "wb") as handle:  # sparse: nothing is written, the size says it all
        handle.truncate(OWN_FILE_LIMITS.max_bytes + 1)
    with pytest.raises(ConfigError, match="over the limit of 67108864"):
        load_report(path)
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    with pytest.raises(ConfigError, match="is a FIFO, not a regular file"):
        load_report(fifo)  # never waited on


def test_a_report_trainguard_wrote_reads_back_whole(tmp_path: Path) -> None:
    read = load_report(_report(tmp_path))
    assert [(c.name, c.status, c.duration_s) for c in read.checks] == [("smoke", "passed", 1.5),
                                                                       ("determinism", "failed", 0.0)]
    assert read.status == "failed"


def test_validate_skips_an_earlier_report_it_cannot_read(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The plan reads the durations of the last report beside the job file: one nested 1000 deep
    was a RecursionError traceback out of `trainguard validate` and `trainguard gate`."""
    shutil.copy(JOBS / "toy.trainguard.yaml", tmp_path / "trainguard.yaml")
    shutil.copy(JOBS / "toy_train.py", tmp_path / "toy_train.py")
    state = tmp_path / ".trainguard"
    state.mkdir()
    (state / "report.json").write_text('{"checks": ' + "[" * 1000 + "]" * 1000 + "}")
    assert main(["validate", str(tmp_path / "trainguard.yaml")]) == 0
    assert "no earlier report for these checks" in capsys.readouterr().out
    # a readable one gives its durations
    (state / "report.json").write_text(json.dumps({"checks": [{"name": "smoke", "duration_s": 12.0},
                                                              {"name": "determinism", "duration_s": 9.0}]}))
    assert main(["validate", str(tmp_path / "trainguard.yaml")]) == 0
    assert "no earlier report for these checks" not in capsys.readouterr().out


@pytest.mark.timeout(60)
def test_the_gate_report_embeds_no_plot_that_is_not_a_regular_file(tmp_path: Path) -> None:
    """A check's plot is read back into the HTML gate report through the bounded reader: a FIFO
    in its place (never opened: the read would wait for a writer) or a file over the limit is
    left out; a real plot is embedded."""

    from trainguard.config.gate import GatePolicy
    from trainguard.gate.policy import Capabilities, Decision
    from trainguard.gate.provenance import provenance_for
    from trainguard.gate.run import GateReport, write_gate_report

    fifo, big, png = tmp_path / "fifo.png", tmp_path / "big.png", tmp_path / "real.png"
    os.mkfifo(fifo)
    with open(big, "wb") as handle:
        handle.truncate(OWN_FILE_LIMITS.max_bytes + 1)
    png.write_bytes(b"\x89PNG\r\n\x1a\nplot")
    job = JOBS / "toy.trainguard.yaml"
    report = Report(job="toy", checks=[CheckResult("canary", "passed", "inside the band",
                                                   evidence=Recorded({"plots": [str(fifo), str(big), str(png)]}))])
    gate = GateReport(job="toy", job_file=str(job), decision=Decision("promote"), report=report,
                      provenance=provenance_for(job), capabilities=Capabilities(gpus=0, root=False, ray=False),
                      policy=GatePolicy.model_validate({}))
    html = Path(write_gate_report(gate, tmp_path / "gate")["html"]).read_text()
    assert html.count("data:image/png;base64,") == 1 and "canary: real" in html
