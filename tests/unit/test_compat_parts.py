"""The parts of checks.compat that launch nothing: the checkout of an older commit (removed
however the block ends, a dead process's leftover removed the next time), the ignored files
linked into it, the checkpoint layout comparison, the last promoted commit read from gate
reports as data, and the job-file problems (an unknown ref, no repository)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from tests.helpers import report_evidence
from trainguard._internal.gitcmd import GitError
from trainguard._internal.promoted import INDEX_NAME, last_promoted, record_promotion
from trainguard._internal.worktree import (
    checkout,
    link_ignored,
    repository_root,
    resolve_commit,
)
from trainguard.checks.compat import CompatCheck
from trainguard.config import load_config
from trainguard.errors import ConfigError
from trainguard.report import CheckResult
from trainguard.unit.checkpoints.compare import compare_layouts


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *args],
                          check=True, capture_output=True, text=True, timeout=60).stdout.strip()


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    root.mkdir()
    (root / "train.py").write_text("print('old')\n")
    (root / ".gitignore").write_text("data/\n*.log\n")
    _git(root, "init", "-q")
    _git(root, "add", "-A")
    _git(root, "commit", "-q", "-m", "old")
    _git(root, "tag", "v1")
    (root / "train.py").write_text("print('new')\n")
    _git(root, "commit", "-q", "-am", "new")
    (root / "data").mkdir()
    (root / "data" / "train.bin").write_bytes(b"\x00" * 16)
    (root / "run.log").write_text("ignored too\n")
    return root


def test_a_checkout_holds_the_old_commit_and_is_removed_whatever_ends_the_block(repo: Path, tmp_path: Path) -> None:
    commit = resolve_commit(repo, "v1")
    assert commit == _git(repo, "rev-parse", "HEAD~1") and resolve_commit(repo, "HEAD~1") == commit
    parent = tmp_path / "state" / "compat"
    with pytest.raises(KeyboardInterrupt), checkout(repo, commit, parent) as tree:
        assert (tree / "train.py").read_text() == "print('old')\n"
        assert (repo / "train.py").read_text() == "print('new')\n"  # the working tree untouched
        raise KeyboardInterrupt
    assert not list(parent.iterdir())
    assert "checkout-" not in _git(repo, "worktree", "list")
    assert _git(repo, "status", "--porcelain") == ""


def test_a_checkout_a_killed_process_left_is_removed_the_next_time(repo: Path, tmp_path: Path) -> None:
    parent = tmp_path / "compat"
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = parent / f"checkout-{dead.pid}-abcdef012345"
    _git(repo, "worktree", "add", "--detach", str(stale), "v1")
    alive = parent / f"checkout-{os.getppid()}-abcdef012345"  # a live process's: left alone
    alive.mkdir()
    with checkout(repo, resolve_commit(repo, "v1"), parent) as tree:
        assert tree.is_dir() and not stale.exists() and alive.exists()
    assert str(stale) not in _git(repo, "worktree", "list")


def test_unknown_refs_and_folders_outside_a_repository_are_said(repo: Path, tmp_path: Path) -> None:
    for ref in ("v9", "--output=/tmp/x", ""):
        with pytest.raises(GitError, match=r"names no commit|is not a git ref"):
            resolve_commit(repo, ref)
    outside = tmp_path / "plain"
    outside.mkdir()
    assert repository_root(outside) is None and repository_root(repo / "data") == repo


def test_ignored_files_are_linked_into_the_checkout_and_nothing_outside_it_is_touched(repo: Path, tmp_path: Path) -> None:
    (repo / "extra.txt").write_text("untracked, not ignored\n")
    with checkout(repo, resolve_commit(repo, "v1"), tmp_path / "c") as tree:
        linked = link_ignored(repo, tree, skip=lambda name: name.endswith(".log"),
                              extra=["extra.txt", "../escape", "missing.txt"])
        assert sorted(linked) == ["data", "extra.txt"]
        assert (tree / "data" / "train.bin").read_bytes() == b"\x00" * 16
        assert not (tree / "run.log").exists() and not (tree.parent / "escape").exists()
    assert (repo / "data" / "train.bin").exists()  # the link removed, not what it pointed at


def _save(path: Path, model: dict[str, torch.Tensor], history: int) -> None:
    path.mkdir(parents=True)
    torch.save({"model": model, "optimizer": {"state": {0: {"exp_avg": torch.zeros(3)}}},
                "log_history": [{"loss": 1.0, "step": i} for i in range(history)], "step": history},
               path / "ckpt_000005.pt")


def test_the_layout_names_renames_added_buffers_and_shape_changes_not_a_longer_history(tmp_path: Path) -> None:
    old = {"body.0.weight": torch.zeros(4, 3), "head.weight": torch.zeros(2, 4), "head.bias": torch.zeros(2)}
    _save(tmp_path / "old", old, 5)
    _save(tmp_path / "same", {k: v + 1 for k, v in old.items()}, 20)
    same = compare_layouts(tmp_path / "old", tmp_path / "same")
    assert same.compared and same.same and same.summary() == ""
    _save(tmp_path / "new", {"body.0.weight": torch.zeros(4, 5), "classifier.weight": torch.zeros(2, 4),
                             "classifier.bias": torch.zeros(2), "scale": torch.ones(3)}, 20)
    diff = compare_layouts(tmp_path / "old", tmp_path / "new")
    assert diff.renamed == [("model.head", "model.classifier")]
    assert diff.only_in_new == ["model.classifier.bias", "model.classifier.weight", "model.scale"]
    assert diff.changed == [("model.body.0.weight", "[4, 3] float32", "[4, 5] float32")]
    assert diff.summary() == ("renamed model.head -> model.classifier; only in current's: model.scale; "
                              "model.body.0.weight changed from [4, 3] float32 to [4, 5] float32")
    assert not compare_layouts(tmp_path / "old", tmp_path / "nothing").compared


def _report(gate: Path, stamp: str, verdict: str, commit: str | None) -> None:
    gate.mkdir(parents=True, exist_ok=True)
    (gate / f"gate-{stamp}.json").write_text(json.dumps(
        {"decision": {"verdict": verdict}, "provenance": {"git_commit": commit}}))


def test_the_last_promoted_commit_is_the_newest_promoted_report_read_as_data(tmp_path: Path) -> None:
    """Without an index, every gate report is scanned newest first (and the lookup says so);
    an index that is not one is said and scanned past, never trusted."""
    gate = tmp_path / "gate"
    assert last_promoted(gate).promotion is None
    _report(gate, "20261101-120000", "promote", "a" * 40)
    _report(gate, "20261102-120000", "promote", "b" * 64)  # a SHA-256 repository's commit
    _report(gate, "20261103-120000", "block", "c" * 40)  # newer, but blocked
    _report(gate, "20261104-120000", "promote", "$(rm -rf /)")  # not a commit id
    _report(gate, "20261104-130000", "promote", "d" * 50)  # neither SHA-1 nor SHA-256
    (gate / "gate-20261105-120000.json").write_text("{not json")
    (gate / "gate-20261106-120000.json").write_bytes(b"[" * 100_000)  # nested past the parser
    (gate / "latest.json").write_text(json.dumps({"decision": {"verdict": "promote"},
                                                  "provenance": {"git_commit": "e" * 40}}))  # not a gate-*.json
    found = last_promoted(gate)
    assert found.promotion is not None and found.promotion.commit == "b" * 64
    assert found.promotion.report.name == "gate-20261102-120000.json"
    assert "scanning 6 gate report(s)" in found.how and "no promoted-report index" in found.how
    for index, why in (('{"index_version": 1, "newest": {"git_commit": "$(id)", "report": "gate-20261101-120000.json", '
                        '"created_at": 1}}', "git_commit is not a commit id"),
                       ('{"index_version": 1, "newest": {"git_commit": "' + "f" * 40 + '", "report": "../../etc/passwd", '
                        '"created_at": 1}}', "report is not a gate report's name"),
                       ('{"index_version": 1, "newest": {"git_commit": "' + "f" * 40 + '", "report": '
                        '"gate-20261101-120000.json", "created_at": 1e999}}', "created_at is not a time"),
                       ("[" * 50_000, "nests too deep"), ("{}" + " " * 70_000, "over 64 KiB")):
        (gate / INDEX_NAME).write_text(index)
        found = last_promoted(gate)
        assert found.promotion is not None and found.promotion.commit == "b" * 64, index[:80]
        assert why in found.how and "is unusable" in found.how, found.how


def test_the_index_keeps_the_newest_promotion_and_only_a_gate_report_with_a_commit(tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    gate.mkdir()
    record_promotion(gate, gate / "gate-20261102-120000.json", "b" * 40, created_at=2000.0)
    record_promotion(gate, gate / "gate-20261101-120000.json", "a" * 40, created_at=1000.0)  # older: kept out
    record_promotion(gate, gate / "gate-20261103-120000.json", None, created_at=3000.0)  # outside git
    record_promotion(gate, tmp_path / "gate-20261104-120000.json", "c" * 40, created_at=4000.0)  # a fallback place
    found = last_promoted(gate)
    assert found.promotion is not None and found.promotion.commit == "b" * 40 and "index" in found.how
    assert not list(gate.glob(".promoted.json.*"))  # no temp file left
    record_promotion(gate, gate / "gate-20261105-120000.json", "d" * 64, created_at=5000.0)
    assert json.loads((gate / INDEX_NAME).read_text())["newest"]["git_commit"] == "d" * 64


def _promote(job: Path) -> Path:
    """A promoted gate report of the job as it is now, written by the gate's own writer."""
    from trainguard.config import GatePolicy
    from trainguard.gate.policy import Capabilities, Decision
    from trainguard.gate.provenance import provenance_for
    from trainguard.gate.run import GateReport, write_gate_report
    from trainguard.report import Report

    gate = GateReport(job="j", job_file=str(job), decision=Decision("promote"), report=Report(job="j"),
                      provenance=provenance_for(job), capabilities=Capabilities(gpus=0, root=False, ray=False),
                      policy=GatePolicy.model_validate({}))
    return Path(write_gate_report(gate, job.parent / ".trainguard" / "gate")["json_stamped"])


