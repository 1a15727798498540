"""Compatibility path: the public names of :mod:`trainguard.queue.ray_jobs` (docs/architecture.md, re-export modules)."""

from __future__ import annotations

from trainguard.queue.ray_jobs import (
    ClusterResources,
    RayJobsBackend,
    cluster_resources,
)

__all__ = [
    "ClusterResources",
    "RayJobsBackend",
    "cluster_resources",
]
