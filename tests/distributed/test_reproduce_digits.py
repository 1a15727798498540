"""The reproduce line of a check on the shipped digits example runs, as printed, through bash."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from trainguard.config import load_config
from trainguard.config.settings import Settings
from trainguard.run.request import RunRequest
from trainguard.run.runner import JobRunner

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "digits"


@pytest.mark.smoke
def test_a_printed_reproduce_line_of_the_digits_example_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the fresh directory it names
    runner = JobRunner(load_config(EXAMPLE / "trainguard.yaml"), Settings())
    line = runner.command_line(RunRequest.make(steps=3, seed=0, world_size=1))
    assert "<run_dir>" not in line and str(tmp_path / "trainguard-repro-digits-mlp") in line
    # as a person runs it: from anywhere, with the project's python first on PATH
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    done = subprocess.run(["bash", "-c", line], capture_output=True, text=True, timeout=240,
                          cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "step 3 loss " in done.stdout
    assert list((tmp_path / "trainguard-repro-digits-mlp" / "checkpoints").iterdir())
