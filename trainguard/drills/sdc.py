"""The expectations of a silent data corruption drill (``fault: sdc``): ``caught`` and ``detect``.

One bit of one element of a tensor was flipped on one rank at one step (:mod:`trainguard.faults.sdc`).

* ``caught`` (the default): trainguard's own records name it. A flip in a parameter, the optimizer
  state or a reduced gradient stays on its rank: the replica invariant
  (:func:`trainguard.checks.invariants.replica_findings`) must name that tensor at that step, with
  the rank among those it names. A flip in a module's output or in a gradient before DDP's
  reduction enters one rank's gradient, which the all-reduce averages into every rank: the
  replicas stay equal and cannot show it, so the step records of the drill's run are compared with
  the uninterrupted reference's (:func:`trainguard.checks.divergence.first_divergence`), which must
  first differ at the flip's step. So is a flip in a sharded tensor (FSDP2's ``Shard`` placement):
  no other rank holds a replica of it.
* ``detect``: the job's own defence reports it: a rank exits non-zero by itself, or prints
  ``params.detect_pattern``, before any rank printed step ``flip step + within_steps``. A job that
  trains on through it fails, saying it has no defence, with what trainguard saw.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from trainguard.checks.divergence import Agreement, Divergence, first_divergence
from trainguard.checks.invariants import replica_findings, replicated
from trainguard.checks.invariants_check import FindingEvidence
from trainguard.checks.invariants_records import Finding
from trainguard.drills.evidence import Detected, SilentCorruptionEvidence
from trainguard.drills.expectations import JudgeEntry
from trainguard.drills.judges import DrillContext, Judgement, common_evidence
from trainguard.faults.sdc import Flip, SdcFault
from trainguard.launch import RunResult
from trainguard.launch.steps import StepRecords, read_steps

__all__ = ["CAUGHT", "DETECT", "REPLICAS_BLIND", "SHARD_BLIND", "judge_caught", "judge_detect"]

#: target -> the kind the replica invariant names it by (the others it cannot see)
_REPLICA_KIND = {"parameter": "parameter", "optimizer_state": "optimizer state", "gradient": "gradient"}
#: why the replicas cannot show a flip the reduction averages into every rank
REPLICAS_BLIND = ("the flip went into rank {rank}'s {what} before the gradients' reduction (DDP's all-reduce, "
                  "FSDP's reduce-scatter), which averages that rank's gradient into every rank's: every rank takes "
                  "the same corrupted update (to its replica, or to its shard), so nothing differs across ranks and "
                  "the replica invariant cannot show it; only a run without the flip (the uninterrupted reference) "
                  "can")
#: why the replicas cannot show a flip in a sharded tensor
SHARD_BLIND = ("rank {rank}'s {what} is a shard ({placement}): no other rank holds a replica of it, so the replica "
               "invariant has nothing to compare it with; only a run without the flip (the uninterrupted reference) "
               "can show it")


def _flips(c: DrillContext) -> list[Flip]:
    flips = c.fault.flips() if isinstance(c.fault, SdcFault) else []
    return flips


def _no_flip(c: DrillContext, evidence: SilentCorruptionEvidence) -> Judgement:
    fault_evidence = evidence.fault_evidence
    errors = fault_evidence.get("hook_errors") or []
    why = (f"the start-up hook did not arm in rank {c.spec.rank} (is the job a Python process started by trainguard?)"
           if fault_evidence.get("hook_armed_in_ranks") == [] else
           f"the hook reported: {errors[0]}" if errors else
           f"rank {c.spec.rank} ran no optimizer step {c.spec.after_step + 1} with that tensor")
    return Judgement("error", f"no bit was flipped: {why}; nothing was tested", evidence)


def _started(c: DrillContext) -> tuple[SilentCorruptionEvidence, Flip | None]:
    evidence = common_evidence(c, SilentCorruptionEvidence)
    flips = _flips(c)
    evidence.flips = len(flips)
    evidence.flipped = flips[0] if flips else None
    return evidence, evidence.flipped


def _named(findings: Sequence[Finding], flip: Flip) -> Finding | None:
    kind = _REPLICA_KIND[flip.target]
    return next((f for f in findings if f.step == flip.step and f.name == flip.tensor
                 and flip.rank in f.ranks and f"the {kind} differs" in f.observation), None)


def judge_caught(c: DrillContext) -> Judgement:
    """caught: the replica invariant names a flip that stays on its rank; the first divergence from
    the reference one the reduction averaged into every rank."""
    evidence, flip = _started(c)
    if flip is None:
        return _no_flip(c, evidence)
    said = flip.sentence(evidence.flips)
    run = c.run.attempts[0]
    steps = read_steps(run.run_dir)
    if not steps.has_steps:
        return Judgement("error", f"{said}; the drill's run left no step records to look for it in (job.record_steps: "
                         "false, or ranks that are not Python): nothing was compared", evidence)
    findings, coverage = replica_findings(steps)
    evidence.replica_findings = [FindingEvidence.of(f) for f in findings]
    placement = _placement(steps, flip)
    if flip.target in _REPLICA_KIND and not replicated(placement):
        blind = SHARD_BLIND.format(rank=flip.rank, what=flip.what(), placement=placement)
        return _by_reference(c, evidence, flip, said, findings, blind)
    if flip.target in _REPLICA_KIND:
        named = _named(findings, flip)
        if named is not None:
            return Judgement("passed", f"{said}; the replica invariant named it: {named.sentence()}", evidence)
        seen = findings[0].sentence() if findings else f"no finding ({coverage.what or coverage.reason})"
        return Judgement("failed", f"{said}; the replica invariant did not name it at that step: {seen}", evidence)
    return _by_reference(c, evidence, flip, said, findings, REPLICAS_BLIND.format(rank=flip.rank, what=flip.what()))


def _placement(steps: StepRecords, flip: Flip) -> str | None:
    """The flipped parameter's placement as its rank recorded it (None: a plain tensor)."""
    rank = steps.ranks.get(flip.rank)
    first = rank.steps[0] if rank is not None and rank.steps else None
    return first.placement.get(flip.tensor) if first is not None else None


