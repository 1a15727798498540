"""Submitting a promoted job to the production queue: the submission protocol, Ray Jobs, Slurm (docs/queue.md)."""
