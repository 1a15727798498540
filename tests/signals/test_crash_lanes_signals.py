"""A signal while crash_points runs boundaries side by side (trainguard/drills/crash_lanes.py):
the runs under way in every lane stopped, every lane's FUSE layer unmounted and its daemon
reaped, no rank left, and trainguard exits as it does on that signal."""

from __future__ import annotations

import signal
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.distributed.test_crash_points import writer_job
from tests.signals.test_signals import finish
from tests.signals.watching import Watched, trainguard
from trainguard.faults.fusefs import fuse_unavailable

pytestmark = [pytest.mark.timeout(240), pytest.mark.xdist_group("signals"),
              pytest.mark.skipif(fuse_unavailable() is not None, reason=f"no FUSE layer here: {fuse_unavailable()}")]


@pytest.mark.parametrize("sig", [signal.SIGINT, pytest.param(signal.SIGTERM, marks=pytest.mark.slow)])
def test_a_signal_while_boundaries_run_side_by_side_leaves_nothing(tmp_path: Path, watch: Callable[..., Watched],
                                                                   sig: int) -> None:
    """The careful writer with crash runs (no state copies) in two lanes: the signal lands once the
    second lane's layer is mounted, while both lanes run (every boundary run: in kill mode what a
    restart observed may decide the boundaries after it, which then wait for it)."""
    job = writer_job(tmp_path, "atomic", copies=0, lanes=2, infer=False)
    w = watch(trainguard("check", str(job), "--only", "crash_points"))
    w.wait_for("the second lane's layer mounted", lambda: [m for m in w.mounts() if m.endswith("/lane-1/mnt")])
    finish(w, sig, group=sig == signal.SIGINT)  # Ctrl-C reaches the terminal's whole process group
