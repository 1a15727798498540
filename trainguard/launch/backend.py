"""How a job's ranks are started, restarted, signalled and observed: :class:`JobBackend`, and
:class:`CommandBackend`, the torchrun contract every ``kind: command`` job follows.

The job file's ``kind`` names a backend, looked up once
(:func:`trainguard.config.backends.backend_for`); the runner holds it, and every layer above
asks it what it needs instead of comparing the kind: how a launch's ranks become processes,
whether the ranks are the launched processes (preexec, signals, memory, stopping them while a
checkpoint is copied), who restarts a failed rank, whether runs may overlap, whether the ranks
log their own metrics, and how the production run is submitted.

The protocol lives here, in the lowest layer that knows a launch, so that the Ray Train backend
(:class:`trainguard.raytrain.backend.RayTrainBackend`) and any other backend can implement it
below the job-file layer. Making a backend starts nothing: what it starts for its runs (Ray's
embedded head) starts on first use (:meth:`JobBackend.launch_env`) and stops at
:meth:`JobBackend.close`. docs/backends.md shows how to write one.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:  # pragma: no cover
    from trainguard.launch.launcher import Launcher, LaunchSpec, RunResult

__all__ = ["CommandBackend", "JobBackend", "MetricRow", "Reconciled", "torchrun_line"]

#: one metric row as the tracker logs it: (name, value, step, timestamp in ms)
MetricRow = tuple[str, float, int, int]
#: what a backend whose ranks log their own metrics says after a launch: the rows trainguard
#: still logs, tags describing the ranks' writer, and a warning (None: nothing to warn about)
Reconciled = tuple[list[MetricRow], dict[str, str], str | None]


class JobBackend(Protocol):
    """What trainguard asks of the way a job's ranks run. Attributes are fixed per backend;
    methods take what they need, so one backend object serves every run of a runner."""

    #: the kind in words, for messages ("Ray Train": "... belong to a Ray Train job")
    title: str
    #: ``job:`` keys only this kind has; a job of another kind that holds one is told to add
    #: ``kind: <this kind>`` (the job-file schema checks it)
    job_keys: tuple[str, ...]
    #: each rank is a process the launcher starts: its pid is the launcher's, ``preexec`` runs
    #: in it, trainguard may signal, throttle and stop it, and the launcher's memory figures
    #: are the rank's. False: the launched process drives ranks that run elsewhere (Ray's
    #: workers), found and measured another way (:meth:`rank_pids`)
    ranks_are_children: bool
    #: every rank's process has ``RANK`` in its environment when the start-up hook loads, so
    #: the hook's agents know their rank (trainer metrics, sample records, the ``nan`` fault)
    rank_at_start: bool
    #: a failed rank is recovered inside the launch by the backend's own machinery (Ray Train's
    #: ``FailureConfig``, from ``job.max_restarts``) instead of trainguard relaunching the group
    restarts_itself: bool
    #: runs of the job may run side by side (background reference runs, the lane of later
    #: checks); False when they would queue for the same resources anyway
    concurrent_runs: bool
    #: the ranks log their metrics into the launch's tracking run themselves (a designated
    #: writer); the tracker then streams nothing live and logs what :meth:`reconcile_metrics`
    #: leaves
    ranks_log_metrics: bool
    #: a node the ranks run on can be stopped as a fault (``node_loss``)
    stoppable_nodes: bool

    def expand_job(self, data: Mapping[str, Any], placeholders: tuple[str, ...]) -> Mapping[str, Any]:
        """The ``job:`` mapping of this kind as the command job trainguard launches (the Ray
        Train function becomes its driver's command); raises ValueError naming the key and the
        fix. ``placeholders`` are those a job's values may use."""
        ...

    def launch_spec(self, spec: LaunchSpec) -> LaunchSpec:
        """What the launcher starts for ``spec``, the launch as the torchrun contract has it
        (``world_size`` ranks of ``argv``): the same, or e.g. one driver process."""
        ...

    def launch_env(self) -> dict[str, str]:
        """Environment every launch needs to reach what runs its ranks (``RAY_ADDRESS`` of a
        head started now, on first use); the job's own environment wins over it."""
        ...

    def close(self) -> None:
        """Stop what :meth:`launch_env` started. Idempotent."""
        ...

    def reproduce_argv(self, argv: Sequence[str], world_size: int) -> list[str]:
        """The command a person types to run ``argv`` on ``world_size`` ranks ('reproduce:'
        lines)."""
        ...

    def rank_pids(self, launcher: Launcher) -> Callable[[], dict[int, int]]:
        """A function that says, each time it is called, the pid of every rank's process by
        rank (its process tree is the rank's), for the profile's sampler."""
        ...

    def checkpoint_writes(self, checkpoint_dir: Path) -> dict[int, int] | None:
        """step -> bytes of each checkpoint a run wrote, from the backend's own record in
        ``checkpoint_dir``; None: the profile's listing of the directory at each step stands."""
        ...

    def reconcile_metrics(
        self, result: RunResult, rows: Sequence[MetricRow], run_id: str | None
    ) -> Reconciled | None:
        """After a launch whose ranks log their own metrics (:attr:`ranks_log_metrics`): of the
        launcher's ``rows``, those the ranks' writer did not log into ``run_id``, with tags and
        a warning; None when trainguard logs every row itself."""
        ...

    def production_spec(self, spec: Any, command: Sequence[str], cwd: Path) -> Any:
        """The gate's submission spec (:class:`trainguard.queue.base.SubmissionSpec`) of the
        production run, shaped for this kind; ``command`` is ``job.command`` as the job file
        made it, ``cwd`` the job's directory."""
        ...


def torchrun_line(argv: Sequence[str], world_size: int) -> list[str]:
    """``argv`` as torchrun runs it on ``world_size`` ranks of this machine (unchanged for one
    rank): ``python x.py`` becomes ``torchrun --nproc-per-node=N x.py``."""
    if world_size <= 1:
        return list(argv)
    launcher = ["torchrun", f"--nproc-per-node={world_size}"]
    if argv and argv[0] in ("python", "python3"):
        return [*launcher, *argv[1:]]
    return [*launcher, "--no-python", *argv]


class CommandBackend:
    """``kind: command``: trainguard starts ``job.command`` once per rank with torchrun's
    environment (:class:`~trainguard.launch.Launcher`), the ranks are its children, and it
    restarts the whole group itself (``job.max_restarts``). A backend that starts the ranks
    another way may subclass it and change only what differs (docs/backends.md)."""

    title = "command"
    job_keys: tuple[str, ...] = ()
    ranks_are_children = True
    rank_at_start = True
    restarts_itself = False
    concurrent_runs = True
    ranks_log_metrics = False
    stoppable_nodes = False

    def expand_job(self, data: Mapping[str, Any], placeholders: tuple[str, ...]) -> Mapping[str, Any]:
        return data

    def launch_spec(self, spec: LaunchSpec) -> LaunchSpec:
        return spec

    def launch_env(self) -> dict[str, str]:
        return {}

    def close(self) -> None:
        pass

    def reproduce_argv(self, argv: Sequence[str], world_size: int) -> list[str]:
        return torchrun_line(argv, world_size)

    def rank_pids(self, launcher: Launcher) -> Callable[[], dict[int, int]]:
        return lambda: {rank.rank: rank.pid for rank in list(launcher.ranks)}

    def checkpoint_writes(self, checkpoint_dir: Path) -> dict[int, int] | None:
        return None

    def reconcile_metrics(
        self, result: RunResult, rows: Sequence[MetricRow], run_id: str | None
    ) -> Reconciled | None:
        return None

    def production_spec(self, spec: Any, command: Sequence[str], cwd: Path) -> Any:
        return spec

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
