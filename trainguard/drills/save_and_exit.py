"""The ``save_and_exit`` expectation of a pre-emption drill (``fault: preempt``).

After the scheduler's notice the job must, within the grace:

* exit on every rank by itself (a rank still running at the end of the grace is killed by the
  scheduler: whatever it did since its last periodic checkpoint is lost, and the report counts
  it);
* leave a complete checkpoint written after the notice (found by
  :func:`~trainguard.unit.checkpoints.latest_complete_checkpoint`, its newest file written after
  the notice): the report gives notice -> checkpoint complete -> last rank's exit;
* resume from it: a run resumed with the fault removed starts no earlier than the step the
  notice came after (``max_lost_steps``, default 0, allows fewer) and matches the uninterrupted
  run from there.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from trainguard.drills.evidence import PreemptionTimeline, SaveAndExitEvidence
from trainguard.drills.expectations import JudgeEntry
from trainguard.drills.judges import (
    DrillContext,
    Judgement,
    attempt_evidence,
    diff_problem,
    judge_injected,
    trajectory_diff,
)
from trainguard.evidence import known
from trainguard.faults.preempt import SignalSent
from trainguard.launch import RankExit, RunResult
from trainguard.unit.checkpoints import latest_complete_checkpoint

__all__ = ["SAVE_AND_EXIT", "SAVE_AND_EXIT_CAUSES", "died_of_the_notice", "judge_save_and_exit"]

_NOTICES = ("SIGTERM", "SIGUSR1")

#: what usually makes a job fail a pre-emption drill, most frequent first
SAVE_AND_EXIT_CAUSES = {
    "ignored": "no handler for the notice: SIGTERM (or Slurm's SIGUSR1) is ignored or caught and "
               "forgotten, so the job trains on until the SIGKILL and loses everything since its "
               "last periodic checkpoint",
    "no_agreement": "the ranks do not agree on the step to stop at (no all-reduce of the stop flag): "
                    "rank 0 saves in a collective the others have left, or they exit while it saves",
    "torn": "the save on the notice is not atomic (written in place, no temp file + fsync + rename): "
            "the SIGKILL at the end of the grace tears it",
    "slow": "the save takes longer than the grace: checkpoint less state, save asynchronously, or "
            "ask the scheduler for a longer grace (terminationGracePeriodSeconds, --signal lead)",
    "died": "no handler for the notice: the ranks died of the signal itself (Python's default for "
            "SIGTERM and SIGUSR1) and saved nothing; catch it, finish the step, checkpoint, exit 0",
}


def _newest_checkpoint(directory: Path) -> Path | None:
    """The newest complete checkpoint under ``directory``; for a layout
    :func:`latest_complete_checkpoint` does not know (per-rank JSON files, say), the newest file
    that is not a temporary (hidden, ``.tmp``, ``.partial``)."""
    found = latest_complete_checkpoint(directory)
    if found is not None:
        return found
    newest: tuple[float, Path] | None = None
    for root, _, files in os.walk(directory):
        for name in files:
            if name.startswith(".") or name.endswith((".tmp", ".partial", ".lock")):
                continue
            path = Path(root) / name
            try:
                mtime = path.stat().st_mtime
            except OSError:
                continue
            if newest is None or mtime > newest[0]:
                newest = (mtime, path)
    return newest[1] if newest is not None else None


def _newest_write(path: Path) -> float | None:
    """The latest modification time of a checkpoint file or of any file in a checkpoint directory."""
    try:
        if path.is_file():
            return path.stat().st_mtime
        times = [os.stat(os.path.join(root, f)).st_mtime for root, _, files in os.walk(path) for f in files]
    except OSError:
        return None
    return max(times, default=None)


def died_of_the_notice(exits: Sequence[RankExit], sent: Sequence[SignalSent], killed: Sequence[int]) -> list[int]:
    """The ranks the notice itself killed: each was sent SIGTERM or SIGUSR1 by the fault and ended
    of that signal, not of the SIGKILL at the end of the grace.

    The fault's record decides, not ``killed_by_trainguard``: when one rank dies of the notice,
    the launcher's teardown signals the others, and a rank already dying of the notice but not
    yet reaped would count as killed by the teardown (CI saw ``[0]`` for ``[0, 1]``).
    """
    notified = {rank for s in sent if s.signal in _NOTICES for rank in s.ranks}
    return sorted(e.rank for e in exits
                  if e.signal in _NOTICES and e.rank not in killed
                  and (e.rank in notified or not e.killed_by_trainguard))


def _stale_checkpoint(directory: Path, notice_wall: float | None, timeline: PreemptionTimeline) -> str | None:
    """What is wrong when the newest complete checkpoint under ``directory`` was not written
    after the notice (None when it was); puts it and when it was complete in ``timeline``."""
    latest = _newest_checkpoint(directory)
    written = _newest_write(latest) if latest is not None else None
    if latest is not None and written is not None and notice_wall is not None:
        timeline.checkpoint = str(latest)
        timeline.checkpoint_complete_after_notice_s = round(written - notice_wall, 3)
    fresh = latest is not None and written is not None and notice_wall is not None and written >= notice_wall
    if fresh:
        return None
    older = f" (the newest complete one, {latest.name}, predates it)" if latest is not None else ""
    return f"no complete checkpoint was written after the notice{older}"


def _resume_problems(c: DrillContext, verify: RunResult, evidence: SaveAndExitEvidence,
                     done: int) -> tuple[int | None, list[str]]:
    """The step the run resumed from the latest checkpoint (fault removed) started after, and
    what is wrong with it: it lost progress from before the notice, or it does not match the
    uninterrupted run. Fills the resume's fields of ``evidence``."""
    if not verify.ok:
        return None, [f"the run resumed from the latest checkpoint failed: {verify.reason}"]
    steps = [p.step for p in verify.points if p.name == c.metric]
    resumed_from = min(steps) - 1 if steps else None
    if resumed_from is None:
        return None, [f"the resumed run printed no `{c.metric}` line"]
    problems: list[str] = []
    noticed_at = c.info.injected_step or 0
    allowed = c.spec.max_lost_steps or 0
    lost_since_notice = max(0, noticed_at - resumed_from)
    evidence.resumed_from_step, evidence.lost_steps = resumed_from, max(0, done - resumed_from)
    evidence.lost_steps_before_notice = lost_since_notice
    if lost_since_notice > allowed:
        problems.append(f"the resume started after step {resumed_from}, {lost_since_notice} step(s) "
                        f"before the notice (after step {noticed_at}): progress from before the "
                        f"notice was lost (max_lost_steps {allowed})")
    diff = trajectory_diff(c, verify.points, range(resumed_from + 1, c.spec.steps + 1))
    evidence.trajectory = diff.as_evidence()
    problem = diff_problem(c.metric, diff, "run resumed after the pre-emption")
    if problem:
        problems.append(problem)
    return resumed_from, problems


