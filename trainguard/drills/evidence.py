"""What a drill's report holds, as typed records (:class:`trainguard.evidence.Evidence`): the
fields every drill has (:class:`DrillEvidence`), and one record per expectation that adds its
judge's findings (:class:`RecoverEvidence`, :class:`FailCleanEvidence`, ...). ``to_dict()`` is
the report's ``evidence`` object, key for key (docs/drills.md names each key); a key a report
holds only sometimes is a field left :data:`~trainguard.evidence.UNSET`.

Nested parts another module computes are its records (a trajectory comparison, a checkpoint
comparison, the samples' accounting); a non-finite value's spread (:class:`NumericsEvidence`),
Ray Train's restart (:class:`RayRestart`) and a soak's faults and measurements
(:class:`SoakFaultOutcome`, :class:`SoakMeasured`) are records here; a fault's own record stays
the dict its ``evidence()`` gives. A drill's report object is a :class:`DrillReport` (its spec's
keys, then its judge's record), a soak's a :class:`SoakReport` (several seeds:
:class:`SoakRuns`), a drill of a Slurm job's a :class:`SlurmDrillEvidence` (or
:class:`SlurmStepNotReached`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from trainguard.checks.accounting import AccountingEvidence
from trainguard.checks.divergence import DivergenceEvidence
from trainguard.checks.equivalence_records import TrajectoryEvidence
from trainguard.checks.invariants_check import FindingEvidence
from trainguard.evidence import MERGED, TRAILING, UNSET, Evidence, NoEvidence, Recorded, Unset
from trainguard.faults.kill_during_save import HeldWrite, LatestComplete
from trainguard.faults.sdc import Flip
from trainguard.faults.soak import SoakEvent
from trainguard.faults.storage import StruckCheckpoint
from trainguard.launch.reach import ReachClient
from trainguard.unit.checkpoints.compare import StateEvidence

__all__ = [
    "DRILL_RECORDS",
    "AttemptEvidence",
    "CheckpointIntact",
    "ContinueEvidence",
    "Detected",
    "DrillEvidence",
    "DrillFinding",
    "DrillReport",
    "ExitEvidence",
    "ExitOfRank",
    "FailCleanEvidence",
    "FaultNotSetUp",
    "FirstNonfinite",
    "ForecastInputs",
    "NonfiniteEvidence",
    "NonfiniteOnRank",
    "NumericsEvidence",
    "PreemptionTimeline",
    "PutInto",
    "RayRecoverEvidence",
    "RayRestart",
    "RecoverEvidence",
    "ReferenceFailed",
    "ReferenceNotUsable",
    "RestartCosts",
    "Resume",
    "SaveAndExitEvidence",
    "SaveUnderKill",
    "SilentCorruptionEvidence",
    "SlurmAttemptSpan",
    "SlurmDrillBase",
    "SlurmDrillEvidence",
    "SlurmInjection",
    "SlurmStepNotReached",
    "SoakEvidence",
    "SoakFaultOutcome",
    "SoakForecast",
    "SoakMeasured",
    "SoakReport",
    "SoakRuns",
    "StepRate",
    "StepsLost",
    "StorageRestart",
    "StorageResumeEvidence",
]


@dataclass
class ExitOfRank(Evidence):
    """How one rank of a launch ended: its exit code (None: torn down), the signal that killed it
    and whether trainguard sent it."""

    rank: int
    returncode: int | None
    signal: str | None
    killed_by_trainguard: bool


@dataclass
class AttemptEvidence(Evidence):
    """One launch of the job (an attempt of the drilled run, a verification or resume run)."""

    outcome: str
    reason: str | None
    exits: list[ExitOfRank]
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
    #: a hang's culprit rank(s) and what each rank was doing (docs/drills.md "Which rank hung")
    culprits: list[int] | Unset = UNSET
    attribution: str | Unset = UNSET

    def attributed(self, found: Any) -> None:
        """Take a hung run's attribution (``evidence["attribution"]``), when it has one."""
        if isinstance(found, dict) and found.get("summary"):
            self.culprits, self.attribution = list(found["culprits"]), found["summary"]


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
    #: where the step records of the restart that parted first differ from the uninterrupted run's
    first_divergence: DivergenceEvidence | Unset = UNSET


