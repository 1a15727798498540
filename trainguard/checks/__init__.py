"""The checks on a job file: smoke, canary (and its baselines), determinism, resume, parallel."""
