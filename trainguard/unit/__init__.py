"""Seeded model/loss unit tests: seeding, assertions, strategies, DDP gradient equivalence,
state round trip (docs/unit-testing.md)."""