def _job(tmp_path: Path, compat: str) -> Path:
    path = tmp_path / "trainguard.yaml"
    path.write_text(f"""\
job:
  name: j
  command: "python train.py --steps {{steps}} --ckpt {{checkpoint_dir}}"
  resume_args: "--resume"
  metrics: {{loss: 'step (?P<step>\\d+) loss (?P<value>\\S+)'}}
checks:
  compat: {compat}
""")
    return path


def test_the_job_file_names_an_unknown_ref_a_missing_repository_and_bad_links(repo: Path, tmp_path: Path) -> None:
    spec = load_config(_job(repo, "{base: v1}")).checks.compat
    assert isinstance(spec, CompatCheck) and spec.after_step == 10 and spec.steps == 20
    with pytest.raises(ConfigError) as unknown:
        load_config(_job(repo, "{base: v9}"))
    assert "checks.compat.base" in str(unknown.value) and "'v9' names no commit" in str(unknown.value)
    plain = tmp_path / "plain"
    plain.mkdir()
    with pytest.raises(ConfigError, match="not in a git repository"):
        load_config(_job(plain, "{base: main}"))
    for bad, words in (("{base: v1, link: [../x]}", "must be a path inside the repository"),
                       ("{base: v1, steps: 5, after_step: 5}", "must be smaller than steps")):
        with pytest.raises(ConfigError, match=words):
            load_config(_job(repo, bad))
    promoted = load_config(_job(repo, "{base: promoted}")).checks.compat
    assert isinstance(promoted, CompatCheck) and promoted.base == "promoted"


