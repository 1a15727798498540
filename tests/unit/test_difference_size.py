"""The size of a failed resume's first difference as evidence: last-digit differences at the first
resumed step are a job's nondeterminism, a drift just beyond the calibrated spread a small change
in every update, a large jump neither; a cause with evidence only against it ranks below neutral ones."""

from __future__ import annotations

from trainguard.checks.diagnosis import NONE, ResumeFacts, diagnose_resume
from trainguard.checks.difference_size import DifferenceSize


def _first(facts: ResumeFacts) -> str:
    return diagnose_resume(facts)[0].key


def test_a_difference_in_the_last_digits_at_the_first_resumed_step_is_the_jobs_nondeterminism() -> None:
    tiny = DifferenceSize("loss", 9, 4.58315606016942, 4.583156060169421)
    causes = diagnose_resume(ResumeFacts(8, first_divergent_step=9, difference=tiny))
    assert causes[0].key == "nondeterministic" and "last digits" in causes[0].evidence[0]
    # the planted twin: a lost data position moves the first resumed step's loss by far more
    jump = DifferenceSize("loss", 9, 4.2, 4.58)
    assert jump.weights(9) == []
    assert _first(ResumeFacts(8, first_divergent_step=9, difference=jump)) != "nondeterministic"


def test_rounding_a_step_after_the_boundary_is_only_suggestive_of_nondeterminism() -> None:
    """A loss comes before its step's update: a learning rate a little off shows a step later,
    in the last digits too. Uncalibrated, the job's noise is suggested (its sums may agree by
    chance at the first resumed step) and calibration named as what tells them apart; nothing
    is weakened."""
    later = DifferenceSize("loss", 10, 4.58315606016942, 4.583156060169421)
    (weight,) = later.weights(9)
    assert (weight.key, weight.points) == ("nondeterministic", 1) and "trainguard calibrate" in weight.why
    causes = diagnose_resume(ResumeFacts(8, first_divergent_step=10, difference=later))
    assert causes[0].key == "nondeterministic"
    # a lost optimizer state a step after the resume moves the loss by far more: nothing said
    assert DifferenceSize("loss", 10, 4.1, 4.58).weights(9) == []


def test_a_drift_just_beyond_the_calibrated_spread_after_the_resume_names_the_schedule() -> None:
    drift = DifferenceSize("loss", 11, 4.173175095889882, 4.1731750958899, spread_ratio=3.3)
    causes = diagnose_resume(ResumeFacts(8, first_divergent_step=11, difference=drift))
    assert causes[0].key == "scheduler" and "drifts just beyond" in causes[0].evidence[0]
    assert {c.key: c.strength for c in causes}["data_position"] == NONE
    # a jump far beyond the spread (a batch drawn again at an epoch boundary): the size says nothing
    jump = DifferenceSize("loss", 11, 3.9, 4.17, spread_ratio=900.0)
    assert jump.weights(9) == []
    assert _first(ResumeFacts(8, first_divergent_step=11, difference=jump)) != "scheduler"


def test_a_cause_with_evidence_only_against_it_ranks_below_the_neutral_ones() -> None:
    """Step 7 differs after step 6 matched: evidence against a lost data position and RNG; a
    checkpoint-free fallback has nothing else, so the weakened causes must not come first by order."""
    causes = diagnose_resume(ResumeFacts(5, first_divergent_step=7))
    keys = [c.key for c in causes if not c.ruled_out]
    assert keys.index("data_position") > keys.index("optimizer")
    assert keys.index("rng") > keys.index("scheduler")