@dataclass
class RayRestart(Evidence):
    """What Ray Train did after a worker's fault, read from the driver's stderr (seconds after
    the fault): its FailureConfig, the workers (rank -> pid) before and after, the controller's
    notice, the restart, the first step after it and where it resumed."""

    max_failures: int
    workers_at_fault: dict[int, int]
    restarts: int | Unset = UNSET
    workers_after: dict[int, int] | Unset = UNSET
    failure_noticed_after_s: float | Unset = UNSET
    failure_notice: str | Unset = UNSET
    restart_started_after_s: float | Unset = UNSET
    workers_up_after_s: float | Unset = UNSET
    resume: Resume | Unset = UNSET
    first_step_after_s: float | Unset = UNSET
    #: node_loss: the step the new group resumed after, done but its line lost with the node
    unreported_steps: list[int] | Unset = UNSET


@dataclass
class RayRecoverEvidence(RecoverEvidence):
    """recover of a ray_train job: Ray Train's restart of its worker group inside one fit."""

    ray: RayRestart | Unset = UNSET


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
class FirstNonfinite(Evidence):
    """The first non-finite metric value a run printed (``value``: its text, ``nan``/``inf``)."""

    step: int
    rank: int
    metric: str
    value: str


@dataclass
class NonfiniteOnRank(Evidence):
    """The non-finite metric values of one rank: the first step, the metric, the steps (the
    first 50) and how many steps there were."""

    first_step: int
    metric: str
    steps: list[int]
    count: int


@dataclass
class PutInto(Evidence):
    """Where a numerics drill put its value: the rank, the step that took it, the target
    (``loss``/``grads``), the value and the call it went in through."""

    rank: int
    step: int
    target: str
    value: str
    via: str | None


@dataclass
class NumericsEvidence(Evidence):
    """Non-finite metric values per rank after a numerics fault
    (:func:`trainguard.drills.nonfinite.numerics_evidence`): the first, the ones after the step
    that took the value, the ranks it reached."""

    first_nonfinite: FirstNonfinite | None
    nonfinite_by_rank: dict[int, NonfiniteOnRank]
    later_nonfinite_points: int
    later_nonfinite_steps: list[int]
    later_nonfinite_ranks: list[int]
    reached_ranks: list[int]
    reached_every_rank: bool
    put_into: PutInto | Unset = UNSET


@dataclass
class NonfiniteEvidence(ExitEvidence):
    """handle_nonfinite: where the value was put and where non-finite metrics showed."""

    numerics: NumericsEvidence | Unset = UNSET


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
class SoakFaultOutcome(Evidence):
    """One scheduled fault of a soak (its :class:`~trainguard.faults.soak.SoakEvent`): the
    attempt it struck and the step after which, how that attempt ended, where the next one
    resumed, the steps and seconds it cost, or why it could not be injected."""

    index: int
    kind: str
    rank: int
    step: int
    attempt: int | None
    injected_after_step: int | None
    attempt_ended: str | Unset = UNSET
    resumed_from_step: int | Unset = UNSET
    lost_steps: int | Unset | None = UNSET
    fault_to_first_step_after_restart_s: float | Unset = UNSET
    error: str | Unset = UNSET


@dataclass
class RestartCosts(Evidence):
    """Seconds from a fault to the first step after the restart, over a soak's faults."""

    median: float
    mean: float
    max: float


@dataclass
class StepsLost(Evidence):
    """Steps of progress a soak's faults cost: in all, and the mean per fault."""

    total: int
    mean: float


@dataclass
class ForecastInputs(Evidence):
    """What the goodput model was given for a soak's faults."""

    restart_s_by_kind: dict[str, float]
    interval_s: float
    faults: int
    #: how the lost work per fault was taken
    lost_per_fault: str


@dataclass
class SoakForecast(Evidence):
    """The goodput model's wall-clock and goodput for the faults a soak saw, and how far its
    wall-clock is from the soak's (:func:`trainguard.drills.soak.forecast_for`)."""

    wall_s: float
    goodput: float
    inputs: ForecastInputs
    wall_error: float | None


@dataclass
class SoakMeasured(Evidence):
    """What a soak measured for the goodput forecast (:func:`trainguard.drills.soak.soak_lines`
    says it in words): wall-clock against failure-free, restart costs, steps lost, the
    checkpoint cadence and save time, and the model's forecast for the same faults."""

    wall_s: float
    failure_free_wall_s: float
    #: how the failure-free wall-clock was taken
    failure_free_basis: str
    goodput: float | None
    #: faults that struck
    faults: int
    restart_s: RestartCosts | None
    lost_steps: StepsLost | None
    step_s: float | None
    checkpoint_every_steps: int | None
    checkpoint_save_s: float | None
    forecast: SoakForecast | Unset = UNSET


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
    faults: list[SoakFaultOutcome] | Unset = UNSET
    measured: SoakMeasured | Unset = UNSET
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


