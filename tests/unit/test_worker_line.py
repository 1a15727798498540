"""The one parser of the ``trainguard-worker rank=R pid=P node=IP`` line a Ray Train worker
prints, and the Ray Train backend's reader of the driver's log that the profiler samples by (the
fault drills' use of :class:`~trainguard.raytrain.workers.RayWorkerTracker` is tested in
test_ray_workers.py)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from trainguard.raytrain import WORKER_PREFIX, WorkerLine, format_worker_line, parse_worker_line
from trainguard.raytrain.backend import RayTrainBackend


def test_a_forwarded_worker_line_is_parsed_with_and_without_node() -> None:
    line = f"(RayTrainWorker pid=21, ip=10.0.0.5) {WORKER_PREFIX} rank=3 pid=21 node=10.0.0.5"
    assert parse_worker_line(line) == WorkerLine(rank=3, pid=21, node="10.0.0.5")
    assert parse_worker_line(f"{WORKER_PREFIX} rank=0 pid=7") == WorkerLine(0, 7, None)
    # what the driver's workers print reads back
    assert parse_worker_line(format_worker_line(2, 4242, "127.0.0.1")) == WorkerLine(2, 4242, "127.0.0.1")


def test_other_lines_are_not_worker_lines() -> None:
    for line in ("", "trainguard-report step=3 loss=0.5", f"{WORKER_PREFIX} rank=0 pi",
                 f"{WORKER_PREFIX} rank=x pid=7"):
        assert parse_worker_line(line) is None, line


def test_the_profiler_reads_worker_pids_incrementally(tmp_path: Path) -> None:
    backend = RayTrainBackend()
    assert backend.rank_pids(SimpleNamespace(ranks=[]))() == {}  # no driver launched yet  # type: ignore[arg-type]
    log = tmp_path / "rank0.stderr.log"
    pids = backend.rank_pids(SimpleNamespace(ranks=[SimpleNamespace(stderr_log=log)]))  # type: ignore[arg-type]
    assert pids() == {}  # the driver has not written yet
    log.write_text(
        "(TrainController pid=10) Attempting to start training worker group of size 2\n"
        f"(RayTrainWorker pid=21) {WORKER_PREFIX} rank=0 pid=21 node=127.0.0.1\n"
        f"(RayTrainWorker pid=22) {WORKER_PREFIX} rank=1 pi"  # a partial line
    )
    assert pids() == {0: 21}
    with open(log, "a") as f:  # the rest of the line, then a restarted rank 0
        f.write(f"d=22 node=127.0.0.1\n(RayTrainWorker pid=31) {WORKER_PREFIX} rank=0 pid=31\n")
    assert pids() == {0: 31, 1: 22}
