"""Helpers shared by several test files: ``from tests.helpers import ...``.

Importable under ``--import-mode=importlib`` because pytest registers ``tests`` (the rootdir-relative
package of the test modules) as a namespace package; not a test module, so never collected.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import struct
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

__all__ = ["DCP_METADATA_MODULE", "TOY", "attrgetter_gadget", "binunicode", "call_gadget", "drills_sharing_a_reference", "each_refused", "load_fault_harness", "read_hostile_corpus", "runs_by_kind", "signals_ignored", "time_limit", "toy_job", "wait_for_a_background_run"]

#: the fake training script of trainguard's own tests (no torch: a run costs a fraction of a second)
TOY = Path(__file__).resolve().parent / "data" / "jobs" / "toy_train.py"


def toy_job(path: Path, name: str, flags: str, drills: list[str], *, world_size: int = 2) -> Path:
    """Write a job file of the toy job at ``path``: ``flags`` added to its command (placeholders
    allowed), ``drills`` the flow-style entries of ``checks.drills``; returns ``path``."""
    entries = "".join(f"    - {d}\n" for d in drills)
    path.write_text(
        "job:\n"
        f"  name: {name}\n"
        f'  command: "python {TOY} --steps {{steps}} --seed {{seed}} --ckpt-dir {{checkpoint_dir}} {flags}"\n'
        '  resume_args: "--resume"\n'
        f"  world_size: {world_size}\n"
        '  env: {OMP_NUM_THREADS: "1"}\n'
        "  metrics:\n"
        "    loss: 'step (?P<step>\\d+) loss (?P<value>\\S+)'\n"
        "  timeout: 60\n"
        "  stall_timeout: 20\n"
        f"checks:\n  drills:\n{entries}"
    )
    return path

def drills_sharing_a_reference(
    path: Path, names: list[str], *, own_reference: tuple[str, ...] = ()
) -> dict[str, Any]:
    """Run the drills ``names`` of the job file at ``path`` in one session (as ``trainguard drill``
    runs them) and return their results by drill name, the first drill's uninterrupted reference
    run serving every one of them but those in ``own_reference``.

    For planted variants whose ``args`` differ only in what the job does when the fault comes (on
    a scheduler's notice, on a non-finite loss): a run that is never interrupted takes none of
    those paths, so it prints the same lines and leaves the same checkpoints whatever the flag,
    and each drill would otherwise launch a reference run of its own (the reference is keyed by
    the request, args included)."""
    from trainguard.config import load_config
    from trainguard.session import open_session, run_drills, session_settings

    job_file = load_config(path)
    specs = {spec.name: spec for spec in job_file.checks.drills}
    chosen = [specs[name] for name in names]
    with open_session(job_file, session_settings(), command="drill") as session:
        runner = session.runner

        def request(spec: Any) -> Any:  # the run a drill asks for (trainguard.drills.driver's)
            return runner.request_for(spec, world_size=spec.world_size or job_file.job.world_size)

        shared = runner.scheduling.reference(request(chosen[0]))
        for spec in chosen[1:]:
            if spec.name not in own_reference:
                runner.scheduling.offer_reference(request(spec), shared)
        results = run_drills(runner, chosen)
    return {result.name.removeprefix("drill:"): result for result in results}


_FAULT_DATA = Path(__file__).resolve().parent / "data" / "faults"


def load_hook_module(name: str, as_name: str) -> ModuleType:
    """The start-up hook's module ``name`` (``_trainguard_sdc_agent``), loaded by file path as the
    hook loads it, under ``as_name`` (not put in sys.modules)."""
    from trainguard.launch.hook import HOOK_DIR

    spec = importlib.util.spec_from_file_location(as_name, HOOK_DIR / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_fault_harness() -> ModuleType:
    """tests/data/faults/harness.py as module ``tg_fault_harness`` (drives one fault through its
    life on real rank processes; the scans proving nothing was left behind)."""
    spec = importlib.util.spec_from_file_location("tg_fault_harness", _FAULT_DATA / "harness.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("tg_fault_harness", module)
    spec.loader.exec_module(module)
    return module


def runs_by_kind(uri: str) -> dict[str, list[Any]]:
    """The runs of the ``trainguard`` experiment in the MLflow store at ``uri``, by their
    ``trainguard.kind`` tag (session, check, launch)."""
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("trainguard")
    assert exp is not None
    out: dict[str, list[Any]] = {}
    for run in client.search_runs([exp.experiment_id]):
        out.setdefault(run.data.tags.get("trainguard.kind", ""), []).append(run)
    return out


def check_context(runner: Any, name: str, spec: Any) -> Any:
    """The :class:`~trainguard.checks.context.CheckContext` ``run_check`` gives check ``name``
    (for a test that calls a check's run function itself)."""
    from trainguard.checks.context import context_for

    return context_for(runner.pool, name, spec, runner.request_for(spec))


def wait_for_a_background_run(runner: Any, timeout: float = 30.0) -> None:
    """Wait until a run the runner launched in a background thread (a prefetched reference, the
    lane's) has its launcher registered, i.e. is really running."""
    import time

    deadline = time.monotonic() + timeout
    while not runner._inflight and time.monotonic() < deadline:
        time.sleep(0.05)
    assert runner._inflight, "the background run never started"


def make_sizing(recommended: int | None = 4, recommendation: str = "4 GPUs meet the deadline",
                **candidate: Any) -> Any:
    """A :class:`~trainguard.profiling.sizing.Sizing` recommending ``recommended`` GPUs with one
    candidate of that size (``candidate`` overrides its fields), none without a recommendation."""
    from trainguard.profiling.sizing import Candidate, Sizing

    fields: dict[str, Any] = {
        "gpus": recommended or 1, "extrapolated": False, "throughput_sps": 100.0, "efficiency": 0.9,
        "steps": 1000, "step_time_s": 0.1, "hours": 5.0, "mtbf_hours": 1000.0,
        "checkpoint_every_s": None, "checkpoint_every_steps": None, "checkpoint_rule": "",
        "expected_failures": 0.0, "hours_with_failures": 5.0, "gpu_hours": 20.0, "cost": 100.0,
        "memory_headroom_mb": None, "feasible": True, **candidate,
    }
    return Sizing(target={}, candidates=[Candidate(**fields)] if recommended else [],
                  recommended=recommended, recommendation=recommendation, limits=[], device="gpu",
                  memory_budget_mb=None, memory_budget_source="")


def patched_copy(example: Path, root: Path, patches: dict[str, tuple[str, str]], job_file: str) -> Path:
    """A copy of ``example`` at ``root`` with each planted replacement ``{file: (old, new)}``
    applied exactly once (a change to the example that moves a patched line fails loudly instead
    of silently testing nothing) and ``job_file`` as its trainguard.yaml; ``root``."""
    import shutil

    shutil.copytree(example, root, ignore=shutil.ignore_patterns(".trainguard", "__pycache__"))
    for name, (old, new) in patches.items():
        path = root / name
        text = path.read_text()
        assert text.count(old) == 1, f"planted patch no longer applies to {name}: {old!r}"
        path.write_text(text.replace(old, new))
    (root / "trainguard.yaml").write_text(job_file)
    return root


def only_check(root: Path, name: str) -> Any:
    """Run one check (or ``drill:<name>``) of the job file in ``root``; its CheckResult."""
    from trainguard.session import check

    report = check(root, only=[name], report_json=str(root / "report.json"))
    assert len(report.checks) == 1, [c.name for c in report.checks]
    return report.checks[0]


@contextlib.contextmanager
def time_limit(seconds: int) -> Iterator[None]:
    """Fail whatever runs past ``seconds`` (a stuck fuzz example) with TimeoutError, from a real
    timer (SIGALRM: the main thread only)."""

    def expired(signum: int, frame: Any) -> None:
        raise TimeoutError(f"one example ran past {seconds} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@contextlib.contextmanager
def signals_ignored() -> Iterator[None]:
    """SIGINT and SIGQUIT ignored in this process while the block runs, as a shell starts a
    background job (`pytest ... &` in a script): whatever it starts inherits them ignored."""
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGQUIT)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def copy_digits_ray_example(tmp_path: Path, checks: str) -> Path:
    """The digits and digits_ray example folders copied to ``tmp_path`` (the Ray one imports
    the digits package by a relative path), with ``checks`` as digits_ray's ``checks:`` section;
    returns digits_ray's trainguard.yaml."""
    import shutil

    examples = Path(__file__).resolve().parents[1] / "examples"
    ignore = shutil.ignore_patterns(".trainguard", "__pycache__")
    shutil.copytree(examples / "digits", tmp_path / "digits", ignore=ignore)
    shutil.copytree(examples / "digits_ray", tmp_path / "digits_ray", ignore=ignore)
    job = tmp_path / "digits_ray" / "trainguard.yaml"
    text = job.read_text()
    job.write_text(text[: text.index("checks:")] + checks.lstrip("\n"))
    return job


#: the module DCP's ``.metadata`` pickles name their dataclasses from
DCP_METADATA_MODULE = "torch.distributed.checkpoint.metadata"


def binunicode(text: str) -> bytes:
    """``text`` as a pickle BINUNICODE opcode (for hand-made pickles)."""
    data = text.encode()
    return b"X" + struct.pack("<I", len(data)) + data  # BINUNICODE


def call_gadget(module: str, name: str, arg: str, protocol: int) -> bytes:
    """A pickle calling ``module.name(arg)``: GLOBAL for protocol 2, STACK_GLOBAL for 4."""
    if protocol == 2:
        found = b"c" + module.encode() + b"\n" + name.encode() + b"\n"
    else:
        found = binunicode(module) + binunicode(name) + b"\x93"
    return bytes([0x80, protocol]) + found + binunicode(arg) + b"\x85R."


def attrgetter_gadget(command: str) -> bytes:
    """The gadget of issue 24: ``torch.inspect.attrgetter`` is a *type* reached by a dotted name
    from the metadata module; with it, ``TensorProperties.__getstate__.__globals__.get('os')``,
    then ``attrgetter('system')(os)(command)``."""
    meta = DCP_METADATA_MODULE
    getter = binunicode(meta) + binunicode("torch.inspect.attrgetter") + b"\x93"
    cls = binunicode(meta) + binunicode("TensorProperties") + b"\x93"
    return (b"\x80\x04" + getter + binunicode("__getstate__.__globals__.get") + b"\x85R"
            + cls + b"\x85R" + binunicode("os") + b"\x85R\x94" + b"0"
            + getter + binunicode("system") + b"\x85R" + b"h\x00\x85R"
            + binunicode(command) + b"\x85R.")


def read_hostile_corpus(corpus: Path, max_rss_mb: float, seconds: float) -> list[dict[str, Any]]:
    """Read every case (directory) of ``corpus`` in a process of its own under the caps
    (tests/hostile_driver.py) and assert the hostile-file oracle: exit 0 or 1, a report written,
    under the peak-RSS and the wall-time cap. The driver's rows, one per case."""
    here = Path(__file__).resolve().parent
    env = {**os.environ, "PYTHONPATH": str(here.parent), "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, str(here / "hostile_driver.py"), str(corpus),
                             str(max_rss_mb), str(seconds)],
                            capture_output=True, text=True, timeout=300, env=env, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == len([p for p in corpus.iterdir() if p.is_dir()])
    bad = [r for r in rows if r["exit"] not in (0, 1) or not r["report"] or r["timed_out"] or r["over_rss"]]
    assert not bad, (bad, result.stderr[-3000:])
    return rows


def each_refused(directory: Path, cases: dict[str, tuple[str, str]], load: Any, error: type[Exception],
                 fix: str) -> None:
    """Write each case's text as ``<name>.json`` in ``directory`` and assert ``load`` refuses it
    with ``error``: its message matches the case's regex and names the file and ``fix``."""
    import pytest

    for name, (text, words) in cases.items():
        path = directory / f"{name}.json"
        path.write_text(text)
        with pytest.raises(error, match=words) as caught:
            load(path)
        assert str(path) in str(caught.value) and fix in str(caught.value), name


def drill_report(restarts: int = 1, kind: str = "recover", fault_evidence: dict[str, Any] | None = None,
                 **found: Any) -> Any:
    """A drill's report object (``drills.evidence.DrillReport``) whose judge recorded ``found``
    (a recover drill's fields; ``kind="continue"``: a continue drill's) after ``restarts``."""
    from trainguard.drills.evidence import ContinueEvidence, DrillReport, RecoverEvidence, StepRate

    record = RecoverEvidence if kind == "recover" else ContinueEvidence
    judged = record(None, None, 0, None, None, None, restarts, [], StepRate("steps/s", None, None),
                    fault_evidence or {}, "", **found)
    return DrillReport("kill", kind, 0, 5, None, 20, found=judged)


def soak_report(seed: int, restart_mean: float, lost_mean: float, restarts: int = 5) -> Any:
    """One soak run's report object (``drills.evidence.SoakReport``) that measured these means."""
    from trainguard.checks.equivalence_records import TrajectoryEvidence
    from trainguard.drills.evidence import (
        RestartCosts,
        SoakEvidence,
        SoakMeasured,
        SoakReport,
        StepsLost,
    )

    trajectory = TrajectoryEvidence("loss", 20, None, None, 0.0, 0.0, [])
    measured = SoakMeasured(60.0, 50.0, "the uninterrupted run's wall-clock", 0.83, restarts,
                            RestartCosts(1.0, restart_mean, 1.0), StepsLost(9, lost_mean), 0.1, 5, None)
    return SoakReport("soak", "recover", seed, 20, [], found=SoakEvidence(restarts, trajectory, measured=measured))


def profile_evidence(sizing: Any) -> Any:
    """The profile check's record (``profiling.check.ProfileEvidence``) holding ``sizing``."""
    from trainguard.profiling.check import ProfileEvidence

    return ProfileEvidence("report.html", "report.json", None, {}, {}, "run", sizing=sizing)


def report_evidence(result: Any) -> Any:
    """What the report says a check found: a :class:`~trainguard.report.CheckResult`'s evidence
    object as its report holds it (the record's keys, then the session's run notes); anything else
    that has ``evidence`` (a run's launcher findings, a fault's) as it is."""
    from trainguard.report import CheckResult

    return result.to_dict()["evidence"] if isinstance(result, CheckResult) else result.evidence
