"""The runs a check declares (:class:`~trainguard.config.registry.Run`), made into the requests
they launch and the keys they are shared by.

The planner (``trainguard validate``), the session (which keeps the checkpoints the checks will
resume from before any run starts) and the smoke check (which folds into another check's runs)
read the same declarations through :func:`declared_runs`, so what the plan counts is what the
runner launches.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

from trainguard.config.registry import PlanContext, Run, check_for
from trainguard.run.request import RunRequest, share_key

__all__ = ["DeclaredRun", "declared_runs", "progress_metric_of"]


def progress_metric_of(job_file: Any) -> str:
    """The metric the checks follow a run's progress by: ``loss``, else the first of job.metrics."""
    return job_file.job.progress_metric  # type: ignore[no-any-return]


@dataclass(frozen=True)
class DeclaredRun:
    """One declared run and the request it launches."""

    run: Run
    request: RunRequest
    #: for a run that resumes from a kept checkpoint: the uninterrupted run it is kept from
    source: RunRequest | None = None

    @property
    def share(self) -> Hashable | None:
        """Runs with an equal key are launched once (None: this one always launches)."""
        if self.run.reference:
            return ("reference", share_key(self.request))
        if self.source is not None and self.run.resumes is not None:
            return ("resumed", share_key(self.source), self.run.resumes.after_step, share_key(self.request))
        return None


def declared_runs(
    job_file: Any, name: str, spec: Any, *, seed: int, soak_seed: int | None = None,
    session: Sequence[tuple[str, Any]] = (),
) -> tuple[list[DeclaredRun], str]:
    """The runs check ``name`` declares for ``spec`` in a session of ``session`` checks, each with
    the request it becomes, and its one line on what it judges."""
    job = job_file.job
    kind = check_for(name)
    declared, note = (kind.runs(spec, PlanContext(job_file, soak_seed, tuple(session))) if kind is not None
                      else ([Run(name)], ""))
    spec_seed = getattr(spec, "seed", None)
    seed = spec_seed if spec_seed is not None else seed

    def request(world_size: int | None, steps: int | None) -> RunRequest:
        return RunRequest.make(
            steps=steps if steps is not None else spec.steps, seed=seed,
            world_size=world_size if world_size is not None else job.world_size,
            args=spec.args, env=spec.env, timeout=spec.timeout)

    out = []
    for run in declared:
        source = (request(run.resumes.world_size if run.resumes.world_size is not None else run.world_size, run.steps)
                  if run.resumes is not None else None)
        out.append(DeclaredRun(run, request(run.world_size, run.steps), source))
    return out, note
