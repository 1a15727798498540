"""Submission to a production scheduler queue: the spec, the result, the backend protocol.

A backend takes a :class:`SubmissionSpec` (what to run, with which resources, linked to which
gate report and MLflow run) and returns a :class:`Submission` (job id, status, links, and the
reason when it was not or cannot be scheduled). Backends: ``ray`` (Ray Jobs API,
:mod:`trainguard.raytrain.ray_jobs`) and ``slurm`` (an sbatch script, :mod:`trainguard.queue.slurm`),
picked by name with :func:`trainguard.queue.backends.get_backend`.
"""

from __future__ import annotations

import math
import re
import shlex
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

from trainguard.errors import TrainguardError, UsageError
from trainguard.unit.checkpoints import latest_complete_checkpoint

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping

    from trainguard.config import JobFile
    from trainguard.config.schema import PlaceholderValues

__all__ = [
    "TERMINAL_STATUSES",
    "QueueBackend",
    "Submission",
    "SubmissionError",
    "SubmissionSpec",
    "SubmissionStatus",
    "spec_from_job",
    "torchrun_argv",
]

#: ``submitted``: accepted by the queue, not yet seen running; ``pending``: waiting for free
#: resources the cluster does have; ``unschedulable``: asks for more than the cluster can ever
#: give (not submitted, or submitted and stopped); ``not_submitted``: the backend's tool is absent
#: (the script/command is in the result for a person to submit).
SubmissionStatus = Literal[
    "submitted",
    "pending",
    "running",
    "succeeded",
    "failed",
    "stopped",
    "unschedulable",
    "not_submitted",
    "unknown",
]
#: the statuses after which a job's state no longer changes
TERMINAL_STATUSES = frozenset({"succeeded", "failed", "stopped", "unschedulable", "not_submitted"})

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class SubmissionError(TrainguardError):
    """The queue could not be reached or refused the request (message says which and the fix)."""


@dataclass
class SubmissionSpec:
    """What to submit: the job's per-process command and the sized resources.

    ``entrypoint`` is the command one rank runs (the job file's ``command`` with placeholders
    filled). With ``launcher="torchrun"`` a backend starts ``world_size`` ranks of it through
    torchrun (``python x.py`` becomes ``torchrun ... x.py``, as trainguard's own runner does);
    with ``launcher="direct"`` the entrypoint is run once as given (a Ray Train driver, or a
    script that starts its own ranks).

    Resources are per rank: ``num_gpus``/``num_cpus`` each of ``world_size`` ranks needs, spread
    over ``nodes`` nodes. ``time_limit_s`` is the predicted wall-clock (the Slurm backend adds its
    margin). ``resume`` appends ``resume_args`` (a resubmission that continues from the latest
    checkpoint); the Slurm script appends them itself when Slurm requeues the job.
    """

    entrypoint: list[str]
    job_name: str
    working_dir: Path = field(default_factory=Path.cwd)
    env: dict[str, str] = field(default_factory=dict)
    num_gpus: float = 0.0
    num_cpus: float = 1.0
    world_size: int = 1
    nodes: int = 1
    launcher: Literal["torchrun", "direct"] = "torchrun"
    time_limit_s: float | None = None
    resume_args: list[str] = field(default_factory=list)
    resume: bool = False
    gate_report: str | None = None
    mlflow_run_id: str | None = None
    metadata: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.working_dir = Path(self.working_dir)
        if isinstance(self.entrypoint, str):
            self.entrypoint = shlex.split(self.entrypoint)
        self.entrypoint = [str(t) for t in self.entrypoint]
        self.resume_args = [str(t) for t in self.resume_args]
        problems = []
        if not self.entrypoint:
            problems.append("entrypoint is empty; give the command one rank runs")
        if not _NAME.match(self.job_name):
            problems.append(
                f"job_name {self.job_name!r} must be 1-128 letters, digits, '.', '_' or '-' "
                "(schedulers put it in file names and job names)"
            )
        if self.world_size < 1:
            problems.append(f"world_size must be >= 1, got {self.world_size}")
        if self.nodes < 1:
            problems.append(f"nodes must be >= 1, got {self.nodes}")
        elif self.world_size % self.nodes:
            problems.append(
                f"world_size {self.world_size} is not a multiple of nodes {self.nodes}: "
                "every node runs the same number of ranks"
            )
        if self.num_gpus < 0 or self.num_cpus < 0:
            problems.append(f"num_gpus/num_cpus must be >= 0, got {self.num_gpus}/{self.num_cpus}")
        if self.time_limit_s is not None and self.time_limit_s <= 0:
            problems.append(f"time_limit_s must be > 0 seconds, got {self.time_limit_s}")
        if self.launcher not in ("torchrun", "direct"):
            problems.append(f"launcher must be 'torchrun' or 'direct', got {self.launcher!r}")
        for key, value in {**self.env, **self.metadata}.items():
            if not isinstance(key, str) or not isinstance(value, str):
                problems.append(f"env/metadata must map str to str, got {key!r}: {value!r}")
        if problems:
            raise UsageError("invalid SubmissionSpec: " + "; ".join(problems))

    @property
    def ranks_per_node(self) -> int:
        """Ranks each node runs (``world_size`` spread evenly over ``nodes``)."""
        return self.world_size // self.nodes

    @property
    def gpus_per_node(self) -> int:
        """Whole GPUs one node must have (schedulers allocate whole devices)."""
        return math.ceil(self.num_gpus * self.ranks_per_node)

    @property
    def cpus_per_node(self) -> int:
        """Whole CPUs one node must have (at least one)."""
        return max(1, math.ceil(self.num_cpus * self.ranks_per_node))

    def rank_argv(self) -> list[str]:
        """The per-rank command, with ``resume_args`` when ``resume`` is set."""
        return [*self.entrypoint, *(self.resume_args if self.resume else [])]

    def labels(self) -> dict[str, str]:
        """Metadata a queue stores with the job: the links back to the gate's evidence."""
        labels = {"trainguard.job": self.job_name}
        if self.gate_report:
            labels["trainguard.gate_report"] = str(self.gate_report)
        if self.mlflow_run_id:
            labels["trainguard.mlflow_run_id"] = self.mlflow_run_id
        labels.update(self.metadata)
        return labels


