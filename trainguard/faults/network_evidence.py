"""The records the ``network`` fault (:mod:`trainguard.faults.network`) writes to a drill's
report: what it put on which connections, and what it found of a ``ray_train`` job's writer."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from trainguard.evidence import UNSET, Evidence, Unset
from trainguard.faults.base import FaultEvidence

__all__ = ["NetworkEvidence", "RayWriterCheck"]


@dataclass
class RayWriterCheck(Evidence):
    """What :meth:`~trainguard.faults.network.NetworkFault.verify_continue` found of a ``ray_train`` job's designated
    MLflow writer: its summary (None: it never ran) and the steps stored against reported."""

    writer: dict[str, Any] | Unset | None = UNSET
    stored_steps: dict[str, int] | Unset = UNSET
    reported_steps: dict[str, int] | Unset = UNSET


@dataclass
class NetworkEvidence(FaultEvidence):
    """The toxic a ``network`` fault put on which connections, through which proxy, and what the
    Toxiproxy server answered."""

    toxic: str | None
    down: bool
    #: the toxic's attributes as the drill gave them
    attributes: dict[str, Any]
    stream: str
    toxicity: float
    target: str
    upstream: str | None
    proxy: str | None
    #: the Toxiproxy server used: embedded, or a real one and where
    toxiproxy: str | None
    toxiproxy_version: str | None
    #: the server's answer to the toxic's creation
    toxic_applied: dict[str, Any] | None
    inject_api_ms: float | None
    mlflow_started_in_s: float | None
    drill_run_id: str | Unset = UNSET
    ray_writer: RayWriterCheck | Unset = UNSET
    errors: list[str] = field(default_factory=list)
