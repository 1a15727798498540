"""Fault injection for drills: one module per fault kind, plus the Toxiproxy-compatible proxy.

See :mod:`trainguard.faults.base` for the contract every fault follows, docs/drills.md and the
fault pages it links.
"""

from __future__ import annotations

from trainguard.faults.base import Fault, FaultContext, FaultUnavailable

__all__ = ["Fault", "FaultContext", "FaultUnavailable"]
