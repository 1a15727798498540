"""What a drill's report holds, as typed records (:class:`trainguard.evidence.Evidence`): the
fields every drill has (:class:`DrillEvidence`), and one record per expectation that adds its
judge's findings (:class:`RecoverEvidence`, :class:`FailCleanEvidence`, ...). ``to_dict()`` is
the report's ``evidence`` object, key for key (docs/drills.md names each key); a key a report
holds only sometimes is a field left :data:`~trainguard.evidence.UNSET`.

Nested parts another module computes are its records (a trajectory comparison, a checkpoint
comparison, the samples' accounting); a fault's own record, a non-finite value's spread and a
soak's measurements stay the dicts their ``evidence()`` gives. A drill's report object is a
:class:`DrillReport` (its spec's keys, then its judge's record), a soak's a :class:`SoakReport`
(several seeds: :class:`SoakRuns`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from trainguard.checks.accounting import AccountingEvidence
from trainguard.checks.equivalence_records import TrajectoryEvidence
from trainguard.evidence import MERGED, TRAILING, UNSET, Evidence, NoEvidence, Recorded, Unset
from trainguard.faults.kill_during_save import HeldWrite, LatestComplete
from trainguard.faults.storage import StruckCheckpoint
from trainguard.launch.reach import ReachClient
from trainguard.unit.checkpoints.compare import StateEvidence

__all__ = [
    "DRILL_RECORDS",
    "AttemptEvidence",
    "CheckpointIntact",
    "ContinueEvidence",
    "DrillEvidence",
    "DrillFinding",
    "DrillReport",
    "ExitEvidence",
    "FailCleanEvidence",
    "FaultNotSetUp",
    "NonfiniteEvidence",
    "PreemptionTimeline",
    "RayRecoverEvidence",
    "RecoverEvidence",
    "ReferenceFailed",
    "ReferenceNotUsable",
    "Resume",
    "SaveAndExitEvidence",
    "SaveUnderKill",
    "SoakEvidence",
    "SoakReport",
    "SoakRuns",
    "StepRate",
    "StorageRestart",
    "StorageResumeEvidence",
]


@dataclass
class AttemptEvidence(Evidence):
    """One launch of the job (an attempt of the drilled run, a verification or resume run)."""

    outcome: str
    reason: str | None
    #: ``{"rank", "returncode", "signal", "killed_by_trainguard"}`` per rank
    exits: list[dict[str, Any]]
    last_step: int | None
    duration_s: float
    run_dir: str
    failed_rank: int | Unset | None = UNSET
    #: the fault's words for how the run ended (:meth:`Fault.classify`)
    classified: str | Unset = UNSET
    stderr_tail: str | Unset = UNSET
    #: the ranks whose Python stacks trainguard dumped (a hang), and the stacks' tails
    stacks_dumped: list[int] | Unset = UNSET
    stacks: dict[Any, str] | Unset = UNSET


@dataclass
class StepRate(Evidence):
    """The watched rank's step rate before, during and after the fault (steps per second)."""

    unit: str
    before: float | None
    during: float | None
    #: the job finished its steps inside the fault's window: "during" ends at its last step
    during_until_last_step: bool | Unset = UNSET
    last_step_at_s: float | Unset | None = UNSET
    after_clear: float | Unset | None = UNSET
    after_restart: float | Unset | None = UNSET
    #: continue: the floor the rate during the fault was held to, and the ratio measured
    min_rate: float | Unset = UNSET
    during_over_before: float | Unset | None = UNSET


@dataclass
class SaveUnderKill(Evidence):
    """kill_during_save: the write the kill caught and where the job resumed from."""

    held_write: HeldWrite
    #: ``{}`` when the fault could not tell
    latest_complete_at_kill: LatestComplete | NoEvidence
    kill_to_exit_s: float | None
    resumed_from_step: int | None
    killed_rank_resumed_from_step: int | Unset | None = UNSET
    kill_to_first_step_after_resume_s: float | Unset = UNSET