def _check_compat(job: Path) -> CheckResult:
    from trainguard.session import check

    report = check(job, only=["compat"], report_json=str(job.parent / ".trainguard" / "r.json"))
    (result,) = report.checks
    assert json.loads((job.parent / ".trainguard" / "r.json").read_text())["checks"][0]["status"] == result.status
    return result


def test_base_promoted_before_any_promotion_is_skipped_not_passed(repo: Path) -> None:
    """Nothing was compared: skipped, saying why and what to do (before issue 42: passed)."""
    result = _check_compat(_job(repo, "{base: promoted}"))
    assert result.status == "skipped", result.summary
    assert result.summary.startswith("nothing compared: no promoted gate report with a git commit under"), result.summary
    assert "leave compat out of gate.require" in result.summary
    assert not report_evidence(result).get("run_dirs")


def _committed_job(repo: Path) -> Path:
    job = _job(repo, "{base: promoted}")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "job")
    return job


def test_base_promoted_finds_the_promotion_behind_201_newer_reports(repo: Path) -> None:
    """The promoted report is found through the index the gate writes, however many reports came
    after it; without the index, by a scan of all of them that says so. The job is the promoted
    commit unchanged: nothing to launch."""
    job = _committed_job(repo)
    promoted = _promote(job)
    gate = promoted.parent
    for i in range(201):
        _report(gate, f"2099{i // 60 + 1:02d}01-{i % 60:02d}0000", "block", "c" * 40)
    head = _git(repo, "rev-parse", "HEAD")
    result = _check_compat(job)
    assert result.status == "passed" and report_evidence(result)["base_commit"] == head, result.summary
    assert "unchanged" in result.summary and "promoted-report index" in report_evidence(result)["promoted"]
    (gate / INDEX_NAME).unlink()
    result = _check_compat(job)
    assert result.status == "passed" and report_evidence(result)["base_commit"] == head, result.summary
    assert "scanning 202 gate report(s)" in report_evidence(result)["promoted"], report_evidence(result)["promoted"]
    assert "no promoted-report index" in report_evidence(result)["promoted"]


