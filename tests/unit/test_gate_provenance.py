"""Report provenance and staleness against a real git repository in a temp dir."""

from __future__ import annotations

import json
import os
import subprocess
import time
from dataclasses import replace
from pathlib import Path

import pytest

from trainguard._internal.gitstate import file_sha256, git_state
from trainguard._internal.worktree import checkout, link_ignored, repository_root, resolve_commit
from trainguard._version import __version__
from trainguard.gate.provenance import Provenance, provenance_for, staleness


def _git(repo: Path, *args: str) -> str:
    proc = subprocess.run(
        ["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=30, check=True
    )
    return proc.stdout.strip()


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """A committed job: project/job/trainguard.yaml + train.py in a fresh repository."""
    root = tmp_path / "project"
    job = root / "job"
    job.mkdir(parents=True)
    _git(root, "init", "-q")
    _git(root, "config", "user.email", "t@example.invalid")
    _git(root, "config", "user.name", "t")
    (job / "trainguard.yaml").write_text("job:\n  name: toy\n  command: [python, train.py]\n")
    (job / "train.py").write_text("print('step 1 loss 1.0')\n")
    _git(root, "add", ".")
    _git(root, "commit", "-q", "-m", "init")
    return job / "trainguard.yaml"


def test_record_of_a_clean_committed_job(repo: Path) -> None:
    record = provenance_for(repo, now=1000.0)
    assert record.job_file == str(repo.resolve())
    assert record.job_file_sha256 == file_sha256(repo) and len(record.job_file_sha256) == 64
    assert record.git_commit == _git(repo.parent, "rev-parse", "HEAD")
    assert record.git_dirty is False and record.git_changes_sha256 is None
    assert record.trainguard_version == __version__ and record.created_at == 1000.0
    # round trip through the report's JSON
    again = Provenance.from_dict(json.loads(json.dumps(record.to_dict())))
    assert again == record
    assert staleness(again, repo, max_age=3600, now=1000.0 + 60) == []


def test_trainguard_state_dir_does_not_make_the_tree_dirty(repo: Path) -> None:
    state = repo.parent / ".trainguard"
    state.mkdir()
    (state / "gate-report.json").write_text("{}")  # the report itself lives here
    (state / "runs").mkdir()
    (state / "runs" / "log.txt").write_text("x")
    assert git_state(repo.parent).dirty is False


def test_changed_job_file_is_stale_and_says_which_field(repo: Path) -> None:
    record = provenance_for(repo)
    repo.write_text(repo.read_text() + "  world_size: 2\n")
    reasons = staleness(record, repo, max_age=None)
    assert any(r.startswith("job file changed:") for r in reasons)
    assert any(
        r.startswith("git dirty state changed: the working tree is dirty now") for r in reasons
    )
    assert not any("commit" in r for r in reasons)


def test_new_commit_is_stale(repo: Path) -> None:
    record = provenance_for(repo)
    (repo.parent / "train.py").write_text("print('step 1 loss 0.5')\n")
    _git(repo.parent.parent, "commit", "-q", "-am", "tweak")
    reasons = staleness(record, repo, max_age=None)
    assert len(reasons) == 1 and reasons[0].startswith("git commit changed")
    assert record.git_commit is not None and record.git_commit[:12] in reasons[0]


def test_dirty_report_is_fresh_only_while_the_same_changes_are_there(repo: Path) -> None:
    train = repo.parent / "train.py"
    train.write_text("print('uncommitted')\n")
    (repo.parent / "new_module.py").write_text("X = 1\n")  # untracked, not ignored
    record = provenance_for(repo)
    assert record.git_dirty is True and record.git_changes_sha256
    assert staleness(record, repo, max_age=None) == []  # the same uncommitted code
    (repo.parent / "new_module.py").write_text("X = 2\n")
    assert staleness(record, repo, max_age=None) == [
        "uncommitted changes differ: the working tree was dirty when the report was made and "
        "has other uncommitted changes now"
    ]
    _git(repo.parent.parent, "add", ".")
    _git(repo.parent.parent, "commit", "-q", "-m", "commit it")
    reasons = staleness(record, repo, max_age=None)
    assert any(r.startswith("git commit changed") for r in reasons)
    assert any("the working tree is clean now, it was dirty" in r for r in reasons)


def test_age_and_version(repo: Path) -> None:
    record = provenance_for(repo, now=time.time() - 3 * 3600)
    assert staleness(record, repo, max_age=4 * 3600) == []
    assert staleness(record, repo, max_age=2 * 3600) == [
        "the report is 3.0 h old, over gate.max_report_age (2.0 h)"
    ]
    older = replace(record, trainguard_version="0.0.1")
    assert staleness(older, repo, max_age=None) == [
        f"trainguard version changed: 0.0.1 made the report, {__version__} is installed"
    ]


def test_job_outside_git_and_broken_records(tmp_path: Path) -> None:
    job = tmp_path / "trainguard.yaml"
    job.write_text("job: {}\n")
    record = provenance_for(job)
    assert (record.git_commit, record.git_dirty) == (None, None)
    assert staleness(record.to_dict(), job, max_age=None) == []
    broken = record.to_dict()
    del broken["job_file_sha256"]
    assert staleness(broken, job, max_age=None) == [
        "the report's provenance is unusable (provenance record lacks job_file_sha256); "
        "run the gate again"
    ]
    broken = {**record.to_dict(), "git_dirty": "no"}
    assert "provenance.git_dirty has the wrong type" in staleness(broken, job, max_age=None)[0]


def _marker_script(path: Path, marker: Path, *, prints: str = "") -> str:
    """An executable that records that it ran (a file under ``marker``) and prints ``prints``."""
    path.write_text(f"#!/bin/sh\ntouch '{marker}'\nprintf '{prints}'\ncat >/dev/null 2>&1 || true\n")
    path.chmod(0o755)
    return str(path)


def test_a_dirty_fingerprint_comes_from_the_files_whatever_diff_external_prints(repo: Path, tmp_path: Path) -> None:
    """With ``diff.external`` set to a program that prints nothing, ``git diff`` is empty for any
    edit: a fingerprint made from it is the same for every edit, and a dirty promoted report never
    went stale. Made from the files' bytes, two edits differ."""
    root = repo.parent.parent
    _git(root, "config", "diff.external", _marker_script(tmp_path / "ext", tmp_path / "ran"))
    train = repo.parent / "train.py"
    train.write_text("print('edit one')\n")
    record = provenance_for(repo)
    assert record.git_dirty is True
    train.write_text("print('edit two')\n")
    assert staleness(record, repo, max_age=None) == [
        "uncommitted changes differ: the working tree was dirty when the report was made and "
        "has other uncommitted changes now"
    ]
    train.write_text("print('edit one')\n")  # the same edit again: fresh
    assert staleness(record, repo, max_age=None) == []
    assert not (tmp_path / "ran").exists()


def test_no_program_of_the_repositorys_or_the_users_git_configuration_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The repository names an fsmonitor, a post-checkout hook, an external diff, a textconv and a
    filter (smudge on checkout, clean on status), the user's configuration an fsmonitor too: each
    a script that leaves a marker. compat's checkout of an older commit (and the linking of
    ignored files), the dirty fingerprint and the gate's provenance and staleness run none."""
    root = tmp_path / "project"
    root.mkdir()
    (root / ".gitattributes").write_text("*.py filter=evil diff=evil\n")
    (root / ".gitignore").write_text("data/\n")
    (root / "train.py").write_text("print('old')\n")
    _git(root, "init", "-q")
    _git(root, "add", ".")
    _git(root, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "old")
    (root / "train.py").write_text("print('new')\n")
    _git(root, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-am", "new")
    (root / "data").mkdir()
    job = root / "trainguard.yaml"
    job.write_text("job: {}\n")
    markers = tmp_path / "markers"
    markers.mkdir()
    scripts = tmp_path / "scripts"
    (scripts / "hooks").mkdir(parents=True)
    for key, name in (("core.fsmonitor", "fsmonitor"), ("diff.external", "external-diff"),
                      ("diff.evil.textconv", "textconv"), ("filter.evil.clean", "clean"),
                      ("filter.evil.smudge", "smudge")):
        _git(root, "config", key, _marker_script(scripts / name, markers / name))
    _git(root, "config", "filter.evil.required", "true")
    _git(root, "config", "core.hooksPath", str(scripts / "hooks"))
    for hook in ("post-checkout", "reference-transaction", "post-index-change"):
        _marker_script(scripts / "hooks" / hook, markers / hook)
        _marker_script(root / ".git" / "hooks" / hook, markers / f"default-{hook}")
    user = tmp_path / "user.gitconfig"
    user.write_text(f"[core]\n\tfsmonitor = {_marker_script(scripts / 'user-fsmonitor', markers / 'user-fsmonitor')}\n")
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", str(user))
    monkeypatch.setenv("GIT_EXTERNAL_DIFF", _marker_script(scripts / "env-diff", markers / "env-diff"))
    (root / "train.py").write_text("print('uncommitted')\n")  # dirty: status, diff and clean have work

    assert repository_root(root) == root
    old = resolve_commit(root, "HEAD~1")
    with checkout(root, old, root / ".trainguard" / "compat") as tree:
        checked_out = (tree / "train.py").read_text()
        linked = link_ignored(root, tree, skip=lambda name: False)
    state = git_state(root)
    record = provenance_for(job)
    fresh = staleness(record, job, max_age=None)
    _git(root, "config", "--unset", "core.fsmonitor")  # the user's fsmonitor is the one git would take
    git_state(root)
    ran = sorted(p.name for p in markers.iterdir())
    assert ran == [], f"ran: {ran}"
    assert checked_out == "print('old')\n" and linked == ["data"]  # checked out as committed, not smudged
    assert state.dirty is True and state.changes_sha256 and fresh == []


def test_a_dirty_fingerprint_follows_a_submodules_commit_and_a_fifo_does_not_block_it(repo: Path, tmp_path: Path) -> None:
    """A submodule moved to another commit is another change (the fingerprint made from the
    files' bytes must not lose what ``git diff`` said of it); a tracked file replaced by a FIFO is
    named by its kind, never opened (an open would block)."""
    lib = tmp_path / "lib"
    lib.mkdir()
    _git(lib, "init", "-q")
    for text in ("one", "two"):
        (lib / "x.py").write_text(text)
        _git(lib, "add", ".")
        _git(lib, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", text)
    root = repo.parent.parent
    _git(root, "-c", "protocol.file.allow=always", "submodule", "add", "-q", str(lib), "lib")
    (repo.parent / "train.py").unlink()
    os.mkfifo(repo.parent / "train.py")
    record = provenance_for(repo)
    assert record.git_dirty is True and staleness(record, repo, max_age=None) == []
    _git(root / "lib", "checkout", "-q", "HEAD~1")
    assert staleness(record, repo, max_age=None)[0].startswith("uncommitted changes differ")


def test_the_files_the_user_ignores_stay_ignored(repo: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The user's configuration is not read, except their ignore list (``core.excludesFile``):
    an editor's swap file it names does not make the tree dirty."""
    (tmp_path / "ignore").write_text("*.swp\n")
    user = tmp_path / "user.gitconfig"
    user.write_text(f"[core]\n\texcludesFile = {tmp_path / 'ignore'}\n")
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", str(user))
    (repo.parent / ".train.py.swp").write_text("x")
    assert git_state(repo.parent).dirty is False
    (repo.parent / "notes.txt").write_text("x")
    assert git_state(repo.parent).dirty is True


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="chown to another user needs root")
def test_a_checkout_another_user_owns_stays_readable_through_the_users_safe_directory(
    repo: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A CI container's checkout owned by another user: git refuses it unless the user's
    configuration lists it in ``safe.directory``, which trainguard keeps."""
    head = _git(repo.parent.parent, "rev-parse", "HEAD")
    for path in [repo.parent.parent, *repo.parent.parent.rglob("*")]:
        os.lchown(path, 4321, 4321)
    user = tmp_path / "user.gitconfig"
    user.write_text(f"[safe]\n\tdirectory = {repo.parent.parent}\n")
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", str(user))
    assert git_state(repo.parent).commit == head
    user.write_text("")
    monkeypatch.setenv("HOME", str(tmp_path))  # another set of user files: read again
    assert git_state(repo.parent).commit is None