@dataclass
class Submission:
    """What a backend did with a spec (also the answer to ``status(job_id)``)."""

    backend: str
    status: SubmissionStatus
    message: str
    job_id: str | None = None
    #: where a person looks next: dashboard page, logs URL, script file, ...
    links: dict[str, str] = field(default_factory=dict)
    #: the sbatch script (Slurm) or the entrypoint command line (Ray)
    script: str | None = None
    evidence: dict[str, Any] = field(default_factory=dict)
    submitted_at: float | None = None
    #: how the gate's submission went where it went (a dry run on an embedded Ray head); None:
    #: nothing to add, and not written
    note: str | None = None

    @property
    def accepted(self) -> bool:
        """True when the queue holds the job (whatever it is doing now)."""
        return self.job_id is not None and self.status not in ("unschedulable", "not_submitted")

    @property
    def terminal(self) -> bool:
        """True when the job's state will not change any more."""
        return self.status in TERMINAL_STATUSES

    def to_dict(self) -> dict[str, Any]:
        """The submission as plain JSON-ready data."""
        out = asdict(self)
        if self.note is None:
            del out["note"]
        return out


@runtime_checkable
class QueueBackend(Protocol):
    """A production scheduler queue."""

    name: str

    def submit(self, spec: SubmissionSpec) -> Submission:
        """Submit ``spec``; never waits longer than the backend's configured bound."""
        ...

    def status(self, job_id: str) -> Submission:
        """The job's current state as the queue reports it."""
        ...

    def wait(self, job_id: str, timeout: float) -> Submission:
        """Follow the job until a terminal state or ``timeout`` seconds, whichever comes first;
        the last status either way (never waits longer)."""
        ...


def torchrun_argv(
    argv: list[str],
    *,
    nproc_per_node: int,
    nnodes: int | str = 1,
    rdzv_endpoint: str | None = None,
    rdzv_id: str | None = None,
) -> list[str]:
    """``python x.py ARGS`` as ``torchrun ... x.py ARGS`` (the form trainguard's runner uses);
    any other command is returned unchanged (it starts its own ranks).

    Single node: ``--standalone``; several: a c10d rendezvous at ``rdzv_endpoint``.
    """
    if not argv or Path(argv[0]).name not in ("python", "python3"):
        return list(argv)
    head = ["torchrun", f"--nproc-per-node={nproc_per_node}"]
    if nnodes == 1 or rdzv_endpoint is None:
        head.append("--standalone")
    else:
        head += [f"--nnodes={nnodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_endpoint}"]
        if rdzv_id:
            head.append(f"--rdzv-id={rdzv_id}")
    return [*head, *argv[1:]]


# documented keyword-only API (docs/queue.md): its options are its parameters (pyproject.toml, PLR0913)
def spec_from_job(  # noqa: PLR0913
    job_file: JobFile,
    values: PlaceholderValues,
    *,
    world_size: int | None = None,
    nodes: int = 1,
    num_gpus: float = 0.0,
    num_cpus: float = 1.0,
    time_limit_s: float | None = None,
    gate_report: str | None = None,
    mlflow_run_id: str | None = None,
    extra_args: Iterable[str] = (),
    metadata: Mapping[str, str] | None = None,
) -> SubmissionSpec:
    """The spec of a job file's production run: its ``command`` (+ ``extra_args``), ``env`` and
    ``resume_args`` with the placeholders filled from ``values`` (``steps``, ``checkpoint_dir``,
    ... as the runner's ``placeholders()`` gives them), run in the job's ``cwd``, at the sized
    resources. ``world_size`` defaults to the job's own."""
    job = job_file.job
    world = world_size or job.world_size
    filled: dict[str, str | int] = {**values, "world_size": world}
    if "latest_checkpoint" not in filled and "checkpoint_dir" in filled:
        # resolved when the spec is built: a resubmission resumes from what is newest now
        latest = latest_complete_checkpoint(Path(str(filled["checkpoint_dir"])))
        filled["latest_checkpoint"] = str(latest or filled["checkpoint_dir"])
    return SubmissionSpec(
        entrypoint=job_file.argv(filled, extra_args=extra_args),
        job_name=job.name,
        working_dir=job_file.cwd,
        env={k: str(v) for k, v in zip(job.env, job_file.render(job.env.values(), filled))},
        num_gpus=num_gpus,
        num_cpus=num_cpus,
        world_size=world,
        nodes=nodes,
        time_limit_s=time_limit_s,
        resume_args=job_file.render(job.resume_args, filled),
        gate_report=gate_report,
        mlflow_run_id=mlflow_run_id,
        metadata=dict(metadata or {}),
    )
