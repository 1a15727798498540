"""The smoke check: the job end to end for a few steps, every stage accounted for.

Stages, each timed in the evidence: launch -> first metric line, training (first -> last metric
line), exit, loading the checkpoint it wrote (``weights_only=True``), and a resume from that
checkpoint in new processes (``job.resume_args``) that must start right after the
checkpoint's step.
"""

from __future__ import annotations

import dataclasses
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trainguard._internal.readers import copy_tree
from trainguard.checks.context import CheckContext
from trainguard.config import SmokeCheck
from trainguard.config.registry import Check, PlanContext, Resumes, Run, check_for
from trainguard.evidence import UNSET, Evidence, Unset
from trainguard.launch import RunResult
from trainguard.launch.stops import ended_by_trainguard
from trainguard.report import CheckResult
from trainguard.run.declared import DeclaredRun
from trainguard.run.keep import KeptEvidence
from trainguard.run.request import RunRequest
from trainguard.unit.checkpoints import (
    CHECKPOINT_SUFFIXES,
    latest_complete_checkpoint,
    read_checkpoint,
)
from trainguard.unit.checkpoints.files import is_temp_name, step_in_name

__all__ = ["SMOKE", "NotKept", "ResumeCopy", "SmokeCheckpoint", "SmokeEvidence", "SmokeResume", "Stages", "checkpoint_step", "no_checkpoint_before_end", "run_smoke"]

#: extra steps the resume stage asks for beyond the first run's
RESUME_EXTRA_STEPS = 2



@dataclasses.dataclass
class SmokeCheckpoint(Evidence):
    """The checkpoint the smoke check read: the newest complete one (or, when none of its files
    loads here, the newest file, for the step its name holds)."""

    file: str
    #: whether any part of it loaded (``weights_only=True``); unset when nothing was tried
    loaded: bool | Unset = UNSET
    #: parts that were not loaded, and why
    skipped: dict[str, str] | Unset = UNSET
    step: int | Unset | None = UNSET
    #: the first 20 keys of its state (or files of a checkpoint directory)
    keys: list[str] | Unset = UNSET


@dataclasses.dataclass
class SmokeResume(Evidence):
    """The resume stage: a new run with ``job.resume_args`` from the checkpoint."""

    checkpoint_step: int | None
    steps: int
    first_step: int | None
    last_step: int | None
    outcome: str
    run_dir: str
    stderr_tail: str | Unset = UNSET


#: stage -> its seconds, or why it was skipped (None: no metric line came)
Stages = dict[str, float | str | None]


@dataclasses.dataclass
class NotKept(Evidence):
    """The shared checkpoint the resume stage would start from was not kept: why."""

    not_kept: str


@dataclasses.dataclass
class ResumeCopy(Evidence):
    """The resume stage's own copy of the checkpoints, and what the copy left out."""

    copy: str
    left_out: dict[str, str]


@dataclasses.dataclass
class SmokeEvidence(Evidence):
    """The smoke check's evidence (docs/smoke-and-canary.md)."""

    steps: int
    outcome: str
    #: how each rank ended, in words
    exits: list[str]
    #: each stage's seconds (``*_s``), or why it was skipped
    stages: Stages
    metric_steps_seen: int
    #: the last five checkpoint files
    checkpoint_files: list[str]
    run_dir: str
    stderr_tail: str | Unset = UNSET
    checkpoint: SmokeCheckpoint | Unset = UNSET
    #: set when the checkpoint names no step, so the last printed one stands for it
    checkpoint_step_from: str | Unset = UNSET
    resume: SmokeResume | Unset = UNSET
    #: the checkpoint the resume stage started from when it was kept from a shared run (or why
    #: none was kept)
    resume_from: KeptEvidence | NotKept | ResumeCopy | Unset = UNSET
    #: the step after which trainguard ended the run itself (``job.stop_after_steps``)
    ended_by_trainguard: int | Unset = UNSET


def _checkpoint_files(directory: Path) -> list[Path]:
    """The files of the checkpoint directory, none of a save in progress: a temporary name
    (``.x``, ``x.tmp``, ``x.tmp.123``, ``tmp*``) of the file or of a folder it is in is a write
    not yet renamed into place (a kept copy taken between the write and the rename holds one)."""
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.rglob("*") if p.is_file()
                  and not any(is_temp_name(part) for part in p.relative_to(directory).parts))


