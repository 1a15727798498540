"""``--trainguard-save-baseline``: canary items collected from trainguard.yaml save a baseline,
and later canary items compare with it -- in a real pytest subprocess, on the toy job."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainguard._internal.machine import machine_id

pytestmark = pytest.mark.timeout(120)

TOY = Path(__file__).resolve().parents[1] / "data" / "jobs" / "toy_train.py"

JOB = """\
job:
  name: toy-baseline
  command: "python toy.py --steps {steps} --seed {seed}"
  metrics:
    loss: 'step (?P<step>\\d+) loss (?P<value>\\S+)'
  timeout: 60
  stall_timeout: 20
checks:
  canary: {steps: 40, min_loss_drop: 0.3}
"""

INI = "[pytest]\naddopts = -p no:hypothesispytest\n"


def _write_toy(directory: Path, decay: str) -> None:
    text = TOY.read_text()
    assert text.count("math.exp(-0.05 * step)") == 1, "the toy's loss curve changed; update this test"
    (directory / "toy.py").write_text(text.replace("math.exp(-0.05 * step)", f"math.exp(-{decay} * step)"))


def test_canary_items_save_a_baseline_then_compare_with_it(pytester: pytest.Pytester) -> None:
    pytester.makeini(INI)
    (pytester.path / "trainguard.yaml").write_text(JOB)
    _write_toy(pytester.path, "0.05")

    saved = pytester.runpytest_subprocess("-m", "canary", "--trainguard-save-baseline", "1")
    saved.assert_outcomes(passed=1)
    (path,) = (pytester.path / ".trainguard" / "baselines" / machine_id()).glob("*.json")
    assert path.name == "0001_nogit.json"

    pytester.runpytest_subprocess("-m", "canary").assert_outcomes(passed=1)

    _write_toy(pytester.path, "0.03")  # learns, more slowly
    slower = pytester.runpytest_subprocess("-m", "canary")
    slower.assert_outcomes(failed=1)
    slower.stdout.fnmatch_lines(["*loss left the baseline band at steps *% above the baseline at step *"])
