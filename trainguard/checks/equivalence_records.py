"""The records the equivalence checks (determinism, resume, parallel) write to their reports, and
the trajectory comparison every check that compares runs reports (:class:`TrajectoryEvidence`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from trainguard.checks.accounting import AccountingEvidence
from trainguard.checks.calibration import ToleranceEvidence
from trainguard.checks.diagnosis import CauseEvidence, ResumeDiagnosis
from trainguard.checks.divergence import DivergenceEvidence
from trainguard.checks.interruption import InterruptionEvidence
from trainguard.evidence import MERGED, UNSET, Evidence, StartedAhead, Unset
from trainguard.unit.checkpoints.compare import StateEvidence

__all__ = [
    "ChainCycle",
    "ChainEvidence",
    "DeterminismEvidence",
    "KillUntested",
    "NoCheckpointLeft",
    "ParallelEvidence",
    "ResumeEvidence",
    "RunFailure",
    "Tolerance",
    "TrajectoryEvidence",
]


@dataclass
class TrajectoryEvidence(Evidence):
    """How two trajectories of one metric compared (``checks.equivalence.TrajectoryDiff.as_evidence``)."""

    metric: str
    compared_steps: int
    first_divergent_step: int | None
    #: (actual, expected) at the first divergent step
    values_at_first_divergence: list[float] | None
    max_abs_diff: float
    max_rel_diff: float
    #: the first 20 steps the compared run lacks
    missing_steps: list[int]
    #: steps a rank checkpointed and then died before printing (a drill's restarts): not missing
    unprinted_resumed_steps: list[int] | Unset = UNSET


@dataclass
class Tolerance(Evidence):
    rtol: float
    atol: float


@dataclass
class RunFailure(Evidence):
    """A check's run did not complete: the launcher's account of it (its findings merged in)."""

    outcome: str
    reason: str
    failed_rank: int | None
    stderr_tail: str
    run_dir: str
    launcher: dict[str, Any] = field(default_factory=dict, metadata=MERGED)


@dataclass
class KillUntested(Evidence):
    """The resume check's kill tested no resume (the killed run ended before the step)."""

    stderr_tail: str
    killed_after_step: int | None
    killed_run_outcome: str
    run_dir: str
    not_kept: str


@dataclass
class NoCheckpointLeft(Evidence):
    """The killed run left no complete checkpoint to resume from: nothing was resumed."""

    killed_after_step: int | None
    checkpoint_dir: str
    interruption: InterruptionEvidence
    stderr_tail: str
    likely_causes: list[str]
    diagnosis: list[CauseEvidence]


@dataclass
class DeterminismEvidence(Evidence):
    """The determinism check's evidence (docs/determinism-and-resume.md)."""

    seed: int
    steps: int
    tolerance: Tolerance
    #: ``TrajectoryDiff.as_evidence`` per metric
    metrics: list[TrajectoryEvidence]
    run_dirs: list[str]
    #: per run that started beside the check before it (run dir -> what it overlapped)
    started_ahead: dict[str, StartedAhead] | Unset = UNSET
    #: how the two runs' drawn samples differ
    samples: str | Unset = UNSET
    #: where the two runs' step records first differ (or why they were not compared)
    first_divergence: DivergenceEvidence | Unset = UNSET
    likely_causes: list[str] | Unset = UNSET


@dataclass
class ResumeEvidence(Evidence):
    """The resume check's evidence (docs/determinism-and-resume.md)."""

    after_step: int
    killed_after_step: int | None
    #: reference, killed (or kept_from: the run its checkpoint was kept from), resumed
    run_dirs: dict[str, str]
    #: how the checkpoint resumed from was made (:meth:`Interruption.as_evidence`)
    interruption: InterruptionEvidence | Unset = UNSET
    resumed_from_step: int | Unset = UNSET
    steps_lost: int | Unset = UNSET
    #: the checkpoint the resumed run was given ({latest_checkpoint})
    resumed_from_checkpoint: str | Unset = UNSET
    trajectory: TrajectoryEvidence | Unset = UNSET
    #: :meth:`~trainguard.checks.calibration.ToleranceUsed.as_evidence`: what was allowed, and why
    tolerance: ToleranceEvidence | Unset = UNSET
    #: ``TrajectoryDiff.as_evidence`` of every other metric compared (``checks.resume.metrics``)
    other_metrics: list[TrajectoryEvidence] | Unset = UNSET
    #: the final checkpoints compared
    state: StateEvidence | Unset = UNSET
    #: :meth:`SampleAccounting.as_evidence`: samples trained twice or never, per epoch
    sample_accounting: AccountingEvidence | Unset = UNSET
    #: what the diagnosis read (learning rates, samples, checkpoint contents)
    diagnosis: ResumeDiagnosis | Unset = field(default=UNSET, metadata=MERGED)
    likely_causes: list[str] | Unset = UNSET


@dataclass
class ChainCycle(Evidence):
    """One cycle of a chained resume: the run resumed from the cycle before's checkpoint (the
    first: a fresh start), killed after ``cut`` (the last: run to the end)."""

    cycle: int
    #: the step it was killed after as asked (None: the last cycle, run to the end)
    cut: int | None
    resumed_from_step: int
    killed_after_step: int | None
    #: :meth:`TrajectoryDiff.as_evidence` per metric compared, the progress metric first
    metrics: list[TrajectoryEvidence]
    run_dir: str


@dataclass
class ChainEvidence(Evidence):
    """The chained resume check's evidence (docs/equivalence.md, "Chained resumes")."""

    chain: list[int]
    cycles: list[ChainCycle]
    reference_run_dir: str
    #: :meth:`~trainguard.checks.calibration.ToleranceUsed.as_evidence`: what was allowed, and why
    tolerance: ToleranceEvidence
    #: the final checkpoints compared
    state: StateEvidence | Unset = UNSET
    #: :meth:`SampleAccounting.as_evidence` over the cycles run: samples trained twice or never
    sample_accounting: AccountingEvidence | Unset = UNSET
    failing_cycle: int | Unset = UNSET
    #: where the failing cycle's step records first differ from the uninterrupted run's
    first_divergence: DivergenceEvidence | Unset = UNSET
    likely_causes: list[str] | Unset = UNSET


@dataclass
class ParallelEvidence(Evidence):
    """The parallel check's evidence (docs/parallel.md)."""

    world_size: int
    ranks_reporting: list[int]
    #: :meth:`~trainguard.checks.calibration.ToleranceUsed.as_evidence`
    tolerance: ToleranceEvidence
    trajectory: TrajectoryEvidence
    #: world size -> run dir
    run_dirs: dict[str, str]
    started_ahead: dict[str, StartedAhead] | Unset = UNSET
    likely_causes: list[str] | Unset = UNSET
    samples: str | Unset = UNSET
    #: where the N-rank run's step records first part from the 1-rank run's (whole runs, sums of
    #: squares within the calibrated spread or a default tolerance), or why they were not compared
    first_divergence: DivergenceEvidence | Unset = UNSET
