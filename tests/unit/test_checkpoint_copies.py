"""What trainguard takes as a job's checkpoint and how it copies a checkpoint directory: a save
in progress (a temporary name not yet renamed into place) is never the checkpoint, and a FIFO,
a socket or a device in the directory is left out of a copy with the reason, never opened.
"""

from __future__ import annotations

import os
import shutil
import socket
import sys
from pathlib import Path

import pytest

from tests.helpers import check_context, report_evidence
from trainguard._internal.readers import copy_tree
from trainguard.checks.smoke import SmokeEvidence, _checkpoint_files, _load_stage, run_smoke
from trainguard.config import load_config
from trainguard.config.settings import Settings
from trainguard.run.runner import JobRunner
from trainguard.unit.checkpoints import find_checkpoints

JOBS = Path(__file__).resolve().parents[1] / "data" / "jobs"

#: names of a save of step 5 in progress beside the complete checkpoint of step 4
SAVES_IN_PROGRESS = ["state-000005.json.tmp", "state-000005.json.tmp.8213", ".state-000005.json.tmp",
                     "tmp-state-000005.json", "tmpx3k1/state-000005.json"]


@pytest.mark.parametrize("temp", SAVES_IN_PROGRESS)
def test_smoke_reads_the_step_of_the_complete_checkpoint_not_of_a_save_in_progress(tmp_path: Path, temp: str) -> None:
    """A kept copy taken between a save's write and its rename holds the temporary of step 5
    beside the checkpoint of step 4: smoke read step 5 from it, and the resume that rightly
    started at step 5 failed for not starting at step 6 (2 of 7 gate runs of that save pattern)."""
    directory = tmp_path / "checkpoints"
    directory.mkdir()
    (directory / "state-000004.json").write_text('{"step": 4}')
    partial = directory / temp
    partial.parent.mkdir(parents=True, exist_ok=True)
    partial.write_text('{"st')  # newer than the complete one
    os.utime(directory / "state-000004.json", (1, 1))
    assert _checkpoint_files(directory) == [directory / "state-000004.json"]
    stages: dict = {}
    evidence = SmokeEvidence(steps=5, outcome="ok", exits=[], stages=stages, metric_steps_seen=5,
                             checkpoint_files=[], run_dir="r")
    assert _load_stage(_checkpoint_files(directory), directory, stages, evidence) == (4, None)


def test_find_checkpoints_takes_no_temporary_name(tmp_path: Path) -> None:
    for name in ("model-4.pt", "tmp_model-5.pt", ".model-5.pt", "model-5.pt.tmp"):
        (tmp_path / name).write_bytes(b"x")
    assert find_checkpoints(tmp_path) == [tmp_path / "model-4.pt"]


def test_copy_tree_leaves_out_fifos_and_sockets_and_keeps_links_as_links(tmp_path: Path) -> None:
    source = tmp_path / "source"
    (source / "sub").mkdir(parents=True)
    (source / "a.json").write_text("{}")
    (source / "sub" / "b.pt").write_bytes(b"b")
    os.symlink("a.json", source / "latest")
    os.mkfifo(source / "sub" / "pipe")
    server = socket.socket(socket.AF_UNIX)
    try:
        server.bind(str(source / "sock"))
        left_out = copy_tree(source, tmp_path / "copy")
    finally:
        server.close()
    assert left_out == {"sub/pipe": "a FIFO, not copied", "sock": "a socket, not copied"}
    copy = tmp_path / "copy"
    assert sorted(str(p.relative_to(copy)) for p in copy.rglob("*")) == ["a.json", "latest", "sub", "sub/b.pt"]
    assert os.readlink(copy / "latest") == "a.json"


#: the toy job with a FIFO made in its checkpoint directory first (as a job's log pipe would be)
FIFO_FIRST = """\
import os, sys
ckpt = sys.argv[sys.argv.index("--ckpt-dir") + 1]
os.makedirs(ckpt, exist_ok=True)
try:
    os.mkfifo(os.path.join(ckpt, "events.pipe"))
except FileExistsError:
    pass
os.execv(sys.executable, [sys.executable, os.path.join(os.path.dirname(__file__), "toy_train.py"), *sys.argv[1:]])
"""