@dataclass
class DrillEvidence(Evidence):
    """What every drill's report holds, whatever judges it; each expectation's record extends it."""

    injected_at_s: float | None
    injected_after_step: int | None
    watched_rank: int
    #: the watched rank's progress when the fault struck (output read up to then): the monitor
    #: reads the job's lines with a lag, which grows on a loaded machine
    watched_rank_step_at_injection: int | None
    detected_after_s: float | None
    attempt_ended_after_s: float | None
    restarts: int
    attempts: list[AttemptEvidence]
    step_rate: StepRate
    #: the fault's own record (:meth:`Fault.evidence`)
    fault_evidence: dict[str, Any]
    reference_run_dir: str
    first_exit: dict[str, int | None] | Unset = UNSET
    fault_errors: list[str] | Unset = UNSET
    #: a failed drill's causes, the one the evidence shows first
    likely_causes: list[str] | Unset = field(default=UNSET, metadata=TRAILING)
    #: kill_during_save's findings, added to the expectation's own
    save: SaveUnderKill | Unset = field(default=UNSET, metadata=TRAILING)


@dataclass
class Resume(Evidence):
    """Where one restart of the job resumed."""

    last_step_before: int
    resumed_from_step: int
    lost: int
    #: the restart began again from the first step (no usable checkpoint)
    began_again: bool | Unset = UNSET


@dataclass
class RecoverEvidence(DrillEvidence):
    """recover: what the restarts lost and whether the recovered run matches."""

    lost_steps: int | Unset | None = UNSET
    resumes: list[Resume] | Unset = UNSET
    #: :meth:`TrajectoryDiff.as_evidence` (+ ``unprinted_resumed_steps``)
    trajectory: TrajectoryEvidence | Unset = UNSET
    #: the final checkpoint against the uninterrupted run's (:meth:`CheckpointDiff.as_evidence`)
    checkpoint: StateEvidence | Unset = UNSET
    #: every sample once across the attempts (:meth:`SampleAccounting.as_evidence`)
    sample_accounting: AccountingEvidence | Unset = UNSET
    fault_to_first_step_after_restart_s: float | Unset = UNSET


@dataclass
class RayRecoverEvidence(RecoverEvidence):
    """recover of a ray_train job: Ray Train's restart of its worker group inside one fit."""

    #: failure seen, new workers, first step after, the restarts and the FailureConfig
    ray: dict[str, Any] | Unset = UNSET


@dataclass
class ExitEvidence(DrillEvidence):
    """An expectation whose job must exit by itself with an error: how the first attempt ended
    (:func:`trainguard.drills.judges.exit_problems` fills it)."""

    exit_after_s: float | Unset = UNSET
    failed_rank_stderr_after_fault: str | Unset = UNSET
    #: ``"yes"``, or that the rank died of a signal
    error_reported: str | Unset = UNSET
    error_line: str | Unset = UNSET


@dataclass
class CheckpointIntact(Evidence):
    """Whether the latest checkpoint was usable: a resume from it matched."""

    intact: bool
    why: str | Unset | None = UNSET
    resumed_from_step: int | Unset | None = UNSET


@dataclass
class FailCleanEvidence(ExitEvidence):
    """fail_clean: the exit, and the resume from the latest checkpoint with the fault removed."""

    verification: AttemptEvidence | Unset = UNSET
    resumed_from_step: int | Unset | None = UNSET
    lost_steps: int | Unset | None = UNSET
    trajectory: TrajectoryEvidence | Unset = UNSET
    checkpoint: CheckpointIntact | Unset = UNSET
    #: every sample once across the failed attempt and the resume (:meth:`SampleAccounting.as_evidence`)
    sample_accounting: AccountingEvidence | Unset = UNSET


@dataclass
class ContinueEvidence(DrillEvidence):
    """continue: the run under the fault against the uninterrupted one."""

    trajectory: TrajectoryEvidence | Unset = UNSET
    exit_after_last_step_s: float | Unset | None = UNSET
    rate_note: str | Unset = UNSET


@dataclass
class PreemptionTimeline(Evidence):
    """save_and_exit: what happened between the notice and the exit."""

    grace_s: float
    last_step_before_exit: int
    exit_after_notice_s: float | Unset = UNSET
    checkpoint: str | Unset = UNSET
    checkpoint_complete_after_notice_s: float | Unset = UNSET


@dataclass
class SaveAndExitEvidence(DrillEvidence):
    """save_and_exit: the timeline after the notice and the resume from what was saved."""

    preemption: PreemptionTimeline | Unset = UNSET
    verification: AttemptEvidence | Unset = UNSET
    resumed_from_step: int | Unset = UNSET
    lost_steps: int | Unset = UNSET
    lost_steps_before_notice: int | Unset = UNSET
    trajectory: TrajectoryEvidence | Unset = UNSET
    #: ranks that died of the notice's signal (no handler) rather than saving
    died_of_the_notice: list[int] | Unset = UNSET


