"""``node_loss``: the Ray node that runs world rank ``rank``'s worker is lost after step ``after_step``.

The real thing, through Ray (trainguard needs to run only where the head is reachable): the
worker of world rank ``rank`` is found in Ray Train's state, and a task pinned to its node
(``NodeAffinitySchedulingStrategy``, zero CPUs) kills that node's raylet -- the task's own parent
process -- with ``signal`` (SIGKILL: a machine that dies; SIGTERM: the raylet's own shutdown).
Every worker on the node exits with its raylet, the GCS declares the node dead, and Ray Train
sees its workers die: with ``job.max_restarts >= 1`` and room left on the other nodes it starts a
new worker group there from the latest checkpoint (``expect: recover``, the default); with no
room, or no failure budget, the fit must fail within the drill's deadline (``fail_clean``).

Only a ``kind: ray_train`` job on a cluster with worker nodes can lose one: a worker on the head
node is refused (losing the head loses the cluster). The node stays down until someone starts it
again: trainguard does that at :meth:`NodeLossFault.clear` only for a cluster it started itself
(:meth:`RemoteRanks.restart_lost_nodes <trainguard.launch.reach.RemoteRanks.restart_lost_nodes>`);
on a real cluster the autoscaler or an operator brings it back. docs/ray-train.md, "Node loss".
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from trainguard.config.fault_params import FaultParams
from trainguard.faults.base import Fault, FaultContext, FaultEvidence
from trainguard.launch.reach import RemoteRanks, WorkerNotHere

if TYPE_CHECKING:  # pragma: no cover
    from trainguard.launch import Launcher, RunResult
    from trainguard.launch.backend import JobBackend

__all__ = ["NODE_LOSS_SIGNALS", "NodeLossEvidence", "NodeLossFault"]

#: how the raylet is ended: SIGKILL (the node dies), SIGTERM (Ray's own shutdown of the node)
NODE_LOSS_SIGNALS = ("SIGKILL", "SIGTERM")


@dataclass
class NodeLossEvidence(FaultEvidence):
    """The Ray node a ``node_loss`` fault stopped (what Ray said of it), and its restart."""

    signal: str
    via: str | None
    node_id: str | None
    #: the worker of the rank, on that node
    pid: int | None
    raylet_pid: int | None
    ranks_on_node: list[int] | None
    node_resources: dict[str, float] | None
    stop_took_s: float | None
    #: how the worker was found (Ray Train's state, or prefetched)
    lookup: str | None
    node_restarted: list[str]
    node_restart_s: float | None


class NodeLossFault(Fault):
    """Stop the Ray node of rank ``rank``'s worker after step ``after_step`` (its raylet, through Ray)."""

    kind: ClassVar[str] = "node_loss"
    defaults: ClassVar[FaultParams] = FaultParams({"signal": "SIGKILL"})

    def __init__(self, params: FaultParams | None = None, **kwargs: Any) -> None:
        super().__init__(params, **kwargs)
        self.stopped: dict[str, Any] = {}
        self.restarted: list[str] = []
        self.restart_s: float | None = None
        self._ranks: RemoteRanks | None = None

    @classmethod
    def validate(cls, params: FaultParams) -> list[tuple[str, str]]:
        problems = super().validate(params)
        sig = params.raw("signal", "SIGKILL")
        if sig not in NODE_LOSS_SIGNALS:
            problems.append(("signal", f"expected one of {', '.join(NODE_LOSS_SIGNALS)}, got {sig!r}; "
                             "e.g. `params: {signal: SIGTERM}`"))
        return problems

    @classmethod
    def unavailable_for(cls, backend: JobBackend) -> str | None:
        return None if backend.stoppable_nodes() else (
            "node_loss stops a Ray node, and this job is not `kind: ray_train`; for a command "
            "job use kill_rank (a rank's death) or a Slurm drill (a node marked down)")

    def setup(self, ctx: FaultContext) -> None:
        self.require_job_kind(ctx)

    def inject(self, launcher: Launcher) -> None:
        if not isinstance(launcher, RemoteRanks):
            raise WorkerNotHere("node_loss needs the Ray workers of a ray_train job")
        self._ranks = launcher
        self.stopped = launcher.stop_node_of(self.rank, signal.Signals[self.params.text("signal")])

    def clear(self) -> None:
        """Start the lost node again when it belongs to a cluster trainguard started (nothing on
        a real cluster): the next fit -- a fail_clean drill's resume -- has its room back."""
        if not self.stopped or self.restarted or self._ranks is None:
            return
        t0 = time.monotonic()
        self.restarted = self._ranks.restart_lost_nodes(10.0)
        self.restart_s = round(time.monotonic() - t0, 3)

    def evidence(self) -> NodeLossEvidence:
        stopped = self.stopped
        target = stopped.get("target", {})
        return NodeLossEvidence(
            *self.struck(), signal=self.params.text("signal"), via=stopped.get("via"),
            node_id=target.get("node_id"), pid=target.get("pid"), raylet_pid=stopped.get("raylet_pid"),
            ranks_on_node=stopped.get("ranks_on_node"), node_resources=stopped.get("node_resources"),
            stop_took_s=stopped.get("took_s"), lookup=stopped.get("lookup"),
            node_restarted=self.restarted, node_restart_s=self.restart_s)

    def classify(self, result: RunResult) -> str:
        node = str(self.stopped.get("target", {}).get("node_id", "?"))[:12]
        how = f"the Ray node {node} of rank {self.rank}'s worker was lost ({self.params.text('signal')} to its raylet)"
        return f"{how}; the fit completed" if result.ok else \
            f"{how}; the fit failed ({result.reason or result.outcome})"
