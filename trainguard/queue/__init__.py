"""Submitting a promoted job to the production queue (docs/queue.md).

:mod:`~trainguard.queue.base` holds the submission types and the backend protocol,
:mod:`~trainguard.raytrain.ray_jobs` and :mod:`~trainguard.queue.slurm` the two backends, and
:mod:`~trainguard.queue.backends` picks one by name (``get_backend``).
"""