def checkpoint_step(path: Path, state: Any = None) -> int | None:
    """The training step a checkpoint was taken at: its ``step`` key when the loaded ``state``
    has an integer one, else the number after ``step``/``iter``/``ckpt`` in the file name, else
    the last number in the name; None when there is none."""
    step: Any = state.get("step") if isinstance(state, dict) else None
    if isinstance(step, int) and not isinstance(step, bool):
        return step
    if hasattr(step, "item"):  # a 0-d tensor
        try:
            return int(step.item())
        except (TypeError, ValueError, RuntimeError):
            pass
    return step_in_name(path.name)  # a date in the name (Ray Train's directories) is no step


def _state_with_step(parts: dict[str, Any]) -> Any:
    """Of a checkpoint directory's loaded files, the first mapping with an integer step key
    (``step``, ``global_step``, ``iter_num``, ``iteration``), as ``{"step": ...}``. A file of
    RNG states is not one: accelerate's ``random_states_0.pkl`` holds its own ``step`` (the
    gradient-accumulation counter), not the training step."""
    from trainguard.unit.checkpoints.state import classify_path

    for part, value in parts.items():
        if classify_path(part, ())[0] == "rng":
            continue
        if isinstance(value, dict):
            for key in ("step", "global_step", "iter_num", "iteration"):
                step = value.get(key)
                if isinstance(step, int) and not isinstance(step, bool):
                    return {"step": step}
    return None


def no_checkpoint_before_end(job_file: Any, checkpoint_dir: Path, step: int, key: str = "job.stop_after_steps") -> str:
    """Why a check that needs a checkpoint found none in a run trainguard ended after ``step``
    (``job.stop_after_steps``; ``key``: what set the step), with the fix."""
    return (f"{job_file.path}: {key}: trainguard ended the run after step {step}, and the script "
            f"wrote no checkpoint to {checkpoint_dir} by then (one that saves only at an epoch's end or at exit "
            "never gets there). Fix: make the script save every few steps (an option such as --save-every), "
            "or raise the check's steps past its first save, or remove {checkpoint_dir} from job.command and "
            "the checks that resume")


