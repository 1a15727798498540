"""The checks on a job file: smoke, canary (and its baselines), determinism, resume, parallel,
reshard. Running them as a session (``check``, ``run_check``, ``run_checks``, ``run_in_order``,
``lane_plan``, ``available_checks``) is :mod:`trainguard.session`'s job, above the drills and the
profile it also runs."""