def _by_reference(c: DrillContext, evidence: SilentCorruptionEvidence, flip: Flip, said: str,
                  findings: Sequence[Finding], blind: str) -> Judgement:
    evidence.replicas_blind = blind
    found = first_divergence(read_steps(c.reference.run_dir), read_steps(c.run.attempts[0].run_dir))
    evidence.first_divergence = found.as_evidence("the drill's run")
    replicas = (f"; the replicas differ too ({findings[0].sentence()})" if findings
                else "; the replicas stayed equal, as they must: " + evidence.replicas_blind)
    if isinstance(found, Divergence):
        if found.step == flip.step:
            return Judgement("passed", f"{said}; the first divergence from the uninterrupted run names it: "
                             f"{found.sentence('the drill')}{replicas}", evidence)
        if found.step < flip.step:
            return Judgement("error", f"{said}; but the drill's run parted from the uninterrupted one before the flip "
                             f"({found.sentence('the drill')}): the job is not bitwise reproducible, so the flip "
                             "cannot be told from its own noise; seed it and set torch.use_deterministic_algorithms",
                             evidence)
        return Judgement("failed", f"{said}; the first divergence from the uninterrupted run is later: "
                         f"{found.sentence('the drill')}", evidence)
    if isinstance(found, Agreement):
        return Judgement("failed", f"{said}; yet {found.sentence('the drill')}: the flip changed nothing the step "
                         "records show (a tensor the step does not use, or an element a dropout zeroed?)", evidence)
    return Judgement("error", f"{said}; {found.sentence()}", evidence)


def _metric_step(line: str, patterns: Sequence[str]) -> int | None:
    for pattern in patterns:
        match = re.search(pattern, line)
        if match is not None and "step" in match.groupdict():
            try:
                return int(match.group("step"))
            except (TypeError, ValueError):
                return None
    return None


def _pattern_at(run: RunResult, pattern: str, metric_lines: Sequence[str]) -> tuple[int, int | None, str] | None:
    """(rank, the last step that rank printed before the line, the line) of the first line
    matching ``pattern`` in a rank's stdout, then its stderr (whose step: the rank's last)."""
    regex = re.compile(pattern)
    for rank in range(run.world_size):
        last = None
        for stream in ("stdout", "stderr"):
            try:
                text = run.log_path(rank, stream).read_text(errors="replace")[-4 * 2**20:]
            except OSError:
                continue
            for line in text.splitlines():
                if stream == "stdout":
                    step = _metric_step(line, metric_lines)
                    last = step if step is not None else last
                if regex.search(line):
                    if stream == "stderr":
                        last = max((p.step for p in run.points if p.rank == rank), default=last)
                    return rank, last, line.strip()[:300]
    return None


def judge_detect(c: DrillContext) -> Judgement:
    """detect: the job's own defence reports the flip within ``within_steps`` optimizer steps."""
    evidence, flip = _started(c)
    if flip is None:
        return _no_flip(c, evidence)
    said = flip.sentence(evidence.flips)
    params = c.fault.params
    within = int(str(params.raw("within_steps", 2)))
    pattern = str(params.raw("detect_pattern", "") or "")
    step = flip.step
    deadline = step + within
    run = c.run.attempts[0]
    printed = max((p.step for p in run.points if p.name == c.metric), default=0)
    hit = _pattern_at(run, pattern, c.metric_lines) if pattern else None
    if hit is not None:
        rank, last, line = hit
        evidence.detected = Detected("pattern", rank, last, line)
        at = last if last is not None else printed
    elif (failed := next((e for e in run.exits if e.returncode and not e.killed_by_trainguard), None)) is not None:
        evidence.detected = Detected("exit", failed.rank, printed, run.reason or run.outcome)
        at = printed
    else:
        caught = judge_caught(c)
        return Judgement("failed", f"{said}; the job has no defence against it: it "
                         f"{'completed' if run.ok else 'ended (' + (run.reason or run.outcome) + ')'} without "
                         f"exiting non-zero{' or printing ' + repr(pattern) if pattern else ''} (what trainguard "
                         f"saw: {caught.summary.removeprefix(said + '; ')}); compare a checksum of the parameters "
                         "across ranks every step (an all-reduce of a few numbers) and exit non-zero on a mismatch",
                         evidence)
    if at < deadline:
        how = (f"rank {hit[0]} printed {hit[2]!r}" if hit is not None
               else f"the job exited non-zero ({run.reason or run.outcome})")
        return Judgement("passed", f"{said}; the job's defence reported it: {how}, with step {at} its last printed "
                         f"(within {within} step(s) of the flip)", evidence)
    return Judgement("failed", f"{said}; the job's defence reported it too late: its ranks had printed step {at} "
                     f"(the flip's step + {at - step}), and within_steps is {within}: check every step", evidence)


CAUGHT = JudgeEntry("caught", judge_caught)
DETECT = JudgeEntry("detect", judge_detect)