@dataclass
class NonfiniteEvidence(ExitEvidence):
    """handle_nonfinite: where the value was put and where non-finite metrics showed."""

    #: :func:`trainguard.drills.nonfinite.numerics_evidence` with ``put_into``
    numerics: dict[str, Any] | Unset = UNSET


@dataclass
class StorageRestart(Evidence):
    """One restart of a storage drill's recover: where it resumed and how it ended."""

    resumed_from_step: int | None
    outcome: str
    classified: str | None


@dataclass
class StorageResumeEvidence(DrillEvidence):
    """A storage fault that strikes the resume (``corrupt``, ``eio_read``): the struck file and
    what the resume did with it."""

    #: the checkpoint, file and byte the fault struck (``{}``: none)
    struck: StruckCheckpoint | NoEvidence = field(default_factory=NoEvidence)
    resume_run: AttemptEvidence | Unset = UNSET
    resumed_from_step: int | Unset | None = UNSET
    resume_error: str | Unset | None = UNSET
    struck_resumed_from_step: int | Unset | None = UNSET
    resumes: list[StorageRestart] | Unset = UNSET
    trajectory: TrajectoryEvidence | Unset = UNSET


@dataclass
class SoakEvidence(Evidence):
    """A soak's verdict and measurements (beside its seed and schedule)."""

    restarts: int
    trajectory: TrajectoryEvidence
    checkpoint: StateEvidence | Unset = UNSET
    #: every sample once across the attempts (:meth:`SampleAccounting.as_evidence`)
    sample_accounting: AccountingEvidence | Unset = UNSET
    likely_causes: list[str] | Unset = UNSET
    #: each scheduled fault: when it struck and what it cost
    faults: list[dict[str, Any]] | Unset = UNSET
    #: restart costs, steps lost, goodput and its forecast (:func:`trainguard.drills.soak.soak_lines`)
    measured: dict[str, Any] | Unset = UNSET
    drill_dir: str | Unset = UNSET
    run_dir: str | Unset = UNSET
    reference_run_dir: str | Unset = UNSET


@dataclass
class ReferenceFailed(Evidence):
    """The uninterrupted reference run failed: nothing was drilled."""

    reference: AttemptEvidence


@dataclass
class ReferenceNotUsable(Evidence):
    """The uninterrupted reference run cannot be drilled against (it failed, or printed no
    progress metric line): where it ran."""

    reference_run_dir: str


@dataclass
class FaultNotSetUp(Evidence):
    """The fault could not be set up on this machine: what it said."""

    fault_evidence: dict[str, Any]


#: what a drill's judge (or its early error) records, the most specific record first
DrillFinding = (RayRecoverEvidence | RecoverEvidence | StorageResumeEvidence | SaveAndExitEvidence
                | NonfiniteEvidence | FailCleanEvidence | ExitEvidence | ContinueEvidence | DrillEvidence | ReferenceFailed
                | ReferenceNotUsable | FaultNotSetUp | Unset)


@dataclass
class DrillReport(Evidence):
    """A drill's report object: what its spec asked, then its judge's record (or why nothing was
    judged), then where its runs are."""

    fault: str
    expect: str
    rank: int
    after_step: int
    duration: float | None
    steps: int
    ray_api: ReachClient | Unset = UNSET
    found: DrillFinding = field(default=UNSET, metadata=MERGED)
    drill_dir: str | Unset = UNSET
    #: the attempts' logs (attempt-N/)
    run_dir: str | Unset = UNSET


@dataclass
class SoakReport(Evidence):
    """One soak run's report object: its seed and schedule, then its record."""

    fault: str
    expect: str
    seed: int
    steps: int
    #: the faults the seed scheduled (:meth:`trainguard.faults.soak.SoakEvent.to_dict`)
    schedule: list[dict[str, Any]]
    found: SoakEvidence | ReferenceNotUsable | Unset = field(default=UNSET, metadata=MERGED)


@dataclass
class SoakRuns(Evidence):
    """A soak of several seeds: each run's report object under ``runs``."""

    fault: str
    seeds: list[int]
    runs: list[SoakReport]


#: the records a drill's result holds (``config.registry.Check.evidence`` of the drills); the
#: Slurm drill (``queue.slurm_drill``) keeps its keys as a :class:`~trainguard.evidence.Recorded`
DRILL_RECORDS: tuple[type[Evidence], ...] = (DrillReport, SoakReport, SoakRuns, Recorded)
