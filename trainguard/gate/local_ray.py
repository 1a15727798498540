"""Compatibility path: the public names of :mod:`trainguard.raytrain.local_ray` (docs/architecture.md, re-export modules)."""

from __future__ import annotations

from trainguard.raytrain.local_ray import (
    RAY_PROCESS_NAMES,
    LocalRay,
    RayCluster,
    RayStartError,
    external_cluster,
    ray_version,
    running_ray_processes,
    stopped_head_processes,
)

__all__ = [
    "RAY_PROCESS_NAMES",
    "LocalRay",
    "RayCluster",
    "RayStartError",
    "external_cluster",
    "ray_version",
    "running_ray_processes",
    "stopped_head_processes",
]
