"""A corpus of hostile files read as trainguard's callers read them (issue 24).

Each case is a directory with a ``checkpoint`` in it, read in a process of its own
(``tests/hostile_driver.py``: the inventory and the comparison of the case with itself) under a
peak-RSS cap and a wall-time cap. Pass: exit 0 or 1, a report written, no marker file, under
both caps. The slow fuzzer feeds random bytes to the same readers with the same oracle. A second
corpus (issue 42) holds hostile ``.trainguard/`` state files (calibrations, canary baselines) and
reports beside a job file: each is refused with a reason, never used, never a traceback.
"""

from __future__ import annotations

import json
import math
import os
import pickle
import struct
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

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


def _read(tmp_path: Path, build: Callable[[Path, Path], None]) -> dict[str, Any]:
    """Build a corpus with ``build``, read it under the caps (the oracle asserted) and return each
    case's report; no case touched the marker."""
    marker = tmp_path / "marker"
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    build(corpus, marker)
    rows = read_hostile_corpus(corpus, MAX_RSS_MB, SECONDS)
    assert not marker.exists()
    return {r["case"]: json.loads((corpus / f"{r['case']}.report.json").read_text()) for r in rows}


def test_hostile_corpus_runs_nothing_and_stays_within_its_caps(tmp_path: Path) -> None:
    reports = _read(tmp_path, build_corpus)
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


# --------------------------------------------------------------------------------------------
# .trainguard/: calibrations, canary baselines, reports (issue 42)
# --------------------------------------------------------------------------------------------

STATE_JOB = """\
job:
  name: hostile-state
  command: "python train.py --steps {steps} --ckpt {checkpoint_dir}"
  resume_args: "--resume"
  metrics: {loss: 'step (?P<step>\\\\d+) loss (?P<value>\\\\S+)'}
checks:
  canary: {steps: 4}
  resume: {steps: 4, after_step: 2}
"""
#: a loss of 4 steps, and the request the driver reads the state files for
LOSS = {1: 1.0, 2: 0.5, 3: 0.25, 4: 0.2}


def _good_state(case: Path) -> tuple[Path, Path]:
    """A calibration and a canary baseline of the case's job, as trainguard writes them."""
    from trainguard.checks.baseline import save_baseline
    from trainguard.checks.calibration import CalibrationRuns, metric_stats, save_calibration
    from trainguard.checks.statefiles import JobKey
    from trainguard.config import load_config
    from trainguard.run.request import RunRequest

    case.mkdir(exist_ok=True)
    (case / "trainguard.yaml").write_text(STATE_JOB)
    job_file = load_config(case / "trainguard.yaml")
    request = RunRequest.make(steps=4, seed=0, world_size=1)
    stats = metric_stats([LOSS, {**LOSS, 2: 0.5 + 1e-9}, LOSS], [LOSS, {s: v * 1.1 for s, v in LOSS.items()}])
    assert stats is not None
    calibration = save_calibration(job_file.state_dir, case, request, CalibrationRuns(3, [0, 1]), {"loss": stats},
                                   job=JobKey.of(job_file))
    return calibration, save_baseline(job_file, request, {"loss": LOSS})


def _hostile(path: Path, content: object, marker: Path) -> None:
    """``path`` replaced by ``content``: JSON of a dict, raw bytes or text, or a kind of file."""
    path.unlink()
    if content == "fifo":
        os.mkfifo(path)
    elif content == "device":
        path.symlink_to("/dev/zero")
    elif content == "gadget":
        path.write_bytes(attrgetter_gadget(f"touch {marker}"))
    elif isinstance(content, bytes):
        path.write_bytes(content)
    elif isinstance(content, str):
        path.write_text(content)
    else:
        path.write_text(json.dumps(content))


def _state_variants(good: dict, what: str) -> dict[str, object]:
    """Hostile versions of one good state file (``what``: calibration or baseline)."""
    huge = 10**4000  # the parser takes up to 4300 digits
    if what == "calibration":
        loss = good["metrics"]["loss"]
        same = loss["same_seed"]

        def with_loss(**same_changes: object) -> dict:
            return {**good, "metrics": {"loss": {**loss, "same_seed": {**same, **same_changes}}}}

        values = {"spread_1e308": with_loss(spread=[1e308] * 4), "spread_nan": with_loss(spread=[math.nan] * 4),
                  "mean_infinity": with_loss(mean=[math.inf] * 4), "spread_huge_int": with_loss(spread=[huge] * 4),
                  "metrics_list": {**good, "metrics": [1]}, "request_text": {**good, "request": "x"},
                  "steps_past_the_run": {**good, "metrics": {"loss": {**loss, "steps": [1, 2, 3, 400]}}}}
    else:
        points = good["trajectories"]["loss"]

        def with_loss(new: object) -> dict:
            return {**good, "trajectories": {"loss": new}}

        values = {"loss_nan": with_loss([[s, math.nan] for s, _ in points]),
                  "loss_infinity": with_loss([[s, math.inf] for s, _ in points]), "loss_empty": with_loss([]),
                  "loss_other_steps": with_loss([[s + 1000, v] for s, v in points]),
                  "loss_huge_int": with_loss([[s, huge] for s, _ in points]),
                  "commit_info_list": {**good, "commit_info": []}, "job_text": {**good, "job": "x"}}
    other_job = {**good["job_key"], "file": "other.yaml"}
    return {**values, "version_1": {**good, "format_version": 1},
            "no_job_key": {k: v for k, v in good.items() if k != "job_key"},
            "other_job": {**good, "job_key": other_job}, "deep": "[" * 200_000 + "]" * 200_000,
            "deep_1000": "[" * 1000 + "]" * 1000, "not_utf8": b"\xff\xfe{", "fifo": "fifo", "device": "device",
            "gadget": "gadget"}


