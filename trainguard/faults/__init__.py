"""Fault injection for drills: one module per fault kind, plus the Toxiproxy-compatible proxy.

See :mod:`trainguard.faults.base` for the contract every fault follows (``Fault``,
``FaultContext``, ``FaultUnavailable``: imported from there), docs/drills.md and the fault pages
it links.

This package imports nothing: the FUSE daemon (``python -m trainguard.faults.fusefs``, started at
every mount of ``crash_points`` and the storage faults) imports it, and the fault contract would
bring the config schema with it (0.3 s of one core at each mount).
"""