def run_smoke(ctx: CheckContext[SmokeCheck]) -> CheckResult:
    """Passes when the job exits 0 within its limit, printed a metric for every step, (when it
    is given ``{checkpoint_dir}``) wrote a checkpoint there that loads with
    ``weights_only=True``, and (when ``job.resume_args`` is set) resumes from it in new
    processes at the step after the checkpoint's."""
    started = time.monotonic()
    job_file = ctx.job_file
    job = job_file.job
    declared = list(ctx.runs)
    folded = declared[0].run.reference
    request = declared[0].request
    resume_request = dataclasses.replace(request, steps=request.steps + RESUME_EXTRA_STEPS)
    reproduce = ctx.command_line(request)
    if job.resume_args:
        reproduce += f"  # then: {ctx.command_line(resume_request, resume=True)}"
    # folded: the uninterrupted run another check of the session makes anyway (docs/smoke-and-canary.md)
    result = ctx.reference(declared[0].run) if folded else ctx.run(declared[0].run, label="smoke")
    problems: list[str] = []
    stages: Stages = {
        "launch_to_first_metric_s": result.first_metric_s,
        "total_s": round(result.duration_s, 3),
    }
    if result.points:
        last = max(p.t for p in result.points)
        stages["first_to_last_metric_s"] = round(last - (result.first_metric_s or 0.0), 3)
        stages["last_metric_to_exit_s"] = round(result.duration_s - last, 3)
    if not result.ok:
        problems.append(f"the job did not complete: {result.reason}")
    metric = job.progress_metric
    seen = set(result.trajectory(metric))
    # steps counted from 1, or from 0 (nanoGPT's `iter 0`, an `epoch 0` line)
    base = 0 if 0 in seen else 1
    missing = [s for s in range(base, base + request.steps) if s not in seen]
    # a rank that crashed is the cause of the missing lines: "check job.metrics" would mislead
    # (a hung or timed-out run keeps it: a regex that matches nothing looks like a hang)
    if missing and result.outcome != "failed":
        problems.append(
            f"no `{metric}` line for step(s) {missing[:10]}{' ...' if len(missing) > 10 else ''} "
            f"(check job.metrics.{metric} against the job's output in {result.run_dir})"
        )
    checkpoint_dir = result.checkpoints
    latest = latest_complete_checkpoint(checkpoint_dir)
    if job.resume_args and latest is not None:  # the checkpoint's own name in the line's directory
        resume_line = ctx.command_line(resume_request, resume=True,
                                          latest_checkpoint=latest.relative_to(checkpoint_dir))
        reproduce = f"{ctx.command_line(request)}  # then: {resume_line}"
    uses_checkpoints = ctx.checkpoints_known
    files = _checkpoint_files(checkpoint_dir)
    ended = ended_by_trainguard(result.evidence)
    evidence = SmokeEvidence(
        steps=request.steps, outcome=result.outcome, exits=[e.describe for e in result.exits],
        stages=stages, metric_steps_seen=len(seen), checkpoint_files=[str(p) for p in files[-5:]],
        run_dir=str(result.run_dir),
    )
    if ended is not None:
        evidence.ended_by_trainguard = ended
    if uses_checkpoints and result.ok and not files:
        if ended is not None and not problems:  # not the job's failure: nothing could be tested
            return CheckResult("smoke", "error", no_checkpoint_before_end(ctx.job_file, checkpoint_dir, ended),
                               evidence, time.monotonic() - started, reproduce)
        problems.append(f"no checkpoint was written to {checkpoint_dir}")
    if not result.ok:
        evidence.stderr_tail = result.stderr_tail

    resume_note = ""
    if not problems and files:
        problem, resume_note = _checkpoint_stages(ctx, declared, resume_request, _FirstRun(result, files, metric, base),
                                                  stages, evidence)
        if problem is not None:
            problems.append(problem)
    elif not problems and not uses_checkpoints:
        stages["checkpoint_load"] = stages["resume"] = "skipped: the job is not given {checkpoint_dir}"

    duration = time.monotonic() - started
    if problems:
        return CheckResult("smoke", "failed", "; ".join(problems), evidence, duration, reproduce)
    return CheckResult(
        "smoke",
        "passed",
        f"{request.steps} steps in {result.duration_s:.1f} s, metrics for every step"
        + (f", ended by trainguard after step {ended} (job.stop_after_steps)" if ended is not None else "")
        + (" (the uninterrupted run the other checks share)" if folded else "")
        + (f", {len(files)} checkpoint file(s)" if files else "")
        + resume_note,
        evidence,
        duration,
        reproduce,
    )


@dataclasses.dataclass(frozen=True)
class _FirstRun:
    """The smoke run as its checkpoint stages read it: its result, the checkpoint files it wrote, its progress metric and first step."""

    result: RunResult
    files: list[Path]
    metric: str
    base: int


def _checkpoint_stages(
    ctx: CheckContext[SmokeCheck], declared: list[DeclaredRun], resume_request: RunRequest, first: _FirstRun,
    stages: Stages, evidence: SmokeEvidence,
) -> tuple[str | None, str]:
    """Load the checkpoint the run wrote in ``first.result.checkpoints``, then (with
    ``job.resume_args``) resume from it; (the problem or None, the summary's note on the resume)."""
    result, files, metric, base = first.result, first.files, first.metric, first.base
    checkpoint_dir = result.checkpoints
    ckpt_step, load_problem = _load_stage(files, checkpoint_dir, stages, evidence)
    if load_problem is not None:
        return load_problem, ""
    if not ctx.job_file.job.resume_args:
        stages["resume"] = "skipped: job.resume_args is empty, so the job cannot be resumed"
        return None, ""
    if ckpt_step is None:
        ckpt_step = result.last_step  # no step in the file: the last one printed
        evidence.checkpoint_step_from = "the first run's last printed step"
    launch, resume_request, ckpt_step = _resumed_run(
        ctx, declared, resume_request, checkpoint_dir, ckpt_step, evidence)
    resume_problem = _resume_stage(launch, resume_request, metric, ckpt_step, stages, evidence, base)
    if resume_problem is not None:
        return resume_problem, ""
    if isinstance(evidence.resume, SmokeResume):
        return None, f"; resumed from the checkpoint of step {ckpt_step} at step {evidence.resume.first_step}"
    return None, ""


