"""The promotion gate's submission side: queue backends (Ray Jobs, Slurm), the embedded local
Ray head, and the provenance a gate report carries (so a stale report is refused).

Nothing here imports ray at module level; :mod:`trainguard.raytrain.ray_jobs` imports it on use.
"""

from __future__ import annotations
