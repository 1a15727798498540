"""The invariants check (``checks.invariants``): the invariants of a correct data-parallel
training step (:mod:`trainguard.checks.invariants`), read from the step and sample records of the
uninterrupted run the session makes anyway.

It launches nothing of its own when another check of the session makes an uninterrupted run of the
same job (same seed, args and env): it folds into that run, preferring one of two or more ranks
(the replicas are compared there) and then the longest; otherwise it runs the job once itself, for
``steps`` steps at the job's world size. A run with no step records is an error (or, with
``job.record_steps: false``, a skip) saying why: never a pass. docs/invariants.md.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from pydantic import Field

from trainguard._internal.model import ConfigModel
from trainguard.checks.context import CheckContext
from trainguard.checks.equivalence import failed_run
from trainguard.checks.equivalence_records import RunFailure
from trainguard.checks.invariants import check_invariants
from trainguard.checks.invariants_records import Allowed, Coverage, Finding, Invariants
from trainguard.config.checks import CheckSpec
from trainguard.config.registry import Check, PlanContext, Run, check_for
from trainguard.evidence import UNSET, Evidence, NoEvidence, Unset
from trainguard.launch.samples import read_samples
from trainguard.launch.steps import read_steps
from trainguard.report import CheckResult, CheckStatus
from trainguard.run.declared import declared_runs
from trainguard.run.request import RunRequest, share_key

if TYPE_CHECKING:
    from trainguard.config.schema import JobFile

__all__ = ["INVARIANTS", "CoverageEvidence", "FindingEvidence", "InvariantsAllow", "InvariantsCheck",
           "InvariantsEvidence", "invariants_verdict", "run_invariants", "shared_reference"]


class InvariantsAllow(ConfigModel):
    """``checks.invariants.allow``: the intended exceptions, names or globs (docs/invariants.md)."""

    #: parameters deliberately different per rank: their replicas are not compared
    per_rank: list[str] = Field(default_factory=list)
    #: datasets (``TensorDataset(384)``, as a finding names them) every rank reads whole on purpose
    shared_samples: list[str] = Field(default_factory=list)
    #: datasets whose loader replays one order every epoch on purpose
    same_order: list[str] = Field(default_factory=list)
    #: parameters an optimizer holds that are frozen on purpose (no gradient is no finding)
    frozen: list[str] = Field(default_factory=list)
    #: the job accumulates gradients across optimizer steps on purpose (carried gradients)
    accumulates: bool = False
    #: modules kept in eval mode while training on purpose (a frozen batch norm)
    eval_modules: list[str] = Field(default_factory=list)
    #: modules run in training mode without gradients on purpose (Monte Carlo dropout, a teacher)
    train_modules: list[str] = Field(default_factory=list)

    def allowed(self) -> Allowed:
        return Allowed(tuple(self.per_rank), tuple(self.shared_samples), tuple(self.same_order), tuple(self.frozen),
                       self.accumulates, tuple(self.eval_modules), tuple(self.train_modules))


class InvariantsCheck(CheckSpec):
    """``checks.invariants``: the invariants of every correct training step hold in one run."""

    #: the steps of its own run, when no other check of the session makes an uninterrupted run
    steps: int = Field(20, ge=2)
    allow: InvariantsAllow = Field(default_factory=InvariantsAllow)
    #: a run that recorded no step (ranks that are not Python, no torch optimizer): ``error`` (the
    #: check was asked for and compared nothing) or ``skip`` (what the gate's default sets: the
    #: job file did not ask for it, docs/invariants.md)
    missing_records: Literal["error", "skip"] = "error"


@dataclass
class FindingEvidence(Evidence):
    """One invariant the run broke (:class:`~trainguard.checks.invariants_records.Finding`)."""

    invariant: str
    #: the optimizer step it was first seen at (None: a data finding, named by its epoch)
    step: int | None
    epoch: int | None
    ranks: list[int]
    #: the parameter or the loader
    name: str
    observation: str
    fix: str
    optimizer: int

    @classmethod
    def of(cls, finding: Finding) -> FindingEvidence:
        return cls(finding.invariant.value, finding.step, finding.epoch, list(finding.ranks), finding.name,
                   finding.observation, finding.fix, finding.optimizer)


@dataclass
class CoverageEvidence(Evidence):
    """What one invariant compared, and what it did not (and why)."""

    invariant: str
    compared: int
    what: str
    not_compared: str

    @classmethod
    def of(cls, coverage: Coverage) -> CoverageEvidence:
        return cls(coverage.invariant.value, coverage.compared, coverage.what, coverage.reason)


@dataclass
class InvariantsEvidence(Evidence):
    """The invariants check's evidence: the run it read, the findings, what was compared."""

    run_dir: str
    world_size: int
    findings: list[FindingEvidence]
    coverage: list[CoverageEvidence]
    #: what the records could not say (a rank cut at its cap, malformed lines)
    notes: list[str]
    #: the run was another check's, launched once for both
    shared_run: str | Unset = UNSET