def _load_stage(
    files: list[Path], checkpoint_dir: Path, stages: Stages, evidence: SmokeEvidence
) -> tuple[int | None, str | None]:
    """Read the newest complete checkpoint (a file or a checkpoint directory, every file of it
    that loads safely); (its step, the problem or None)."""
    newest = latest_complete_checkpoint(checkpoint_dir)
    if newest is None:
        # e.g. JSON files only: not loadable here, but their names may give the step
        last = max(files, key=lambda p: (p.stat().st_mtime, p.name))
        stages["checkpoint_load"] = (
            f"skipped: no file with a torch suffix ({', '.join(CHECKPOINT_SUFFIXES)}), nor a "
            f".safetensors file or checkpoint directory, among {len(files)} file(s)"
        )
        evidence.checkpoint = SmokeCheckpoint(str(last), step=checkpoint_step(last))
        return checkpoint_step(last), None
    t0 = time.monotonic()
    contents = read_checkpoint(newest)
    stages["checkpoint_load_s"] = round(time.monotonic() - t0, 3)
    state = contents.parts.get("")
    if state is None:  # a directory: the Trainer's state names the step
        trainer_state = contents.parts.get("trainer_state.json")
        if isinstance(trainer_state, dict):
            state = {"step": trainer_state.get("global_step")}
        else:  # another directory layout (Ray Train's): a file in it that names its step
            state = _state_with_step(contents.parts)
    elif isinstance(state, dict) and "step" not in state:
        counter = next((k for k in ("global_step", "iter_num", "iteration") if k in state), None)
        if counter is not None:  # Lightning's .ckpt; nanoGPT's ckpt.pt
            state = {**state, "step": state[counter]}
    read = evidence.checkpoint = SmokeCheckpoint(str(newest), loaded=bool(contents.parts))
    if contents.skipped:
        read.skipped = dict(contents.skipped)
    if not contents.parts:
        why = "; ".join(f"{name}: {reason}" for name, reason in contents.skipped.items())
        return None, f"the checkpoint does not load: {newest} ({why})"
    step = checkpoint_step(newest, state)
    read.step = step
    read.keys = (sorted(str(k) for k in state)[:20] if isinstance(state, dict) and "" in contents.parts
                 else list(contents.files[:20]))
    return step, None


def _resumed_run(
    ctx: CheckContext[SmokeCheck], declared: list[DeclaredRun], request: RunRequest, checkpoint_dir: Path,
    ckpt_step: int | None, evidence: SmokeEvidence,
) -> tuple[Callable[[], RunResult], RunRequest, int | None]:
    """The resume stage's run: the run the session resumes from a checkpoint kept mid-run (the
    resume check's, shared) when smoke declared it and the checkpoint was kept; else ``request``
    resumed from a copy of ``checkpoint_dir`` (the first run's checkpoints stay as they were: a
    folded run is another check's reference). (launch, its request, the checkpoint's step)."""
    shared = declared[-1] if declared[-1].run.resumes is not None else None
    if shared is not None and shared.source is not None and shared.run.resumes is not None:
        kept, why = ctx.pool.kept(shared.source, shared.run.resumes.after_step)
        if kept is not None:
            step, _ = _load_stage(_checkpoint_files(kept.directory) or [kept.directory], kept.directory, {},
                                  SmokeEvidence(0, "", [], {}, 0, [], ""))
            evidence.resume_from = kept.as_evidence()
            return (lambda: ctx.pool.resume_kept(kept, shared.request, label=f"resumed-after-step-{kept.after_step}"),
                    shared.request, step if step is not None else kept.step)
        evidence.resume_from = NotKept(why)

    def own() -> RunResult:
        copy = checkpoint_dir.parent / "smoke-resume" / "checkpoints"
        shutil.rmtree(copy.parent, ignore_errors=True)
        left_out = copy_tree(checkpoint_dir, copy)
        if left_out:
            evidence.resume_from = ResumeCopy(str(copy), left_out)
        if shared is None:
            return ctx.run(declared[-1].run, label="smoke-resume", resume=True, checkpoint_dir=copy)
        # the resumed run smoke shares could not be had (nothing kept): its own stands in
        return ctx.pool.stand_in(request, label="smoke-resume", resume=True, checkpoint_dir=copy)

    return own, request, ckpt_step


