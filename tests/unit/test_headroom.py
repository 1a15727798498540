"""The headroom search's algorithm over a probe callback with a known memory boundary, the memory
fit and the safe batch, the classification of real failed runs' logs, the config errors, and the
report sections. The real runs under a cgroup budget are in tests/distributed/test_headroom.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainguard.config import parse_config
from trainguard.errors import ConfigError
from trainguard.launch import RankExit, RunResult
from trainguard.profiling.headroom import (
    Headroom,
    MemoryFit,
    Probe,
    classify_probe,
    fit_memory,
    safe_batch,
    search_batch,
)
from trainguard.profiling.render import PLOTS, render_html, render_markdown, render_plots


def _job(budget_mb: float = 200.0, fixed_mb: float = 6.0, per_sample_mb: float = 1.0,
         crash_above: int | None = None) -> tuple[list[int], object]:
    """A probe with a known boundary: peak = fixed + per_sample x batch, OOM above the budget."""
    seen: list[int] = []

    def probe(batch: int) -> Probe:
        seen.append(batch)
        if crash_above is not None and batch > crash_above:
            return Probe(batch, "error", "exited with code 2 (ValueError: batch too large)")
        peak = fixed_mb + per_sample_mb * batch
        if peak > budget_mb:
            return Probe(batch, "oom", "killed by the kernel OOM killer", peak_mb=budget_mb)
        return Probe(batch, "pass", "ok", peak_mb=peak)

    return seen, probe


def test_search_doubles_then_bisects_to_the_known_boundary() -> None:
    seen, probe = _job()  # true largest batch: (200 - 6) / 1 = 194
    out = search_batch(probe, start=16, max_batch=4096, resolution=0.05)  # type: ignore[arg-type]
    assert seen[:5] == [16, 32, 64, 128, 256]  # doubling until the first OOM
    assert out.stopped == "bracketed"
    assert out.largest_pass is not None and out.first_fail is not None
    assert out.largest_pass <= 194 < out.first_fail
    assert out.first_fail - out.largest_pass <= 0.05 * out.largest_pass
    assert len(out.probes) == len(seen) <= 12


def test_search_resolution_and_multiple_of() -> None:
    seen, probe = _job(budget_mb=1000.0, per_sample_mb=0.5)  # true: 1988
    out = search_batch(probe, start=8, max_batch=8192, step=8, resolution=0.0001,  # type: ignore[arg-type]
                       max_probes=30)
    assert all(b % 8 == 0 for b in seen)
    assert out.largest_pass == 1984 and out.first_fail == 1992  # one step of 8 apart


def test_search_stops_at_a_non_memory_failure_and_says_so() -> None:
    seen, probe = _job(crash_above=100)
    out = search_batch(probe, start=16, max_batch=4096)  # type: ignore[arg-type]
    assert out.stopped == "other_failure"
    assert seen == [16, 32, 64, 128]
    assert out.largest_pass == 64 and out.first_fail is None
    assert "batch 128 failed for a reason other than memory" in out.reason
    assert "ValueError" in out.reason


def test_search_reports_max_reached_and_start_failed_and_the_probe_limit() -> None:
    seen, probe = _job(budget_mb=10_000.0)
    out = search_batch(probe, start=16, max_batch=100)  # type: ignore[arg-type]
    assert out.stopped == "max_reached" and seen == [16, 32, 64, 100] and out.largest_pass == 100

    _, probe = _job(budget_mb=10.0)
    out = search_batch(probe, start=16, max_batch=100)  # type: ignore[arg-type]
    assert out.stopped == "start_failed" and out.largest_pass is None and "lower `start`" in out.reason

    seen, probe = _job()
    out = search_batch(probe, start=1, max_batch=4096, max_probes=6)  # type: ignore[arg-type]
    assert out.stopped == "probe_limit" and len(seen) == 6


def test_memory_fit_and_safe_batch() -> None:
    probes = [Probe(b, "pass", "ok", peak_mb=300 + 0.5 * b) for b in (16, 32, 64, 128)]
    probes.append(Probe(256, "oom", "", peak_mb=400))  # OOM probes are not in the fit
    fit = fit_memory(probes)
    assert fit is not None
    assert fit.fixed_mb == pytest.approx(300) and fit.per_sample_mb == pytest.approx(0.5)
    # (1 - 0.2) x 400 = 320 MB -> (320 - 300) / 0.5 = 40, below the largest pass (128)
    assert safe_batch(128, fit, 400, 0.2)[0] == 40
    assert safe_batch(128, fit, 400, 0.2, step=16)[0] == 32
    assert safe_batch(128, fit, 10_000, 0.2)[0] == 128  # never above what passed
    assert safe_batch(128, fit, 350, 0.2)[0] is None  # the fixed part alone is over 280 MB
    assert fit_memory(probes[:1]) is None
    scaled, rule = safe_batch(128, None, 400, 0.25)
    assert scaled == 96 and "no memory fit" in rule
    flat = MemoryFit(fixed_mb=100, per_sample_mb=0.0, points=3, rms_mb=0)
    assert safe_batch(64, flat, 400, 0.2)[0] == 64


def _failed_run(tmp_path: Path, stderr: str, *, signal: str | None = None, outcome: str = "failed") -> RunResult:
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "rank0.stderr.log").write_text(stderr)
    code = -9 if signal else 1
    return RunResult(
        outcome=outcome, argv=["python"], run_dir=tmp_path, world_size=1, port=0,  # type: ignore[arg-type]
        exits=[RankExit(0, 1, code, signal)], points=[], duration_s=1.0, first_metric_s=None,
        reason="rank 0 exited with code 1", failed_rank=0,
    )


@pytest.mark.parametrize(
    ("stderr", "outcome", "words"),
    [
        ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB", "oom", "CUDA"),
        ("RuntimeError: [enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate "
         "memory: you tried to allocate 123 bytes", "oom", "DefaultCPUAllocator"),
        ("Traceback (most recent call last):\nMemoryError", "oom", "MemoryError"),
        ("ValueError: batch 128 is larger than the dataset", "error", "ValueError"),
        ("RuntimeError: shapes cannot be multiplied", "error", "shapes"),
    ],
)
def test_classify_probe_reads_the_ranks_stderr(tmp_path: Path, stderr: str, outcome: str, words: str) -> None:
    got, detail = classify_probe(_failed_run(tmp_path, stderr))
    assert got == outcome and words in detail


def test_classify_probe_counts_cgroup_oom_kills_and_never_takes_a_hang_for_oom(tmp_path: Path) -> None:
    killed = _failed_run(tmp_path / "a", "", signal="SIGKILL")
    assert classify_probe(killed, {0: 1})[0] == "oom"
    # a SIGKILL without a cgroup OOM kill is not known to be memory
    assert classify_probe(killed, {0: 0})[0] == "error"
    hung = _failed_run(tmp_path / "b", "MemoryError in a log line", outcome="hung")
    assert classify_probe(hung)[0] == "error"


JOB = """\
job:
  name: t
  command: "python x.py --steps {steps}%s"
  batch_size: 8
  metrics: {loss: 'step (?P<step>\\\\d+) loss (?P<value>\\\\S+)'}
