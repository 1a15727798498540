"""Storage drills (``fault: storage``) and a kill during the save (``fault: kill_during_save``)
on real processes through a real FUSE layer over the checkpoint directory (issue 14, items 2-3).

The 2-rank toy job (tests/data/jobs/toy_train.py, no torch) checkpoints every 5 steps as one
JSON file per rank. Each clean job must pass and each planted defect must fail, naming why:

* ``corrupt``: the run is stopped after step 11 and one bit of a digit of the step-10 checkpoint
  (byte 40: the RNG state) is flipped on disk. Clean: ``--ckpt-verify fail`` (a checksum: the resume exits 1 naming the file) or
  ``fallback`` (the resume falls back to step 5). Planted: no check, the resume trains on from
  the flipped checkpoint, which the report names.
* ``eio_write`` / ``fsync``: EIO from step 7 on. Clean: the atomic writer (temp + fsync + rename)
  fails loudly and the step-5 checkpoint resumes. Planted: ``--ckpt-inplace`` (a torn step-10
  file; it never fsyncs, so it runs through a failing fsync without noticing).
* ``eio_read``: the run is stopped after step 11, then reads of the step-10 files fail. Clean:
  the resume fails loudly. Planted: ``--ckpt-verify scratch`` starts again from step 1.
* ``slow``: 300 ms per write for 2 s of a job that checkpoints every 20 steps: the checkpoint
  stall is reported and the rate holds (a checkpoint every 5 steps put one 300 ms write in 0.25 s
  of steps, so the rate sat at 0.5 of the rate before: 43 % on a loaded machine); planted: a
  checkpoint every step on slow storage.
* ``kill_during_save``: rank 0's step-10 write is held in the layer and the rank killed. Clean:
  the atomic writer resumes from step 5. Planted: ``--ckpt-inplace`` (the torn file is the newest)
  and ``--latest-pointer-first`` (the "latest" symlink names a checkpoint never written).

Every drill here needs root and FUSE; without them they are skipped with the reason.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import drills_sharing_a_reference, report_evidence, toy_job
from trainguard.faults.fusefs import fuse_unavailable
from trainguard.report import CheckResult
from trainguard.session import drill

pytestmark = pytest.mark.timeout(300)

_WHY = fuse_unavailable()
needs_fuse = pytest.mark.skipif(_WHY is not None, reason=f"no FUSE layer here: {_WHY}")

DRILLS = [
    '{name: corrupt-checked, fault: storage, steps: 40, after_step: 11, params: {kind: corrupt, offset: 40}, args: ["--ckpt-verify", "fail"]}',
    '{name: corrupt-fallback, fault: storage, expect: recover, steps: 40, after_step: 11, params: {kind: corrupt, offset: 40}, args: ["--ckpt-verify", "fallback"]}',
    '{name: corrupt-silent, fault: storage, steps: 40, after_step: 11, params: {kind: corrupt, offset: 40}}',
    '{name: eio-write, fault: storage, steps: 40, after_step: 7, params: {kind: eio_write}}',
    '{name: eio-write-inplace, fault: storage, steps: 40, after_step: 7, params: {kind: eio_write}, args: ["--ckpt-inplace"]}',
    '{name: fsync, fault: storage, steps: 40, after_step: 7, params: {kind: fsync}}',
    '{name: fsync-inplace, fault: storage, steps: 40, after_step: 7, params: {kind: fsync}, args: ["--ckpt-inplace"]}',
    '{name: eio-read, fault: storage, steps: 40, after_step: 11, params: {kind: eio_read}}',
    '{name: eio-read-scratch, fault: storage, steps: 40, after_step: 11, params: {kind: eio_read}, args: ["--ckpt-verify", "scratch"]}',
    '{name: slow, fault: storage, steps: 80, after_step: 6, duration: 2.0, params: {kind: slow, latency_ms: 300}, args: ["--ckpt-every", "20"]}',
    '{name: slow-every-step, fault: storage, steps: 40, after_step: 6, duration: 0.6, params: {kind: slow, latency_ms: 100}, args: ["--ckpt-every", "1"]}',
    '{name: kill-save, fault: kill_during_save, steps: 40, after_step: 7}',
    '{name: kill-save-inplace, fault: kill_during_save, steps: 40, after_step: 7, args: ["--ckpt-inplace"]}',
    '{name: kill-save-pointer, fault: kill_during_save, steps: 40, after_step: 7, args: ["--latest-pointer-first"]}',
]

#: the default run: a clean job and planted defects of each fault. One uninterrupted reference
#: serves all but two: ``--ckpt-verify`` acts only on a resume and ``--ckpt-inplace`` writes the
#: same files under the same names, so a run never interrupted is the same with or without them;
#: ``slow`` runs other steps and args, and ``--latest-pointer-first`` leaves a symlink beside the
#: checkpoints, which the comparison of the final checkpoints would see
DEFAULT = ["corrupt-checked", "corrupt-silent", "eio-write", "slow", "kill-save", "kill-save-inplace",
           "kill-save-pointer"]
OWN_REFERENCE = ("slow", "kill-save-pointer")
SLOW = ["corrupt-fallback", "eio-write-inplace", "fsync", "fsync-inplace", "eio-read", "eio-read-scratch",
        "slow-every-step"]


def storage_job(tmp: Path) -> Path:
    # a resumed run meets no fault: it goes at full speed (--resume-sleep 0; its 30-35 steps of
    # 0.05 s were ~1.6 s of each drill)
    return toy_job(tmp / "storage.trainguard.yaml", "toy-storage", "--sleep 0.05 --resume-sleep 0", DRILLS)


def _run(tmp: Path, only: list[str]) -> dict[str, CheckResult]:
    report = drill(str(storage_job(tmp)), only=only)
    return {c.name.removeprefix("drill:"): c for c in report.checks}


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, CheckResult]:
    return drills_sharing_a_reference(storage_job(tmp_path_factory.mktemp("storage")), DEFAULT,
                                      own_reference=OWN_REFERENCE)


@pytest.fixture(scope="module")
def more(tmp_path_factory: pytest.TempPathFactory) -> dict[str, CheckResult]:
    return _run(tmp_path_factory.mktemp("storage-more"), SLOW)


@needs_fuse
def test_a_checksummed_job_fails_loudly_on_a_flipped_byte(results: dict[str, CheckResult]) -> None:
    result = results["corrupt-checked"]
    assert result.status == "passed", result.summary
    struck = report_evidence(result)["struck"]
    assert struck["step"] >= 10 and struck["step"] % 5 == 0  # 15 or later: step 11 read late
    assert struck["byte_before"] != struck["byte_after"]
    assert "checksum mismatch" in report_evidence(result)["resume_error"]
    assert report_evidence(result)["fault_evidence"]["mechanism"].startswith("direct")


@needs_fuse
def test_a_job_that_trains_on_from_a_flipped_checkpoint_fails_with_the_file_named(
        results: dict[str, CheckResult]) -> None:
    result = results["corrupt-silent"]
    assert result.status == "failed", result.summary
    flipped = Path(report_evidence(result)["struck"]["file"]).name
    assert "loaded the struck checkpoint" in result.summary and flipped in result.summary
    # the rank whose file was struck resumed from it (the other rank, without a barrier, may have
    # lagged a checkpoint behind when the run was stopped: resumed_from_step is the earliest rank's)
    assert report_evidence(result)["struck_resumed_from_step"] == report_evidence(result)["struck"]["step"]
    assert report_evidence(result)["resumed_from_step"] <= report_evidence(result)["struck"]["step"]
    assert report_evidence(result)["likely_causes"][0].startswith("no integrity check on load")


@needs_fuse
def test_eio_on_write_fails_an_atomic_writer_loudly(
        results: dict[str, CheckResult]) -> None:
    clean = results["eio-write"]
    assert clean.status == "passed", clean.summary
    assert "EIO on rank" in clean.summary
    # resumed from a complete checkpoint from before the fault: step 5, or 10 when trainguard
    # read step 7 late on a loaded machine and the step-10 save was done when it struck
    resumed = report_evidence(clean)["resumed_from_step"]
    assert resumed >= 5 and resumed % 5 == 0 and resumed <= report_evidence(clean)["injected_after_step"]
    assert report_evidence(clean)["fault_evidence"]["mechanism"].startswith("fuse")
    assert report_evidence(clean)["fault_evidence"]["eio_calls"] >= 1


@needs_fuse
def test_slow_storage_reports_the_checkpoint_stall_and_the_rate_holds(results: dict[str, CheckResult]) -> None:
    result = results["slow"]
    assert result.status == "passed", result.summary
    slow = report_evidence(result)["fault_evidence"]["slow_storage"]
    assert slow["layer_delayed_calls"] >= 2 and slow["layer_added_s"] >= 0.3  # a save of each rank
    # the stall is measured from the times trainguard read the step lines, which a loaded machine
    # shifts by tens of ms (a 100 ms plant once measured 0.037 s): 300 ms leaves 200 ms of margin
    assert slow["checkpoint_stall_s"] >= 0.1  # one 300 ms write in the step that saves
    assert slow["layer_processes"] == 2 and 0 < slow["layer_share_of_time"] < 1


@needs_fuse
def test_a_kill_during_an_atomic_save_resumes_from_the_last_complete_checkpoint(
        results: dict[str, CheckResult]) -> None:
    result = results["kill-save"]
    assert result.status == "passed", result.summary
    save = report_evidence(result)["save"]
    # the first save after step 7 is held (step 10's; step 15's when step 7 was read late) and
    # the resume starts after the save before it
    held = int(save["held_write"]["path"].split("step")[1][:6])
    assert save["held_write"]["path"].startswith(f"/.rank0-step{held:06d}.json") and held % 5 == 0 and held >= 10
    assert save["latest_complete_at_kill"]["step"] == held - 5 == save["resumed_from_step"]
    assert "killed while writing" in result.summary


@needs_fuse
@pytest.mark.parametrize("name", ["kill-save-inplace", "kill-save-pointer"])
def test_a_kill_during_a_non_atomic_save_fails(results: dict[str, CheckResult], name: str) -> None:
    result = results[name]
    assert result.status == "failed", result.summary
    assert "did not recover" in result.summary
    held = report_evidence(result)["save"]["held_write"]["path"]
    assert held == "/rank0-step000010.json" if name.endswith("inplace") else held.startswith("/.rank0")


@needs_fuse
@pytest.mark.slow
def test_a_job_that_falls_back_to_an_older_checkpoint_recovers(more: dict[str, CheckResult]) -> None:
    result = more["corrupt-fallback"]
    assert result.status == "passed", result.summary
    # no rank trained on from the struck file (the recover judge sets struck_resumed_from_step
    # only when one did): the resume fell back to an older checkpoint
    assert "struck_resumed_from_step" not in report_evidence(result)
    assert report_evidence(result)["resumed_from_step"] <= report_evidence(result)["struck"]["step"] - 5


@needs_fuse
@pytest.mark.slow
def test_fsync_and_read_errors_and_a_torn_in_place_write(more: dict[str, CheckResult]) -> None:
    torn = more["eio-write-inplace"]
    assert torn.status == "failed", torn.summary
    assert report_evidence(torn)["checkpoint"]["intact"] is False
    assert more["fsync"].status == "passed", more["fsync"].summary
    assert more["fsync-inplace"].status == "failed"
    assert "completed (exit 0) despite the fault" in more["fsync-inplace"].summary
    # no fsync failed (the in-place writer makes none): the cause is what the layer saw it write
    assert report_evidence(more["fsync-inplace"])["likely_causes"][0].startswith(
        "the checkpoint is written in place and never fsynced")
    assert more["eio-read"].status == "passed", more["eio-read"].summary
    assert "Input/output error" in report_evidence(more["eio-read"])["resume_error"]
    scratch = more["eio-read-scratch"]
    assert scratch.status == "failed" and "started again from step 1" in scratch.summary
    every = more["slow-every-step"]
    assert every.status == "failed" and "step rate during the fault fell" in every.summary