def _likely_causes(killed: Sequence[int], exited: int, *, torn: bool, died_unsaved: bool) -> list[str]:
    """The causes of a failed drill, the one the evidence points at first: ranks stuck while
    others left (``killed`` of the ``exited`` ranks the fault saw go), no rank leaving, a torn
    save, ranks that died of the notice and saved nothing."""
    ignored, agree, slow = (SAVE_AND_EXIT_CAUSES[k] for k in ("ignored", "no_agreement", "slow"))
    causes: list[str] = []
    if killed and len(killed) < exited:  # some ranks left, the others were stuck
        causes = [agree, ignored, slow]
    elif killed:  # no rank exited by itself
        causes = [ignored, agree, slow]
    if torn:
        causes = [SAVE_AND_EXIT_CAUSES["torn"], *causes]
    if died_unsaved:
        causes = [SAVE_AND_EXIT_CAUSES["died"], *causes]
    return causes or [agree, SAVE_AND_EXIT_CAUSES["torn"]]


@judge_injected(SaveAndExitEvidence)
def judge_save_and_exit(c: DrillContext, evidence: SaveAndExitEvidence) -> Judgement:
    """Every rank exited within the grace after the notice, leaving a complete checkpoint written
    after it, and the run resumed from that checkpoint lost no progress from before the notice
    and matches the uninterrupted run."""
    spec, fault, first = c.spec, c.fault, c.run.attempts[0]
    grace = float(fault.params.number("grace")) if "grace" in fault.params else 30.0
    notice_wall = getattr(fault, "notice_wall", None)
    exits: dict[int, float] = dict(getattr(fault, "exits", {}))
    killed: list[int] = list(getattr(fault, "killed_at_grace", []))
    problems: list[str] = []
    done = max((p.step for p in first.points if p.name == c.metric), default=0)
    timeline = PreemptionTimeline(grace_s=grace, last_step_before_exit=done)
    if exits:
        timeline.exit_after_notice_s = max(exits.values())
    if first.ok and done >= spec.steps and not killed:
        return Judgement("error", f"the job did all {spec.steps} steps within the {grace:g} s grace after the notice "
                "(after step {noticed}), so the drill tested nothing; give it more steps after "
                "after_step, or a shorter grace".replace("{noticed}", str(c.info.injected_step)), evidence)
    if killed:
        problems.append(f"rank(s) {', '.join(map(str, killed))} did not exit within the {grace:g} s grace "
                        "and were killed (SIGKILL) by the scheduler")
    stale = _stale_checkpoint(c.checkpoint_dir, notice_wall, timeline)
    if stale is not None:
        problems.append(stale)
    evidence.preemption = timeline
    # the resume from the latest complete checkpoint, fault removed
    verify = c.runner.run(c.request, label=f"drill-{spec.name}-verify", resume=True,
                          checkpoint_dir=c.checkpoint_dir)
    evidence.verification = attempt_evidence(verify, fault)
    resumed_from, resume_problems = _resume_problems(c, verify, evidence, done)
    problems += resume_problems
    sent: list[SignalSent] = getattr(fault, "sent", [])
    signals = " then ".join(s.signal for s in sent[:2]) or "the notice"
    what = f"{signals} to every rank after step {c.info.injected_step or 0} (grace {grace:g} s)"
    if problems:
        died = died_of_the_notice(first.exits, sent, killed)
        died_unsaved = bool(died) and stale is not None
        # torn: the resume failed or diverged -- unless the ranks died of the notice and wrote
        # nothing after it (nanoGPT: no handler), which is no save to tear
        torn = ((not verify.ok or (resumed_from is not None and "diverges" in " ".join(problems)))
                and not died_unsaved)
        if died:
            evidence.died_of_the_notice = died
        causes = _likely_causes(killed, len(exits), torn=torn, died_unsaved=died_unsaved)
        evidence.likely_causes = causes
        return Judgement("failed", f"{what}: " + "; ".join(problems) + f". Most likely {causes[0]}", evidence)
    complete, exited = known(timeline.checkpoint_complete_after_notice_s), known(timeline.exit_after_notice_s)
    return Judgement("passed", f"{what}: checkpoint complete {complete or 0:.2f} s "
            f"and every rank exited {exited or 0:.2f} s after the notice; resumed after "
            f"step {resumed_from} and matched the uninterrupted run", evidence)


SAVE_AND_EXIT = JudgeEntry("save_and_exit", judge_save_and_exit)
