"""How a job's ranks are started, restarted, signalled and observed: :class:`JobBackend`, and
:class:`CommandBackend`, the torchrun contract every ``kind: command`` job follows.

The job file's ``kind`` names a backend, looked up once
(:func:`trainguard.config.backends.backend_for`); the runner holds it, and every layer above
asks it what it needs instead of comparing the kind: how a launch's ranks become processes,
whether the ranks are the launched processes (preexec, signals, memory, stopping them while a
checkpoint is copied), how a drill's fault reaches a rank and who restarts a failed attempt
(:mod:`trainguard.launch.reach`), whether runs may overlap, whether the ranks log their own
metrics and what their writer recorded, and how the production run is submitted.

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

from trainguard.launch.reach import ChildRanks, RankReach, Restarts

if TYPE_CHECKING:  # pragma: no cover
    from trainguard.launch.launcher import Launcher, LaunchSpec, RunResult

__all__ = ["CommandBackend", "JobBackend", "MetricRow", "Reconciled", "torchrun_line"]

#: one metric row as the tracker logs it: (name, value, step, timestamp in ms)
MetricRow = tuple[str, float, int, int]
#: what a backend whose ranks log their own metrics says after a launch: the rows trainguard
#: still logs, tags describing the ranks' writer, and a warning (None: nothing to warn about)
Reconciled = tuple[list[MetricRow], dict[str, str], str | None]


class JobBackend(Protocol):
    """What trainguard asks of the way a job's ranks run. ``title`` and ``job_keys`` are fixed
    per backend; the methods say what differs and take what they need, so one backend object serves every run of a runner."""

    #: the kind in words, for messages ("Ray Train": "... belong to a Ray Train job")
    title: str
    #: ``job:`` keys only this kind has; a job of another kind that holds one is told to add
    #: ``kind: <this kind>`` (the job-file schema checks it)
    job_keys: tuple[str, ...]
    def ranks_are_children(self) -> bool:
        """Each rank is a process the launcher starts: its pid is the launcher's, trainguard may
        signal, throttle and stop it (while a checkpoint is copied), and the launcher's memory
        figures are the rank's. False: the launched process drives ranks that run elsewhere
        (Ray's workers), found and measured another way (:meth:`rank_pids`)."""
        ...

    def rank_at_start(self) -> bool:
        """Every rank's process has ``RANK`` in its environment when the start-up hook loads, so
        the hook's agents know their rank (trainer metrics, sample records, the ``nan`` fault)."""
        ...

    def concurrent_runs(self) -> bool:
        """Runs of the job may run side by side (background reference runs, the lane of later
        checks); False when they would queue for the same resources anyway."""
        ...

    def ranks_log_metrics(self) -> bool:
        """The ranks log their metrics into the launch's tracking run themselves (a designated
        writer); the tracker then streams nothing live and logs what :meth:`reconcile_metrics`
        leaves, and :meth:`writer_record` says what the writer did."""
        ...

    def stoppable_nodes(self) -> bool:
        """A node the ranks run on can be stopped as a fault (``node_loss``)."""
        ...

    def fault_reach(self, fault_kind: str, *, job_name: str, world_size: int) -> RankReach:
        """How the fault of one drill run (a ``fault_kind`` fault on ``world_size`` ranks of the
        job ``job_name``) reaches the ranks: its launch's environment and ``preexec``, the
        launcher the fault's ``inject`` gets, the watch of the ranks' processes
        (:class:`~trainguard.launch.reach.RankReach`). ValueError naming the setting that is
        wrong."""
        ...

    def drill_restarts(self, fault_kind: str, expectation: str, limit: int) -> Restarts:
        """Who restarts a drill run's failed attempt after a ``fault_kind`` fault judged by
        ``expectation``, ``limit`` being the drill's restart budget
        (:class:`~trainguard.launch.reach.Restarts`)."""
        ...

    def restart_note(self, max_restarts: int) -> str:
        """Words for a job that completed although its drill expected it to fail: how the
        backend's own restarts (``job.max_restarts``) brought it back, and what to do; empty when
        the backend restarts nothing itself."""
        ...

    def writer_record(self, result: RunResult) -> tuple[Any, str]:
        """What the ranks' own metrics writer (:meth:`ranks_log_metrics`) recorded for the launch
        ``result`` (an object with ``run_id``, ``dropped_rows``, ``dropped_steps``, ``reason``
        and ``to_dict()``; None: it never ran), and where it was looked for, in words."""
        ...

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
        """After a launch whose ranks log their own metrics (:meth:`ranks_log_metrics`): of the
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

    def ranks_are_children(self) -> bool:
        return True

    def rank_at_start(self) -> bool:
        return True

    def concurrent_runs(self) -> bool:
        return True

    def ranks_log_metrics(self) -> bool:
        return False

    def stoppable_nodes(self) -> bool:
        return False

    def fault_reach(self, fault_kind: str, *, job_name: str, world_size: int) -> RankReach:
        return ChildRanks()

    def drill_restarts(self, fault_kind: str, expectation: str, limit: int) -> Restarts:
        return Restarts(relaunches=limit)

    def restart_note(self, max_restarts: int) -> str:
        return ""

    def writer_record(self, result: RunResult) -> tuple[Any, str]:
        return None, "the ranks of a command job log no metrics themselves"

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
