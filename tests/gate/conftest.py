"""One real embedded Ray head per test session (tests marked ``ray``; also ``slow``, so the
default run skips them: select them with ``-m ray``).

The head always starts (``RAY_ADDRESS`` is ignored here: these tests assert what a CPU-only
local cluster does) with ``num_gpus=0``, so the GPU-refusal tests hold on a GPU machine too. At
the end of the session the fixture proves that no process of the head is left.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import pytest

from trainguard.raytrain.local_ray import LocalRay, running_ray_processes


@pytest.fixture(scope="session")
def ray_head() -> Iterator[LocalRay]:
    """A started :class:`LocalRay` (its ``.cluster`` is the ``RayCluster``)."""
    pytest.importorskip(
        "ray.job_submission", reason="needs ray[default] (pip install trainguard[ray])"
    )
    head = LocalRay(num_gpus=0, use_ray_address=False, start_timeout=180)
    before = {p.pid for p in running_ray_processes()}
    head.start()
    assert head.cluster is not None and head.cluster.temp_dir is not None
    temp_dir = head.cluster.temp_dir
    print(f"\nlocal Ray head: started in {head.start_s:.1f} s, {head.memory_mb():.0f} MiB PSS")
    try:
        yield head
    finally:
        head.stop()
        time.sleep(0.5)
        ours = running_ray_processes(temp_dir)
        new = [p.pid for p in running_ray_processes() if p.pid not in before]
        print(
            f"\nlocal Ray head: stopped in {head.stop_s:.1f} s; SIGKILLed {head.killed}; "
            f"left over {head.leftover}; ray processes before/after on the machine: "
            f"{len(before)}/{len(before) + len(new)} (other users' heads included)"
        )
        assert not head.leftover and not ours, f"Ray processes left behind: {ours}"
        assert not os.path.exists(temp_dir), f"{temp_dir} was not removed"
