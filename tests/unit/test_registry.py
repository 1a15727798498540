"""One registry type for every extension (trainguard/_internal/registry.py; docs/architecture.md,
"Adding things"): a fault written in a temp module and registered with one call is accepted by
the job file, the ``fault`` marker and ``trainguard validate``, with no other edit, and is gone
again once unregistered; the names the schema, the markers and the docs list are the registries'."""

from __future__ import annotations

import re
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from trainguard.plugins.markers import MARKERS, validate_marker

from tests.helpers import TOY
from trainguard._internal.registry import NotInstalled, Registry
from trainguard.cli.main import main
from trainguard.config import load_config
from trainguard.config.backends import BACKENDS
from trainguard.config.fault_params import FaultParams
from trainguard.config.faults import (
    EXPECTATIONS,
    FAULTS,
    Expectation,
    FaultNotInstalled,
    fault_class,
)
from trainguard.config.queues import QUEUES
from trainguard.config.registry import CHECKS
from trainguard.errors import ConfigError, UsageError

ROOT = Path(__file__).resolve().parents[2]

#: the whole of the blink fault: a rank's output paused for a moment (it injects nothing real:
#: the test plans and validates it, never runs it)
BLINK_MODULE = '''
from trainguard.faults.base import Fault


class BlinkFault(Fault):
    """blink: the rank's output paused for ``params.ms`` milliseconds."""

    kind = "blink"

    @classmethod
    def validate(cls, params):
        ms = params.raw("ms", 10)
        if isinstance(ms, bool) or not isinstance(ms, int) or ms < 1:
            return [("ms", f"expected a whole number of milliseconds >= 1, got {ms!r}")]
        return []

    def inject(self, launcher):
        self.injected_at = 0.0

    def clear(self):
        pass
'''