def _resume_stage(
    launch: Callable[[], RunResult],
    request: RunRequest,
    metric: str,
    ckpt_step: int | None,
    stages: Stages,
    evidence: SmokeEvidence,
    base: int = 1,
) -> str | None:
    """Resume in new processes with ``resume_args``; the problem or None. ``base``: the first
    step the job prints (1, or 0 for a job counting from 0)."""
    resumed = launch()
    stages["resume_s"] = round(resumed.duration_s, 3)
    printed = resumed.trajectory(metric)
    first = min(printed) if printed else None
    evidence.resume = SmokeResume(
        checkpoint_step=ckpt_step, steps=request.steps, first_step=first,
        last_step=max(printed) if printed else None, outcome=resumed.outcome, run_dir=str(resumed.run_dir),
    )
    if not resumed.ok:
        evidence.resume.stderr_tail = resumed.stderr_tail
        return f"the resumed run did not complete: {resumed.reason}"
    if first is None:
        return f"the resumed run printed no `{metric}` line"
    # a step counter in a checkpoint counts the steps done (resume at step+1) or names the step
    # to run next (nanoGPT saves iter_num at the top of its iteration: resume at step); without
    # one in the file the step is the last one printed, and any later start than step 1 resumed
    guessed = evidence.checkpoint_step_from is not UNSET
    allowed = range(base + 1, ckpt_step + 2) if guessed and ckpt_step is not None else (
        (ckpt_step, ckpt_step + 1) if ckpt_step is not None else ())
    if ckpt_step is not None and first not in allowed:
        if first == base:
            return (
                f"the resumed run started again from step {base} instead of step {ckpt_step + 1} (the "
                f"checkpoint is of step {ckpt_step}): does job.resume_args make the job load the "
                "latest checkpoint in {checkpoint_dir}?"
            )
        return (
            f"the resumed run started at step {first}, expected step {ckpt_step + 1} (right "
            f"after the checkpoint of step {ckpt_step})"
        )
    if max(printed) < base + request.steps - 1:
        return f"the resumed run stopped at step {max(printed)}, not at step {base + request.steps - 1}"
    return None


def _same_run(a: Any, b: Any) -> bool:
    """Whether two specs launch the same job: seed, args and env."""
    return (a.seed, tuple(a.args), dict(a.env or {})) == (b.seed, tuple(b.args), dict(b.env or {}))


def _smoke_runs(spec: SmokeCheck, ctx: PlanContext) -> tuple[list[Run], str]:
    """Smoke's own short run and its resume; or, when another check of the session makes an
    uninterrupted run of the same job at its world size (at least ``steps`` long), that run
    (the shortest) and, when a check resumes it from a checkpoint kept mid-run, that resumed
    run: a smoke failure is still reported as smoke, and the runs are launched once."""
    job = ctx.job_file.job
    resumes = bool(job.resume_args)
    host: tuple[int, Any] | None = None
    kept: int | None = None
    for name, other in ctx.session:
        kind = check_for(name)
        if name == "smoke" or kind is None or not hasattr(other, "steps") or not _same_run(spec, other):
            continue
        for run in kind.runs(other, PlanContext(ctx.job_file, ctx.soak_seed))[0]:
            steps = run.steps if run.steps is not None else other.steps
            if run.reference and run.world_size in (None, job.world_size) and steps >= spec.steps and (
                    host is None or steps < host[0]):
                host, kept = (steps, other), None
            if (host is not None and run.resumes is not None and steps == host[0]
                    and run.world_size in (None, job.world_size) and run.resumes.world_size in (None, job.world_size)):
                kept = run.resumes.after_step
    if host is None:
        return ([Run("smoke run"), *([Run("resumed from its checkpoint", steps=spec.steps + RESUME_EXTRA_STEPS)]
                                     if resumes else [])],
                "the job runs end to end and its metrics are read"
                + (", then resumes from the checkpoint it wrote" if resumes else ""))
    steps = host[0]
    runs = [Run(f"the uninterrupted run of {steps} steps other checks make (shared)", steps=steps, reference=True)]
    if resumes:
        runs.append(Run(f"resumed from the checkpoint kept after step {kept}", steps=steps, resumes=Resumes(kept))
                    if kept is not None else Run("resumed from a copy of its last checkpoint",
                                                 steps=steps + RESUME_EXTRA_STEPS))
    return runs, (f"folded into the uninterrupted run of {steps} steps the session makes anyway: it runs end "
                  "to end and its metrics are read" + (", then resumes" if resumes else ""))


#: the smoke check (docs/smoke-and-canary.md)
SMOKE: Check[SmokeCheck] = Check(
    "smoke", SmokeCheck, run=run_smoke, runs=_smoke_runs, lane=True, evidence=(SmokeEvidence,),
)