def test_base_promoted_in_a_sha256_repository(tmp_path: Path) -> None:
    """A SHA-256 repository's 64-digit commit is promoted, found, resolved and checked out."""
    root = tmp_path / "sha256"
    root.mkdir()
    (root / "train.py").write_text("print('old')\n")
    _git(root, "init", "-q", "--object-format=sha256")
    _git(root, "add", "-A")
    _git(root, "commit", "-q", "-m", "old")
    job = _committed_job(root)
    head = _git(root, "rev-parse", "HEAD")
    assert len(head) == 64
    _promote(job)
    result = _check_compat(job)
    assert result.status == "passed" and report_evidence(result)["base_commit"] == head, result.summary
    assert resolve_commit(root, "HEAD~1") == _git(root, "rev-parse", "HEAD~1")
    with checkout(root, resolve_commit(root, "HEAD~1"), tmp_path / "c") as tree:
        assert (tree / "train.py").read_text() == "print('old')\n" and not (tree / "trainguard.yaml").exists()


TOY = "import sys\nfor i in range(1, int(sys.argv[sys.argv.index('--steps') + 1]) + 1):\n    print(f'step {i} loss {1 / i}')\n"


def test_a_shallow_clone_without_the_promoted_commit_says_which_commit_to_fetch(repo: Path, tmp_path: Path) -> None:
    """The promoted commit is not in the clone: an error naming it and how to fetch it, before
    anything is launched, in the written report (before issue 42: a GitError traceback)."""
    (repo / "train.py").write_text(TOY)
    job = _committed_job(repo)
    promoted = _git(repo, "rev-parse", "HEAD")
    (repo / "train.py").write_text(TOY + "# newer\n")
    _git(repo, "commit", "-q", "-am", "newer")
    clone = tmp_path / "clone"
    _git(tmp_path, "clone", "-q", "--depth", "1", f"file://{repo}", str(clone))
    _report(clone / ".trainguard" / "gate", "20261101-120000", "promote", promoted)
    result = _check_compat(clone / job.name)
    assert result.status == "error", result.summary
    assert f"commit {promoted} is not in this shallow clone" in result.summary, result.summary
    assert f"`git fetch origin {promoted}`" in result.summary and "`git fetch --unshallow`" in result.summary
    assert not report_evidence(result).get("run_dirs")


def test_a_base_without_the_jobs_directory_is_an_error_naming_it(repo: Path) -> None:
    """base comes from before the job's folder existed: an error saying so and how to find a base
    that has it, the report written (before issue 42: the session aborted)."""
    job_dir = repo / "jobs" / "toy"
    job_dir.mkdir(parents=True)
    (job_dir / "train.py").write_text(TOY)
    job = _job(job_dir, "{base: v1}")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "the job")
    result = _check_compat(job)
    assert result.status == "error", result.summary
    assert "has no folder jobs/toy/, the job's directory" in result.summary, result.summary
    assert "git log --diff-filter=A --format=%h -- jobs/toy" in result.summary


def test_a_nul_byte_in_base_is_a_config_error(repo: Path) -> None:
    with pytest.raises(ConfigError) as bad:
        load_config(_job(repo, '{base: "v1\\0x"}'))
    assert "checks.compat.base" in str(bad.value) and "control character" in str(bad.value)