def test_a_fifo_in_the_checkpoint_directory_is_left_out_of_smokes_copy(tmp_path: Path) -> None:
    """A FIFO in the checkpoint directory aborted the session: the copy the resume stage starts
    from raised. It is left out, said in the evidence, and the resume goes on."""
    jobs = Path(shutil.copytree(JOBS, tmp_path / "jobs"))
    (jobs / "fifo_first.py").write_text(FIFO_FIRST)
    path = jobs / "toy.trainguard.yaml"
    path.write_text(path.read_text().replace("python toy_train.py", f"{sys.executable} fifo_first.py"))
    job_file = load_config(path)
    assert job_file.checks.smoke is not None
    result = run_smoke(check_context(JobRunner(job_file, Settings()), "smoke", job_file.checks.smoke))
    assert result.status == "passed", result.summary
    assert report_evidence(result)["resume_from"]["left_out"] == {"events.pipe": "a FIFO, not copied"}
    assert report_evidence(result)["resume"]["first_step"] == 6


def test_a_kept_checkpoint_asked_for_while_another_launch_carries_it_waits_for_that_launch(tmp_path: Path) -> None:
    # two uninterrupted runs of one request start side by side (the reference, determinism's
    # second run); the keeper rides on the first to attach. When the other ends first and a check
    # asks for the checkpoint, the answer waits for the carrying launch: on a loaded machine it
    # had not ended yet, and smoke launched a resume of its own (4 launches, not 3)
    import threading
    import time

    from trainguard.run.keep import Keepers
    from trainguard.run.request import RunRequest

    keepers = Keepers()
    request = RunRequest.make(steps=16, seed=0, world_size=1, timeout=30)
    keepers.register(request, 6, "loss")
    _keep, ended = keepers.attach(request, label="determinism-repeat", run_dir=tmp_path,
                                  checkpoint_dir=tmp_path / "ckpt")
    answers: list[tuple[object, str]] = []
    asker = threading.Thread(target=lambda: answers.append(keepers.kept(request, 6)))
    asker.start()
    time.sleep(0.3)
    assert answers == []  # still waiting: the carrying launch has not ended
    ended(None)  # it ended without a copy: now the answer says why
    asker.join(10)
    assert answers and answers[0][0] is None and "ended before trainguard read step 6" in answers[0][1]


UNTERMINATED_JOB = '''\
import os, sys, time
ckpt = sys.argv[1]
os.makedirs(ckpt, exist_ok=True)
for step in (5, 10):
    with open(os.path.join(ckpt, f"state-{step:06d}.json"), "w") as f:
        f.write('{"step": %d}' % step)
# a logger flushed at exit, as print writes it unbuffered: the text, then (late) its line end
sys.stdout.write("".join(f"step {i} loss {1 / i}\\n" for i in range(1, 10)) + "step 10 loss 0.1")
sys.stdout.flush()
time.sleep(1.5)
sys.stdout.write("\\n")
'''


def test_a_last_step_printed_without_its_line_end_when_the_run_was_stopped_is_not_kept(tmp_path: Path) -> None:
    """print() of an unbuffered stream writes its text and then its end: a run stopped between
    the two (to copy its checkpoints after step 6, read from the same burst) had printed its last
    step already. The copy is its final state, not a mid-run one: not kept, said why (the gate's
    kill-too-late test kept it, then resumed from step 10 and saw no line, on a loaded machine)."""
    from trainguard.run.request import RunRequest

    (tmp_path / "job.py").write_text(UNTERMINATED_JOB)
    (tmp_path / "job.yaml").write_text(
        "job:\n  name: burst\n  command: \"python job.py {checkpoint_dir}\"\n"
        "  metrics:\n    loss: 'step (?P<step>\\d+) loss (?P<value>\\S+)'\n  timeout: 30\n")
    runner = JobRunner(load_config(tmp_path / "job.yaml"))
    try:
        request = RunRequest.make(steps=10, seed=0, world_size=1, timeout=30)
        runner.pool.keep(request, 6, "loss")
        result = runner.run(request, label="reference")
        assert result.ok, result.reason
        kept, why = runner.pool.kept(request, 6)
    finally:
        runner.close()
    assert kept is None and "had printed its last step (10 of 10)" in why, why