checks:
  profile:
    headroom: %s
"""


def test_config_needs_the_batch_size_placeholder_and_a_sane_range() -> None:
    with pytest.raises(ConfigError) as exc:
        parse_config(JOB % ("", "{start: 16}"), path="job.trainguard.yaml")
    text = str(exc.value)
    assert "job.trainguard.yaml" in text and "checks.profile.headroom" in text
    assert "{batch_size}" in text and "--batch-size {batch_size}" in text
    with pytest.raises(ConfigError, match="start \\(64\\) must not exceed max \\(32\\)"):
        parse_config(JOB % (" --bs {batch_size}", "{start: 64, max: 32}"))
    with pytest.raises(ConfigError, match="unknown key 'strat' \\(did you mean 'start'\\?\\)"):
        parse_config(JOB % (" --bs {batch_size}", "{strat: 64}"))
    with pytest.raises(ConfigError, match="multiple of multiple_of"):
        parse_config(JOB % (" --bs {batch_size}", "{start: 3, world_size: 2}"))
    spec = parse_config(JOB % (" --bs {batch_size}", "{max: 512, memory_budget_mb: 900}")).checks.profile
    assert spec is not None and spec.headroom is not None
    assert (spec.headroom.start, spec.headroom.max, spec.headroom.margin) == (16, 512, 0.2)


def _headroom() -> Headroom:
    probes = [Probe(b, "pass", "ok", peak_mb=300 + 0.5 * b, duration_s=1.0) for b in (16, 32, 64)]
    probes.append(Probe(128, "oom", "killed by the kernel OOM killer", peak_mb=380.0))
    fit = fit_memory(probes)
    return Headroom(
        device="cpu", enforcement="cgroup", fallback=None, budget_mb=360.0,
        budget_source="checks.profile.headroom.memory_budget_mb", margin=0.2, world_size=1,
        start=16, max_batch=1024, probes=probes, largest_pass=64, first_fail=128,
        stopped="bracketed", reason="batch 64 fits, 128 runs out of memory", safe_batch=None,
        safe_rule="x", fit=fit, profile_batch=32, peak_at_profile_batch_mb=316.0,
        peak_source="measured", headroom_mb=44.0, duration_s=4.0,
    )


def test_reports_show_the_probe_table_the_plot_and_the_headroom_per_rank() -> None:
    hr = _headroom()
    assert hr.summary().startswith("headroom: largest batch 64 (OOM at 128), no safe batch")
    assert "44 MB free per rank at batch 32" in hr.summary()
    data = {
        "job": "t", "job_file": "t.yaml", "device": "cpu", "measured_on": "CPU", "run_dir": "r",
        "created_at": "now", "trainguard_version": "0", "machine": {"id": "m"},
        "commit": {"id": None, "dirty": False}, "throughput_unit": "samples/s",
        "settings": {"steps": 5, "warmup_steps": 1, "world_sizes": [1], "scaling": "strong", "args": []},
        "sizes": [], "scaling": {"kind": "strong", "table": {}, "phrase": "", "fit": None, "predictions": {}},
        "sizing": None, "compare": {"baseline": None, "results": []}, "notes": [], "saved_baseline": None,
        "headroom": hr.to_dict(),
    }
    md = render_markdown(data)
    assert "### Memory headroom" in md and "| 128 | oom |" in md and "killed by the kernel" in md
    plots = render_plots(data)
    assert plots["headroom"].startswith(b"\x89PNG")
    # the page's other plots need sizes measured; this test is about the headroom section
    html = render_html(data, {**{k: b"png" for k in PLOTS}, **plots})
    assert "Memory headroom" in html and "headroom search" in html


def test_cli_headroom_flag_without_a_headroom_section_is_a_config_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from trainguard.cli import main

    path = tmp_path / "job.trainguard.yaml"
    path.write_text((JOB % (" --bs {batch_size}", "{}")).replace("    headroom: {}\n", "    steps: 10\n"))
    assert main(["profile", str(path), "--headroom"]) == 2
    err = capsys.readouterr().err
    assert "checks.profile.headroom" in err and "--headroom needs a `headroom:` section" in err


def test_without_root_auto_enforcement_falls_back_to_rlimit_and_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    from trainguard.config import HeadroomSearch
    from trainguard.faults.base import FaultUnavailable
    from trainguard.profiling.headroom import _choose_enforcement

    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    chosen = _choose_enforcement(HeadroomSearch(), "cpu", 100.0)
    assert chosen.mode == "rlimit" and chosen.budget_bytes == 100 * 2**20
    assert chosen.fallback is not None and "need root" in chosen.fallback and "RLIMIT_AS" in chosen.fallback
    with pytest.raises(FaultUnavailable, match="need root"):
        _choose_enforcement(HeadroomSearch(enforce="cgroup"), "cpu", 100.0)
    assert _choose_enforcement(HeadroomSearch(), "gpu", 100.0).mode == "gpu"
