"""Throughput and scaling profiles and resource-sizing reports (docs/profiling.md).

``run_profile`` measures a job at several world sizes; ``trainguard.profiling.sizing`` turns a
profile and the job file's ``target:`` into a recommendation with a goodput forecast
(``trainguard.profiling.goodput``) and recommended timeouts; ``parse_regressions`` and
``compare_profiles`` judge a profile against this machine's saved baseline.

Each name lives in its module and is imported from there (``from trainguard.profiling.check
import profile_job``); the package imports nothing, so ``trainguard --help`` does not load numpy
or matplotlib.
"""