@dataclass
class Detected(Evidence):
    """detect: how the job's own defence reported a silent corruption, and when."""

    #: ``pattern`` (a line matching detect_pattern) or ``exit`` (a rank exited non-zero)
    how: str
    #: the rank that printed the line, or the first that failed
    rank: int | None
    #: the last optimizer step printed before it reported (the flip's step - 1: in the step itself)
    last_step_printed: int | None
    #: the matching line, or the run's end
    said: str


@dataclass
class SilentCorruptionEvidence(DrillEvidence):
    """caught and detect (``fault: sdc``): the bit flipped, and what named it: the replica
    invariant, the first divergence from the uninterrupted run, or the job's own defence."""

    #: the first flip as the start-up hook wrote it (rank, step, target, tensor, index, bit, old, new)
    flipped: Flip | None = None
    #: flips in all (a persistent stuck bit: one per step that it changed)
    flips: int = 0
    #: the replica invariant's findings on the drill's run (at most 20)
    replica_findings: list[FindingEvidence] = field(default_factory=list)
    #: the drill's run against the uninterrupted reference, step records compared
    first_divergence: DivergenceEvidence | Unset = UNSET
    #: why the replicas cannot show a flip that the reduction averaged into every rank
    replicas_blind: str | Unset = UNSET
    #: detect: what the job's defence did, and when
    detected: Detected | Unset = UNSET


#: what a drill's judge (or its early error) records, the most specific record first
DrillFinding = (RayRecoverEvidence | RecoverEvidence | StorageResumeEvidence | SaveAndExitEvidence
                | SilentCorruptionEvidence | NonfiniteEvidence | FailCleanEvidence | ExitEvidence | ContinueEvidence | DrillEvidence | ReferenceFailed
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
    #: the faults the seed scheduled
    schedule: list[SoakEvent]
    found: SoakEvidence | ReferenceNotUsable | Unset = field(default=UNSET, metadata=MERGED)


@dataclass
class SoakRuns(Evidence):
    """A soak of several seeds: each run's report object under ``runs``."""

    fault: str
    seeds: list[int]
    runs: list[SoakReport]


@dataclass
class SlurmInjection(Evidence):
    """How a drill of a Slurm job injected its fault: the command, and for ``node_down`` the
    node, its state before the RESUME and how long it was down."""

    command: str
    node: str | Unset = UNSET
    node_state_before_resume: str | Unset = UNSET
    down_s: float | Unset = UNSET


@dataclass
class SlurmAttemptSpan(Evidence):
    """One attempt of a Slurm job (``SLURM_RESTART_COUNT``), its node and the steps it printed."""

    restart: int
    host: str
    first_step: int | None
    last_step: int | None


@dataclass
class SlurmDrillBase(Evidence):
    """What every report of a drill of a Slurm job holds: the fault, when, the job and its log
    (:mod:`trainguard.queue.slurm_drill`)."""

    fault: str
    after_step: int
    steps: int
    job_id: str
    log: str


@dataclass
class SlurmDrillEvidence(SlurmDrillBase):
    """A drill of a Slurm job, judged as a recover drill: the injection, the job's final state
    and restarts, its attempts, the steps lost, the trajectory against the uninterrupted run and
    the time from the fault to the first new step (each once it is known)."""

    fault_evidence: SlurmInjection | Unset = UNSET
    injected_step: int | Unset = UNSET
    #: Slurm's final state of the job and its requeues (None: Slurm did not say)
    state: str | Unset | None = UNSET
    restarts: int | Unset | None = UNSET
    attempts: list[SlurmAttemptSpan] | Unset = UNSET
    lost_steps: int | Unset = UNSET
    #: trained and checkpointed before a requeue, their lines never in the log
    steps_trained_but_not_in_the_log: list[int] | Unset = UNSET
    trajectory: TrajectoryEvidence | Unset = UNSET
    likely_causes: list[str] | Unset = UNSET
    fault_to_first_step_after_restart_s: float | Unset | None = UNSET


@dataclass
class SlurmStepNotReached(SlurmDrillBase):
    """The Slurm job ended or the drill timed out before the job printed the step the fault
    waits for: Slurm's account of the job then."""

    #: :meth:`~trainguard.queue.slurm.SlurmBackend.status`'s evidence (state, source, restarts, ...)
    state: dict[str, str | int]


#: the records a drill's result holds (``config.registry.Check.evidence`` of the drills)
DRILL_RECORDS: tuple[type[Evidence], ...] = (DrillReport, SoakReport, SoakRuns, SlurmDrillEvidence,
                                             SlurmStepNotReached, Recorded)