def _report_variants() -> dict[str, object]:
    """Hostile ``.trainguard/report.json`` and ``gate/latest.json`` contents."""
    return {"deep": "[" * 200_000 + "]" * 200_000, "deep_1000": '{"checks": ' + "[" * 1000 + "]" * 1000 + "}",
            "huge_duration": {"job": "j", "checks": [{"name": "smoke", "status": "passed", "summary": "",
                                                      "duration_s": 10**4000}]},
            "nan_duration": '{"job": "j", "checks": [{"name": "smoke", "status": "passed", "summary": "", '
                            '"duration_s": NaN}]}',
            "checks_text": {"job": "j", "checks": "all passed"}, "check_list": {"job": "j", "checks": [[1]]},
            "unknown_keys": {"job": "j", "checks": [{"name": "smoke", "status": "passed", "summary": "",
                                                     "__class__": "x"}], "extra": 1},
            "status_forged": {"job": "j", "checks": [{"name": "smoke", "status": "promoted", "summary": ""}]},
            "not_utf8": b"\xff\xfe{", "fifo": "fifo", "device": "device", "gadget": "gadget"}


def build_state_corpus(root: Path, marker: Path) -> None:
    """``clean``: a job file with a good calibration, baseline and report; ``calibrations`` and
    ``baselines``: every hostile version of one (``NNNN_<variant>.json``, newest last) beside a job
    file; ``report_<variant>``: a hostile ``report.json`` and ``gate/latest.json``."""
    calibration, baseline = _good_state(root / "clean")
    (root / "clean" / ".trainguard" / "report.json").write_text(json.dumps(
        {"job": "hostile-state", "checks": [{"name": "canary", "status": "passed", "summary": "", "duration_s": 2.0}]}))
    good = {"calibrations": calibration, "baselines": baseline}
    for what, path in good.items():
        case = root / what
        case.mkdir()
        (case / "trainguard.yaml").write_text(STATE_JOB)
        directory = case / ".trainguard" / path.parent.relative_to(root / "clean" / ".trainguard")
        directory.mkdir(parents=True)
        variants = _state_variants(json.loads(path.read_text()), what.removesuffix("s"))
        for number, (name, content) in enumerate(variants.items(), start=1):
            target = directory / f"{number:04d}_{name}.json"
            target.write_text("{}")
            _hostile(target, content, marker)
    for name, content in _report_variants().items():
        case = root / f"report_{name}"
        case.mkdir()
        (case / "trainguard.yaml").write_text(STATE_JOB)
        for where in ("report.json", "gate/latest.json"):
            path = case / ".trainguard" / where
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("{}")
            _hostile(path, content, marker)


def test_hostile_state_files_and_reports_are_refused_with_a_reason(tmp_path: Path) -> None:
    """issue 42: calibrations, canary baselines and reports in .trainguard/ are data another program
    or person wrote: a hostile one is refused naming the file and the key, never used (no band of
    inf, nothing inside a band of NaN), never a traceback, and runs nothing."""
    states = {case: report["state"] for case, report in _read(tmp_path, build_state_corpus).items()}
    clean = states.pop("clean")
    assert clean["calibration_used"] == "0001_nogit.json" and "within 3x" in clean["tolerance"]["within"]
    assert clean["baseline_used"].startswith("used: ") and "None" not in clean["baseline_used"]
    assert clean["reports"]["report.json"] == "used: passed" and clean["plan"].startswith("used: ")
    for case, state in states.items():
        assert state["calibration_used"] is None and state["tolerance"]["bands"] == {}, case
        assert "inf" not in state["tolerance"]["within"], case
        assert state["baseline_used"] == "used: None" or state["baseline_used"].startswith("refused: "), case
        assert state["plan"].startswith("used: "), (case, state["plan"])  # a bad last report: no estimate
        assert all(v.startswith("refused: ") and "run `trainguard check` again" in v for v in state["reports"].values()), (
            case, state["reports"])
        assert state["gate_report"].startswith("refused: "), case
        assert bool(state["reports"]) is case.startswith("report_"), case
    files = [*states["calibrations"]["calibrations"].items(), *states["baselines"]["baselines"].items()]
    assert len(files) == 32  # 16 hostile versions of each
    for name, outcome in files:
        if name.endswith("_other_job.json"):
            continue  # a good file, of another job file: readable, not used (above)
        assert outcome.startswith("refused: ") and name in outcome, (name, outcome)
        assert "calibrate" in outcome or "save a new baseline" in outcome.lower(), (name, outcome)
    # the newest file is the first read: each job's own readable files are what is said
    assert "trainguard calibrate" in states["calibrations"]["calibration_note"]
    assert states["baselines"]["baseline_used"].startswith("refused: latest: no baseline of this machine")
