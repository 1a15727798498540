"""How a drill's fault reaches the ranks of a ``kind: ray_train`` job, and who restarts them
(:meth:`RayTrainBackend.fault_reach <trainguard.raytrain.backend.RayTrainBackend.fault_reach>`,
``drill_restarts``).

The ranks are Ray workers behind the one launched driver: they are followed from the
``trainguard-worker`` lines of the driver's stderr (:class:`~trainguard.raytrain.workers.
RayWorkerTracker`), the fault gets a :class:`~trainguard.raytrain.workers.RayWorkerLauncher`
whose ranks are the workers, and -- on the ``api`` signal path, or for a fault that acts only
through Ray (``node_loss``) -- a :class:`~trainguard.raytrain.agent.RayAgent` reaches them
through Ray's API. Ray Train restarts a worker that died (``FailureConfig``) inside the same fit,
so trainguard relaunches nothing after those faults (docs/ray-train.md, "Drills").
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from trainguard.launch.reach import RankWatch, ReachClient, Restarts, WorkerNotHere
from trainguard.raytrain.agent import STATE_TRACKING_ENV, RayAgent, RayAgentError
from trainguard.raytrain.workers import RayWorkerLauncher, RayWorkerTracker, signal_path

if TYPE_CHECKING:  # pragma: no cover
    from trainguard.launch import Launcher

__all__ = ["RAY_API_FAULTS", "RAY_RECOVERED_FAULTS", "RayReach", "ray_restarts"]

#: faults that kill a Ray Train worker process: Ray Train sees the death itself, so for a
#: ray_train job `expect: recover` means its FailureConfig restarts the worker group inside the
#: same fit (trainguard does not restart the driver); a hang it does not see (docs/ray-train.md)
RAY_RECOVERED_FAULTS = ("kill_rank", "oom", "node_loss")
#: faults that act on a Ray Train job only through Ray's API (a RayAgent), whatever the pid path
RAY_API_FAULTS = ("node_loss",)


def ray_restarts(fault_kind: str, expectation: str, limit: int) -> Restarts:
    """Ray Train recovers a dead worker itself (FailureConfig): trainguard must not restart too."""
    inside = expectation == "recover" and fault_kind in RAY_RECOVERED_FAULTS
    return Restarts(relaunches=0 if inside else limit, in_launch=inside)


class RayReach:
    """The :class:`~trainguard.launch.reach.RankReach` of one drill run of a ray_train job."""

    def __init__(self, fault_kind: str, env: Callable[[], Mapping[str, str]], *, job_name: str,
                 world_size: int) -> None:
        self.fault_kind = fault_kind
        self.via_api = signal_path() == "api"  # ValueError naming the variable
        # trainguard's Ray client: Ray Train's state names the workers, pinned tasks act on them
        self.agent = RayAgent(env()) if self.via_api or fault_kind in RAY_API_FAULTS else None
        self.job_name = job_name
        self.world_size = world_size
        self._tracker: RayWorkerTracker | None = None
        self._view: RayWorkerLauncher | None = None  # the workers as the fault will see them

    def open(self) -> ReachClient | None:
        if self.agent is None:
            return None
        try:
            self.agent.start()
        except RayAgentError as exc:
            raise WorkerNotHere(f"{self.fault_kind} reaches the Ray workers through Ray's API, and "
                                f"trainguard's Ray client could not connect: {exc}") from None
        return ReachClient(round(self.agent.start_s or 0.0, 3), not self.via_api)

    def launch_env(self) -> dict[str, str]:
        return dict(STATE_TRACKING_ENV) if self.agent is not None else {}

    def preexec(self, hook: Callable[[int], None]) -> Callable[[int], None] | None:
        return None  # the workers are the raylet's processes, not the launcher's children

    def watch(self, launcher: Launcher) -> RankWatch:
        if self._tracker is None:
            self._tracker = RayWorkerTracker(launcher.ranks[0].stderr_log, clock=launcher.elapsed)
        return self._tracker

    def ready(self, launcher: Launcher, rank: int) -> None:
        if self.agent is None or self._view is not None:
            return
        # Ray's state read once the group trains, so the fault lands right after its step
        self._view = view = self._make_view(launcher)
        threading.Thread(target=view.prefetch, args=(rank,), daemon=True,
                         name="trainguard-ray-prefetch").start()

    def target(self, launcher: Launcher) -> Launcher:
        return self._view or self._make_view(launcher)  # type: ignore[return-value]

    def _make_view(self, launcher: Launcher) -> RayWorkerLauncher:
        tracker = self.watch(launcher)
        assert isinstance(tracker, RayWorkerTracker)
        return RayWorkerLauncher(launcher, tracker, self.world_size or 1, agent=self.agent,
                                 run_name=self.job_name, via_api=self.via_api)

    def outlives_attempt(self) -> bool:
        # a Ray worker is out of the launcher's teardown: a stopped one must go on (and die with
        # its job) before the next attempt wants its CPUs
        return True

    def close(self) -> None:
        if self.agent is not None:  # after the fault's teardown: a stopped worker is continued through Ray
            self.agent.stop()