@pytest.fixture
def blink(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The blink module on the path and its one registration call, taken out afterwards."""
    (tmp_path / "tg_blink_fault.py").write_text(BLINK_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    FAULTS.register("blink", "tg_blink_fault:BlinkFault")
    try:
        yield "blink"
    finally:
        FAULTS.unregister("blink")


def _job(where: Path, drill: str) -> Path:
    where.mkdir(parents=True, exist_ok=True)
    path = where / "trainguard.yaml"
    path.write_text(textwrap.dedent(f"""\
        job:
          name: blink-job
          command: "python {TOY} --steps {{steps}} --seed {{seed}} --ckpt-dir {{checkpoint_dir}}"
          resume_args: ["--resume"]
          world_size: 1
          metrics:
            loss: 'step (?P<step>\\d+) loss (?P<value>\\S+)'
        checks:
          drills:
            - {drill}
        """))
    return path


def test_a_fault_in_a_temp_module_is_accepted_by_the_job_file_the_marker_and_validate(
    blink: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # the job file: the kind, its params checked by its own class, its default expectation
    job_file = load_config(_job(tmp_path / "ok", "{name: b, fault: blink, steps: 6, params: {ms: 5}}"))
    drill = job_file.checks.drills[0]
    assert drill.fault == "blink" and drill.expectation == "recover"
    assert fault_class("blink").__name__ == "BlinkFault"
    with pytest.raises(ConfigError, match=r"checks.drills\[0\].params.ms: expected a whole number"):
        load_config(_job(tmp_path / "bad", "{name: b, fault: blink, steps: 6, params: {ms: 0}}"))
    # the marker: validated and listed (pytest --markers) from the same registry
    validate_marker("fault", ("blink",), {"ms": 5})
    assert "blink" in MARKERS["fault"].line
    # trainguard validate plans the drill
    assert main(["validate", str(tmp_path / "ok" / "trainguard.yaml")]) == 0
    assert "drill:b" in capsys.readouterr().out


def test_an_unregistered_fault_is_unknown_to_all_three_again(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert "blink" not in FAULTS
    path = _job(tmp_path / "gone", "{name: b, fault: blink, steps: 6}")
    with pytest.raises(ConfigError, match="unknown fault 'blink'"):
        load_config(path)
    with pytest.raises(UsageError, match="unknown kind 'blink'"):
        validate_marker("fault", ("blink",), {})
    assert "blink" not in MARKERS["fault"].line
    assert main(["validate", str(path)]) == 2
    assert "unknown fault 'blink'" in capsys.readouterr().err


def test_a_line_that_cannot_be_imported_or_is_not_an_entry_is_said_in_words() -> None:
    faults: Registry[type] = Registry("fault", {"x": "tg_no_such_module:X"})
    assert faults.names() == ("x",) and "x" in faults  # naming it imports nothing
    with pytest.raises(NotInstalled, match=r"the fault registered as 'tg_no_such_module:X' cannot be imported: .*"
                                           r"remove its registration line"):
        faults.get("x")
    with pytest.raises(KeyError, match="no fault is registered as 'y'; registered: x"):
        faults.get("y")
    with pytest.raises(FaultNotInstalled, match="registered already"):
        FAULTS.register("hang", "trainguard.faults.kill:KillRankFault")
    with pytest.raises(FaultNotInstalled, match="not a fault class"):
        FAULTS.register("nope", "trainguard.config.faults:FAULTS")
    assert "nope" not in FAULTS


def test_on_change_hooks_hear_a_registration_and_its_removal() -> None:
    calls: list[tuple[str, ...]] = []
    registry: Registry[type] = Registry("thing", {"a": "builtins:int"}, accepts=lambda v: isinstance(v, type))
    registry.on_change(lambda: calls.append(registry.names()))
    registry.register("b", "builtins:str", before="a")
    registry.unregister("b")
    assert calls == [("b", "a"), ("a",)]
    assert registry.get("a") is int


def test_every_built_in_line_resolves_to_its_entry() -> None:
    assert [c.name for c in CHECKS.entries()] == list(CHECKS.names())
    assert [e.name for e in EXPECTATIONS.entries()] == list(EXPECTATIONS.names())
    assert EXPECTATIONS.names() == tuple(Expectation)  # the faults' typed vocabulary of the same names
    assert all(fault_class(kind).kind == kind for kind in FAULTS)
    assert {kind: BACKENDS.get(kind)().title for kind in BACKENDS} == {"command": "command", "ray_train": "Ray Train"}
    assert all(callable(QUEUES.get(name).submit_and_follow) for name in QUEUES)


def test_the_cli_queue_choices_are_the_registered_queues() -> None:
    """``trainguard submit --queue`` keeps its choices literal (the CLI imports no job-file code
    to start); they must be the registry's."""
    source = (ROOT / "trainguard" / "cli" / "main.py").read_text(encoding="utf-8")
    match = re.search(r'submit\.add_argument\("--queue", choices=\(([^)]*)\)', source)
    assert match is not None
    assert tuple(re.findall(r'"(\w+)"', match.group(1))) == QUEUES.names()


# -- the docs' tables are the registries' ------------------------------------------------------


def _rows(page: str, header: str) -> list[tuple[str, str]]:
    """(first cell without its backticks, the others joined) of each row of the table whose header row
    starts ``header``."""
    lines = (ROOT / "docs" / page).read_text(encoding="utf-8").splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows.append((cells[0].split()[0].strip("`"), " | ".join(cells[1:])))
    return rows


def test_the_docs_tables_list_the_registered_names() -> None:
    """docs/drills.md's defaults per fault and docs/backends.md's kinds: a row per registered
    name, none else (add the row when you register one)."""
    defaults = dict(_rows("drills.md", "| fault | default `expect` |"))
    # the soak has its own section (docs/drills.md, "Chaos soak")
    assert sorted(defaults) == sorted(k for k in FAULTS if k != "soak")
    kinds = [kind for kind, _ in _rows("backends.md", "| `kind` | backend |")]
    assert kinds == [*BACKENDS.names(), "anything"]  # and a row for yours
    for kind, expect in defaults.items():
        assert expect.split()[0] == fault_class(kind).expectations_for(FaultParams({}))[0], kind
    expect_row = dict(_rows("drills.md", "| key | default |"))["expect"]
    assert [e for e in re.findall(r"`(\w+)`", expect_row) if e not in FAULTS] == list(EXPECTATIONS.names())



def test_the_fault_markers_row_in_the_docs_is_the_markers_line() -> None:
    """docs/markers-and-options.md describes ``@pytest.mark.fault`` with the line pytest
    --markers prints, the registered kinds included."""
    signature, _, description = MARKERS["fault"].line.partition(": ")
    row = f"| `@pytest.mark.{signature}` | {description} |"
    assert row in (ROOT / "docs" / "markers-and-options.md").read_text(encoding="utf-8")