def shared_reference(spec: InvariantsCheck, job_file: JobFile, session: Sequence[tuple[str, CheckSpec]]) -> Run | None:
    """The uninterrupted run of the same job (same seed, args and env) another check of
    ``session`` makes, of two or more ranks first, then the longest; None when none does."""
    best: tuple[tuple[bool, int], Run] | None = None
    for name, other in session:
        kind = check_for(name)
        if name in ("invariants", "smoke") or kind is None or kind.first or not hasattr(other, "steps"):
            continue  # smoke folds into the others' runs; a first check's runs are timed: no records
        for declared in declared_runs(job_file, name, other, seed=0)[0]:
            req = declared.request
            mine = RunRequest.make(steps=req.steps, seed=spec.seed if spec.seed is not None else 0,
                                   world_size=req.world_size, args=spec.args, env=spec.env)
            if not declared.run.reference or declared.run.resumes is not None or share_key(mine) != share_key(req):
                continue
            rank = (req.world_size > 1, req.steps)
            if best is None or rank > best[0]:
                best = (rank, Run(f"the uninterrupted run of {req.steps} steps at {req.world_size} rank(s) "
                                  f"{name} makes (shared)", world_size=req.world_size, steps=req.steps,
                                  reference=True))
    return None if best is None else best[1]


def _invariants_runs(spec: InvariantsCheck, ctx: PlanContext) -> tuple[list[Run], str]:
    """The uninterrupted run of the same job another check of the session makes
    (:func:`shared_reference`), else a run of its own."""
    shared = shared_reference(spec, ctx.job_file, ctx.session)
    note = "the invariants of every correct training step hold in the run's step and sample records"
    if shared is None:
        return [Run(f"its own uninterrupted run of {spec.steps} steps at {ctx.job_file.job.world_size} rank(s)",
                    reference=True)], note
    return [shared], note + " (read from a run another check makes: no launch of its own)"


def run_invariants(ctx: CheckContext[InvariantsCheck]) -> CheckResult:
    """Read the step and sample records of the declared uninterrupted run and check every
    invariant they can show: a finding fails the check, a run that recorded no step is an error."""
    started = time.monotonic()
    declared = ctx.declared()
    reproduce = ctx.command_line(declared.request)
    if not ctx.job_file.job.record_steps:
        return CheckResult("invariants", "skipped", "job.record_steps is false, so no run records its steps and no "
                           "invariant can be checked: set job.record_steps: true (the default)", NoEvidence(),
                           time.monotonic() - started, reproduce)
    # the invariants are read from the records themselves: a shared run kept without them (the
    # profile's timed run) is launched again with them
    result = ctx.recorded(ctx.reference())
    if not result.ok:
        return failed_run("invariants", result, started, reproduce)
    steps = read_steps(result.run_dir)
    found = check_invariants(steps, read_samples(result.run_dir), allowed=ctx.spec.allow.allowed())
    evidence = InvariantsEvidence(str(result.run_dir), declared.request.world_size,
                                  [FindingEvidence.of(f) for f in found.findings],
                                  [CoverageEvidence.of(c) for c in found.coverage], list(found.notes))
    if "shared" in declared.run.label:
        evidence.shared_run = f"{result.run_dir.name}: {declared.run.label}"
    status, summary = invariants_verdict(found, has_steps=steps.has_steps, run_dir=str(result.run_dir))
    if not steps.has_steps and ctx.spec.missing_records == "skip":
        status, summary = "skipped", (f"the run in {result.run_dir} recorded no training step (no torch optimizer "
                                      "stepped, or its ranks are not Python), so no invariant applies; "
                                      "missing_records is skip (the gate's default check)")
    return CheckResult("invariants", status, summary, evidence, time.monotonic() - started, reproduce)


def invariants_verdict(found: Invariants, *, has_steps: bool, run_dir: str) -> tuple[CheckStatus, str]:
    """The check's status and summary: an error when the run recorded no step, failed on a finding,
    skipped when no invariant compared anything (never a pass), else passed, saying what each
    invariant compared and what was not checked."""
    if not has_steps:
        return "error", (f"the run in {run_dir} left no step records, so no invariant was checked: the job steps no "
                         "torch optimizer, its ranks are not Python, or the run read was a timed one that records "
                         "none; run it with job.record_steps: true under `trainguard check`")
    if found.findings:
        first = found.findings[0]
        more = f" ({len(found.findings) - 1} more finding(s) in the evidence)" if len(found.findings) > 1 else ""
        return "failed", f"{first.sentence()}{more}. Fix: {first.fix}"
    if found.compared == 0:
        why = "; ".join(f"{c.invariant.value}: {c.reason}" for c in found.coverage if c.reason)
        return "skipped", f"no invariant applies to this run, so none was checked ({why})"
    held = "; ".join(f"{c.invariant.value}: {c.what}" for c in found.coverage if c.compared)
    unchecked = "; ".join(f"{c.invariant.value}: {c.reason}" for c in found.coverage if not c.compared and c.reason)
    return "passed", f"every invariant held ({held})" + (f"; not checked: {unchecked}" if unchecked else "")


#: invariants: what every correct training step keeps, in one run (docs/invariants.md). Not in the
#: default ``gate.require`` (a job whose checks make no uninterrupted run has nothing for it to
#: read): the gate adds it when the job file does not configure it and another check makes that
#: run (:func:`trainguard.gate.run.gate_checks_to_run`), and a finding blocks as any failed check
INVARIANTS: Check[InvariantsCheck] = Check(
    "invariants", InvariantsCheck, run=run_invariants, runs=_invariants_runs, lane=True, gate_default=False,
    evidence=(InvariantsEvidence, RunFailure, NoEvidence),
)
