"""How large the first difference of a failed resume is, and what that size rules in or out.

A lost data position or RNG state changes the loss of the first resumed step by as much as one
batch differs from another; a job that is not bitwise deterministic parts from its uninterrupted
run in the last digits; a learning rate a little off after the resume drifts, step by step,
just beyond the calibrated same-seed spread. The size of the first difference, next to the
printed value and the calibrated spread there, is an observation the resume diagnosis weighs
(:func:`trainguard.checks.diagnosis.diagnose_resume`) where no step record shows the cause.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DRIFT_RATIO", "ROUNDING_REL", "DifferenceSize", "Weight"]

#: a relative difference at most this is rounding: a float32 loss's last few units, a float64's many
ROUNDING_REL = 1e-6
#: a first difference beyond the calibrated band by less than this many same-seed spreads is a drift
DRIFT_RATIO = 30.0


@dataclass(frozen=True)
class Weight:
    """One piece of evidence for (``points`` > 0) or against (``points`` < 0) a cause."""

    key: str
    points: int
    why: str


@dataclass(frozen=True)
class DifferenceSize:
    """The first divergent step of a failed resume's metric and both runs' values there."""

    metric: str
    step: int
    resumed: float
    reference: float
    #: the difference in same-seed spreads calibrated at ``step`` (None: not calibrated there)
    spread_ratio: float | None = None

    @property
    def relative(self) -> float:
        scale = max(abs(self.resumed), abs(self.reference))
        return abs(self.resumed - self.reference) / scale if scale > 0 else 0.0

    def weights(self, boundary: int) -> list[Weight]:
        """What the size says, given the first resumed step ``boundary``: nothing when it says
        nothing (a large difference, or one where either reading fits)."""
        values = f"{self.resumed!r} vs {self.reference!r}"
        if self.spread_ratio is None and self.step >= boundary and self.relative <= ROUNDING_REL:
            why = (f"step {self.step}'s {self.metric} differs from the uninterrupted run's in its last digits "
                   f"only ({values}, relative {self.relative:.1g}): sums taken in another order part so; a lost "
                   "data position or RNG changes a loss by as much as one batch differs from another")
            if self.step == boundary:
                return [Weight("nondeterministic", 2, why), Weight("data_position", -1, why), Weight("rng", -1, why)]
            # a step later a learning rate a little off parts the same way: calibration tells them apart
            return [Weight("nondeterministic", 1, why + "; a learning rate a little off after the resume can "
                           "too, a step later: `trainguard calibrate` measures the job's own noise to tell them apart")]
        if self.spread_ratio is not None and self.step > boundary and self.spread_ratio < DRIFT_RATIO:
            agree = self.step - boundary
            why = (f"the resumed run stays within the calibrated same-seed spread for {agree} resumed "
                   f"step{'s' if agree > 1 else ''} and drifts just beyond it at step {self.step} "
                   f"({self.spread_ratio:.1f}x the spread there; {values}): a small change in every update "
                   "after the resume (a learning rate or another hyperparameter a little off), not a lost data "
                   "position or RNG, which move the first resumed step beyond the spread, nor the job's noise, "
                   "which the spread measured")
            return [Weight("scheduler", 1, why), Weight("data_position", -1, why), Weight("rng", -1, why),
                    Weight("nondeterministic", -1, why)]
        return []
