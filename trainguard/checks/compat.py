"""The compat check (registered here): a checkpoint written by an older commit of the job's own
code, resumed by the current code, must train exactly like the current code's uninterrupted run.

A refactor that renames a layer, adds a buffer or changes the loader's order breaks every
checkpoint in flight, and the job's own resume check (old and new checkpoints from one commit)
cannot see it. ``checks.compat: {base: REF}``:

1. ``REF`` (a branch, tag or commit of the job's repository; ``promoted``: the commit of the newest
   promoted gate report under ``.trainguard/gate/``) is checked out in a temporary worktree
   (:mod:`trainguard._internal.worktree`) with the files git ignores (data made locally, a
   virtual environment) linked in;
2. the job runs there and is killed after ``after_step``: its checkpoint is base's;
3. the current code resumes from that checkpoint to ``steps``;
4. the resumed steps are compared with the current code's uninterrupted run (the run the resume
   check shares). The checkpoint's layout (keys, shapes) is compared with the current code's own
   checkpoint, the base run's steps before the kill with the current run's, and the samples
   each drew: a failure names the key, the rename or the first batch that differs.

See docs/compat.md.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import shlex
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import Field, field_validator, model_validator

from trainguard._internal.gitcmd import GitError
from trainguard._internal.promoted import last_promoted
from trainguard._internal.readers import copy_tree
from trainguard._internal.worktree import (
    checkout,
    link_ignored,
    missing_at,
    repository_root,
    resolve_commit,
)
from trainguard.checks.calibration import ToleranceEvidence, ToleranceUsed, tolerance_for
from trainguard.checks.context import CheckContext
from trainguard.checks.diagnosis import RESUME_CAUSE_TEXT, first_different_batch
from trainguard.checks.divergence import DivergenceEvidence
from trainguard.checks.divergence_noisy import observe_noisy_resume
from trainguard.checks.equivalence import TrajectoryDiff, compare_trajectories
from trainguard.checks.equivalence_records import TrajectoryEvidence
from trainguard.checks.interruption import kill_after, untested_kill
from trainguard.checks.resume_judge import where_resumed
from trainguard.config import CheckSpec
from trainguard.config.problems import metric_problems, resume_problems
from trainguard.config.registry import Check, JobFacts, Run
from trainguard.evidence import UNSET, Evidence, Unset
from trainguard.launch import RunResult
from trainguard.launch.metrics import aligned_trajectories
from trainguard.launch.rundir import new_run_dir
from trainguard.launch.samples import read_samples
from trainguard.report import CheckResult, CheckStatus
from trainguard.run.declared import progress_metric_of
from trainguard.run.request import RunRequest
from trainguard.unit.checkpoints.compare import LayoutDifference, LayoutEvidence, compare_layouts
from trainguard.unit.checkpoints.files import latest_complete_checkpoint

__all__ = ["COMPAT", "CompatCheck", "CompatEvidence", "Uncompared", "run_compat"]

_NAME = "compat"
#: ``base: promoted``: the commit of the newest promoted gate report
PROMOTED = "promoted"
#: the lines of a failed load that name a key (torch's load_state_dict, a KeyError)
_KEY_LINE = re.compile(r"(Missing key|Unexpected key|size mismatch|KeyError|Error\(s\) in loading)")


class CompatCheck(CheckSpec):
    """``checks.compat``: base's checkpoint, resumed by the current code, trains like the current
    code's uninterrupted run (docs/compat.md)."""

    #: a git ref of the job's repository (branch, tag, commit, ``HEAD~3``), or ``promoted``: the
    #: commit of the newest promoted gate report (``trainguard gate``'s provenance)
    base: str = Field(min_length=1)
    steps: int = Field(20, ge=2)
    #: base's run is killed after this step; its checkpoint is what the current code resumes
    after_step: int = Field(ge=1)
    rtol: float = Field(0.0, ge=0)
    atol: float = Field(0.0, ge=0)
    #: the metrics compared after the resume (default: every metric of job.metrics)
    metrics: list[str] | None = Field(None, min_length=1)
    #: more paths (relative to the repository's top) linked into base's checkout from the
    #: working tree, besides every file git ignores: data that is untracked but not ignored
    link: list[str] = Field(default_factory=list)

    @model_validator(mode="before")
    @classmethod
    def _default_after_step(cls, data: Any) -> Any:
        if isinstance(data, dict) and "after_step" not in data:  # default: half way
            steps = data.get("steps", 20)
            if isinstance(steps, int) and not isinstance(steps, bool):
                data = {**data, "after_step": max(1, steps // 2)}
        return data

    @field_validator("base")
    @classmethod
    def _printable(cls, base: str) -> str:
        if any(ord(c) < 32 or ord(c) == 127 for c in base):
            raise ValueError(f"{base!r} holds a control character (a NUL byte, a newline), which no git ref has; "
                             "name a branch, tag or commit, e.g. `base: main`, or `base: promoted`")
        return base

    @field_validator("link")
    @classmethod
    def _relative(cls, paths: list[str]) -> list[str]:
        for path in paths:
            if os.path.isabs(path) or ".." in Path(path).parts or not path.strip():
                raise ValueError(f"link entry {path!r} must be a path inside the repository, relative to its "
                                 "top, e.g. `link: [data/train.bin]`")
        return paths

    @model_validator(mode="after")
    def _room_after(self) -> CompatCheck:
        if self.after_step >= self.steps:
            raise ValueError(f"after_step ({self.after_step}) must be smaller than steps ({self.steps}) "
                             "so there are steps left to compare after the resume")
        return self


@dataclass
class Uncompared(Evidence):
    """base's own resume printed nothing to compare with: why."""

    first_divergent_step: None
    compared_steps: int
    reason: str


@dataclass
class CompatEvidence(Evidence):
    """The compat check's evidence (docs/compat.md)."""

    base: str
    #: the commit ``base`` named, and the current code's (``dirty``: with uncommitted changes)
    base_commit: str | None = None
    current_commit: str | None = None
    current_dirty: bool | None = None
    after_step: int | None = None
    killed_after_step: int | None = None
    resumed_from_step: int | None = None
    run_dirs: dict[str, str] = dataclasses.field(default_factory=dict)
    #: the files git ignores linked into base's checkout (data, a virtual environment)
    linked: list[str] = dataclasses.field(default_factory=list)
    #: :meth:`LayoutDifference.as_evidence`: base's checkpoint against the current code's
    layout: LayoutEvidence | Unset = UNSET
    #: :meth:`TrajectoryDiff.as_evidence` per metric compared after the resume
    metrics: list[TrajectoryEvidence] = dataclasses.field(default_factory=list)
    #: base's steps before the kill against the current code's: where they first differ
    before_resume: TrajectoryEvidence | Unset = UNSET
    #: where base and the current code first drew other samples
    samples: str | Unset = UNSET
    #: when the resume diverged and nothing above explains it: the current code's resume against
    #: base's own resume of the same checkpoint (:meth:`TrajectoryDiff.as_evidence`)
    control: TrajectoryEvidence | Uncompared | Unset = UNSET
    #: where the resumed run's step records first part from the uninterrupted run's (sums of
    #: squares within the calibrated spread or a default tolerance), when the resume failed
    first_divergence: DivergenceEvidence | Unset = UNSET
    #: what was allowed, and why (``{}`` until the tolerance is known)
    tolerance: ToleranceEvidence | dict[str, float] = dataclasses.field(default_factory=dict)
    #: ``base: promoted``: where the promoted report was found (the index, a scan) or why none was
    promoted: str | Unset = UNSET
    likely_causes: list[str] | Unset = UNSET


def _diffs(ctx: CheckContext[CompatCheck], spec: CompatCheck, metric: str, run: RunResult, reference: RunResult,
           first: int, tol: ToleranceUsed) -> list[TrajectoryDiff]:
    """The resumed run against the reference from ``first`` on: the progress metric, then every
    other metric ``spec.metrics`` names (default: all of job.metrics) the reference printed."""
    names = [metric, *(n for n in (spec.metrics or list(ctx.job_file.job.metrics)) if n != metric)]
    out = []
    for name in names:
        actual, expected = aligned_trajectories(run.points, reference.points, name)
        steps = [s for s in expected if first <= s <= spec.steps]
        if steps or name == metric:
            out.append(compare_trajectories(actual, expected, metric=name, steps=steps, rtol=spec.rtol, atol=spec.atol,
                                            band=tol.band(name)))
    return out


def _load_error(result: RunResult) -> str:
    """The line of a failed run's stderr that names a key (torch's ``Missing key(s) ...``), else
    the run's reason."""
    lines = [line.strip() for line in result.stderr_tail.splitlines() if line.strip()]
    keyed = [line.rstrip(".:") for line in lines if _KEY_LINE.search(line)]
    return ("; ".join(dict.fromkeys(keyed[-3:])) if keyed else result.reason)[:600]


def _causes(layout: LayoutDifference | None, before: TrajectoryDiff | None, samples: str | None) -> list[str]:
    causes = []
    if layout is not None and layout.compared and not layout.same:
        fix = ("map the old names on load (rename the keys before `load_state_dict`, or a "
               "`_load_from_state_dict` hook)" if layout.renamed else
               "give what the current code added a default when the checkpoint lacks it (load with "
               "`strict=False` and fill it), and drop what it no longer has")
        causes.append(f"the checkpoint's layout changed: {layout.summary()}; {fix}")
    if samples:
        causes.append(samples)
    if before is not None and before.first_divergent_step is not None:
        causes.append(f"base and the current code train differently before any resume (from step "
                      f"{before.first_divergent_step}): the change alters training itself (data order, "
                      "initialisation, a hyperparameter, the schedule), so a run in flight would continue "
                      "as a different run")
    return causes


def _samples_note(base: RunResult, reference: RunResult) -> str | None:
    first, second = read_samples(base.run_dir).get(0, []), read_samples(reference.run_dir).get(0, [])
    if not first or not second:
        return None
    found = first_different_batch(first, second)
    if found is None:
        return None
    i, x, y = found
    return (f"the data order changed: base drew samples {list(x)[:6]} in batch {i + 1}, the current code "
            f"{list(y)[:6]}; a resumed run continues in the new order")


def _git_facts(ctx: CheckContext[CompatCheck], spec: CompatCheck, evidence: CompatEvidence,
               done: Callable[..., CheckResult]) -> tuple[Path, str, str] | CheckResult:
    """(repository top, base's commit, what base named), or the result saying why there is none
    (before anything is launched): skipped when no gate has promoted the job (nothing was
    compared), else an error."""
    root = repository_root(ctx.job_file.cwd)
    if root is None:
        return done("error", f"checks.compat.base: the job's directory {ctx.job_file.cwd} is not "
                       "in a git repository: checks.compat checks out base from it")
    if spec.base == PROMOTED:
        found = last_promoted(ctx.job_file.state_dir / "gate")
        evidence.promoted = found.how
        if found.promotion is None:
            return done("skipped", f"nothing compared: {found.how}. With `base: promoted` there is "
                           "nothing to be compatible with until a gate promotes the job; until then leave compat out "
                           "of gate.require, or name a commit (`base: main`)")
        commit, named = found.promotion.commit, "promoted"
    else:
        try:
            commit, named = resolve_commit(root, spec.base), spec.base
        except GitError as exc:
            return done("error", f"checks.compat.base: {exc}")
    relative = ctx.job_file.cwd.resolve().relative_to(root.resolve())
    why = missing_at(root, commit, relative)
    if why is not None:
        evidence.base_commit = commit
        return done("error", f"checks.compat.base ({named}): {why}")
    return root, commit, named


def run_compat(ctx: CheckContext[CompatCheck]) -> CheckResult:
    """Base's checkpoint after ``after_step``, resumed by the current code; compared with the
    current code's uninterrupted run."""
    from trainguard._internal.gitstate import git_state

    started, spec = time.monotonic(), ctx.spec
    evidence = CompatEvidence(spec.base, after_step=spec.after_step)

    def done(status: CheckStatus, summary: str, reproduce: str | None = None) -> CheckResult:
        return CheckResult(_NAME, status, summary, evidence, time.monotonic() - started, reproduce)

    facts = _git_facts(ctx, spec, evidence, done)
    if isinstance(facts, CheckResult):
        return facts
    root, commit, named = facts
    state = git_state(ctx.job_file.cwd)
    evidence.base_commit, evidence.current_commit, evidence.current_dirty = commit, state.commit, state.dirty
    if commit == state.commit and state.dirty is False:
        return done("passed", f"the job's code is base's commit {commit[:12]} ({named}) unchanged: nothing to compare")
    request = ctx.request
    tol = tolerance_for(ctx.job_file, spec, request, _NAME)
    evidence.tolerance = tol.as_evidence()
    reference = ctx.reference()
    evidence.run_dirs["reference"] = str(reference.run_dir)
    if not reference.ok:
        return done("error", f"the current code's uninterrupted run did not complete: {reference.reason}")
    try:
        return _run_at_base(_Comparison(ctx, spec, evidence, tol, done), (root, commit), request, reference)
    except GitError as exc:  # base could not be checked out: said, the session goes on
        return done("error", f"checks.compat: base's commit {commit[:12]} ({named}) could not be checked out: {exc}")


@dataclass(frozen=True)
class _Comparison:
    """What every step of one compat comparison reads and writes: the check's context and spec, its evidence, tolerance and verdict."""

    ctx: CheckContext[CompatCheck]
    spec: CompatCheck
    evidence: CompatEvidence
    tol: ToleranceUsed
    done: Callable[..., CheckResult]


def _run_at_base(cmp: _Comparison, at: tuple[Path, str], request: RunRequest, reference: RunResult) -> CheckResult:
    """Base checked out, killed after ``after_step``, and its checkpoint resumed by the current
    code; judged by :func:`_judge`."""
    ctx, spec, evidence, done = cmp.ctx, cmp.spec, cmp.evidence, cmp.done
    root, commit = at
    metric = progress_metric_of(ctx.job_file)
    relative = ctx.job_file.cwd.resolve().relative_to(root.resolve())
    # base checkpoints into a folder of trainguard's own, never into the checkout or a linked one
    checkpoints = new_run_dir(ctx.job_file.state_dir, ctx.job_file.job.name, "compat-base-checkpoints",
                              keep=ctx.settings.keep_runs) / "checkpoints"
    with checkout(root, commit, ctx.job_file.state_dir / "compat") as tree:
        base_cwd = tree / relative
        evidence.linked = link_ignored(
            root, tree, extra=spec.link,
            skip=lambda name: name.endswith((".pyc", "__pycache__")) or ".trainguard" in Path(name).parts)
        base_pool = ctx.pool.sibling(dataclasses.replace(
            ctx.job_file, job=ctx.job_file.job.model_copy(update={"cwd": str(base_cwd)})))
        base_request = dataclasses.replace(request, env=tuple(sorted({
            **dict(request.env),
            "PYTHONPATH": os.pathsep.join([str(base_cwd), *filter(None, [dict(request.env).get("PYTHONPATH")])])}.items())))
        # runnable as printed: the checkout is gone by then, so the line makes its own
        again = f"/tmp/trainguard-base-{commit[:12]}"
        reproduce = (f"git -C {shlex.quote(str(root))} worktree add --detach {again} {commit[:12]} && "
                     + base_pool.command_line(base_request).replace(str(tree), again)
                     + f"  # kill -9 after step {spec.after_step}, then: {ctx.command_line(request, resume=True)}")
        base = base_pool.run(base_request, label="compat-base-killed", checkpoint_dir=checkpoints,
                               on_metric=kill_after(metric, spec.after_step))
        evidence.run_dirs["base"] = str(base.run_dir)
        evidence.killed_after_step = base.last_step
        why = untested_kill(base, metric, spec.after_step, spec.steps, what=f"base's run ({commit[:12]})")
        if why is not None:
            return done("error", why + (f"; its stderr: {base.stderr_tail.strip().splitlines()[-1][:300]}"
                                        if base.stderr_tail.strip() and not base.ok else ""), reproduce)
        if ctx.resumes_from_latest and latest_complete_checkpoint(base.checkpoints) is None:
            return done("error", f"base's run ({commit[:12]}) left no complete checkpoint under {base.checkpoints} "
                        f"by step {base.last_step}: {{latest_checkpoint}} names nothing to resume; raise after_step",
                        reproduce)
        layout = compare_layouts(base.checkpoints, reference.checkpoints)
        evidence.layout = layout.as_evidence()
        # base's checkpoint as the kill left it: the resumed run writes newer ones beside it
        kept = base.checkpoints.parent / "at-kill"
        copy_tree(base.checkpoints, kept)  # a FIFO, socket or device is left out, never opened
        resumed = ctx.pool.run(request, label="compat-resumed", resume=True, checkpoint_dir=base.checkpoints)
        evidence.run_dirs["resumed"] = str(resumed.run_dir)

        def base_resumed() -> RunResult:
            again = base_pool.run(base_request, label="compat-base-resumed", resume=True, checkpoint_dir=kept)
            evidence.run_dirs["base_resumed"] = str(again.run_dir)
            return again

        return _judge(cmp, metric, (reference, base, resumed), layout, reproduce, base_resumed)


def _judge(cmp: _Comparison, metric: str, runs: tuple[RunResult, RunResult, RunResult], layout: LayoutDifference,
           reproduce: str, base_resumed: Callable[[], RunResult]) -> CheckResult:
    ctx, spec, evidence, tol, done = cmp.ctx, cmp.spec, cmp.evidence, cmp.tol, cmp.done
    reference, base, resumed = runs
    short = (evidence.base_commit or "")[:12]
    actual, expected = aligned_trajectories(base.points, reference.points, metric)
    before = compare_trajectories(actual, expected, metric=metric, steps=[s for s in actual if s in expected],
                                  rtol=spec.rtol, atol=spec.atol, band=tol.band(metric))
    evidence.before_resume = before.as_evidence()
    samples = _samples_note(base, reference)
    if samples:
        evidence.samples = samples
    causes = _causes(layout, before, samples)
    if causes:
        evidence.likely_causes = causes
    because = f". Likely: {causes[0]}" if causes else ""
    if not resumed.ok:
        return done("failed", f"the current code cannot resume base's ({short}) checkpoint: {_load_error(resumed)}"
                    + because, reproduce)
    steps = sorted(aligned_trajectories(resumed.points, reference.points, metric)[0])
    if not steps:
        return done("failed", f"the current code's run resumed from base's checkpoint printed no `{metric}` line", reproduce)
    first = steps[0]
    began_again, resumed_from = where_resumed(first, expected)
    if began_again:
        return done("failed", f"the current code started again from step {first} instead of resuming base's "
                    f"({short}) checkpoint: it did not take it as one" + because, reproduce)
    evidence.resumed_from_step = resumed_from
    diffs = _diffs(ctx, spec, metric, resumed, reference, first, tol)
    evidence.metrics = [d.as_evidence() for d in diffs]
    problems = []
    for diff in diffs:
        if diff.first_divergent_step is not None:
            a, b = diff.first_values or (math.nan, math.nan)
            problems.append(f"{diff.metric} diverges from the current code's uninterrupted run at step "
                            f"{diff.first_divergent_step} (resumed from base's checkpoint {a!r} vs {b!r}; "
                            f"max abs diff {diff.max_abs_diff:.3g}{tol.words(diff.metric, diff.first_divergent_step, abs(a - b))})")
        elif not diff.ok:
            problems.append(f"the resumed run's {diff.metric} {diff.missing_words()}")
    if problems and not causes:  # nothing explains it: does base itself continue its checkpoint so?
        control = _control(ctx, spec, metric, resumed, base_resumed(), tol)
        evidence.control = control
        step = control.first_divergent_step
        if step is None and control.compared_steps:
            return done("passed", f"base {short} ({spec.base}) killed after step {evidence.killed_after_step}; the current "
                        f"code continues its checkpoint exactly as base itself does ({control.compared_steps} steps "
                        f"from step {first}); but neither matches the uninterrupted run ({problems[0]}): the job's "
                        "resume is not exact, which checks.resume diagnoses", reproduce)
        problems.append(f"base itself, resumed from the same checkpoint, continues differently from the current code "
                        f"(from step {step})" if step is not None else f"base's own resume could not be compared: "
                        f"{control.reason if isinstance(control, Uncompared) else 'no steps'}")
    if problems:
        observed = _observed(cmp, (reference, base, resumed), first, expected)
        if observed and not causes:  # what the step records show, first, with the observation
            because = f". Likely: {observed[0]}"
        if observed:  # after a change of layout, data or training itself: that explains what follows
            evidence.likely_causes = [*causes, *observed]
        return done("failed", "; ".join(problems) + because, reproduce)
    note = f"; its layout differs ({layout.summary()}) but the current code loads it" if layout.compared and not layout.same else ""
    return done("passed", f"base {short} ({spec.base}) killed after step {evidence.killed_after_step}; the "
                f"current code resumed from step {first - 1} and matches its uninterrupted run in "
                f"{', '.join(d.metric for d in diffs)} to step {spec.steps}{note}", reproduce)


def _observed(cmp: _Comparison, runs: tuple[RunResult, RunResult, RunResult], first: int,
              expected: dict[int, float]) -> list[str]:
    """The causes the step records of the current code's resume of base's checkpoint show against
    its uninterrupted run (each "cause: observation"), with what base's run saved; where they
    first differ is set on the evidence. Only to explain a failure: never a verdict."""
    reference, base, resumed = runs
    counted_from = 0 if 0 in expected else 1
    found, observed = observe_noisy_resume(cmp.ctx.recorded(reference).run_dir, resumed.run_dir, base.run_dir,
                                           tolerance=cmp.tol.ss_tolerance(), resumed_from=first - 1,
                                           counted_from=counted_from,
                                           last_printed=max(expected) if counted_from == 0 else cmp.spec.steps)
    if found is not None:
        cmp.evidence.first_divergence = found
    return [f"{RESUME_CAUSE_TEXT[c.key]}: {c.observation}" for c in observed]


def _control(ctx: CheckContext[CompatCheck], spec: CompatCheck, metric: str, resumed: RunResult, again: RunResult,
             tol: ToleranceUsed) -> TrajectoryEvidence | Uncompared:
    """The current code's resume of base's checkpoint against base's own resume of it: where they
    diverge (None: the same continuation)."""
    steps = sorted(aligned_trajectories(again.points, resumed.points, metric)[0])
    if not again.ok or not steps:
        return Uncompared(None, 0, again.reason or f"base's resume printed no `{metric}` line")
    return _diffs(ctx, spec, metric, resumed, again, steps[0], tol)[0].as_evidence()


def _requires(spec: CompatCheck, facts: JobFacts) -> list[tuple[str, str]]:
    problems = resume_problems(facts, f"checks.{_NAME}") + [
        p for i, name in enumerate(spec.metrics or []) for p in metric_problems(facts, f"checks.{_NAME}.metrics[{i}]", name)]
    root = repository_root(facts.job_file.cwd)
    if root is None:
        problems.append((f"checks.{_NAME}.base", f"the job's directory {facts.job_file.cwd} is not in a git "
                         "repository, so there is no older commit to check out. Fix: commit the job's code to git, "
                         "or remove checks.compat"))
    elif spec.base != PROMOTED:
        try:
            resolve_commit(root, spec.base)
        except GitError as exc:
            problems.append((f"checks.{_NAME}.base", f"{exc}. Fix: name a branch, tag or commit (`git log "
                             "--oneline` lists them), e.g. `base: main`, or `base: promoted`"))
    return problems


#: compat: an older commit's checkpoint resumed by the current code (docs/compat.md)
COMPAT: Check[CompatCheck] = Check(
    _NAME, CompatCheck, run=run_compat,
    runs=lambda spec, ctx: ([Run("reference", reference=True),
                             Run(f"base ({spec.base}) killed after step {spec.after_step}"),
                             Run("the current code resumed from base's checkpoint"),
                             Run("if that diverges unexplained: base resumed from its own checkpoint")],
                            "the current code, resumed from base's checkpoint, must match its own uninterrupted run"),
    requires=_requires,
    # a job file without checks.compat would fail a gate that required it: named in gate.require
    gate_default=False,
    calibrates=lambda spec: [None],
    evidence=(CompatEvidence,),
)
