"""The plan of a job file's checks, made without launching anything (``trainguard validate``).

:func:`make_plan` loads and validates the job file as a launch would
(:func:`~trainguard.config.load_config`, then :func:`~trainguard.config.preflight.preflight`),
and lists the runs each check will launch, the uninterrupted reference runs two checks share
(equal requests are launched once), the runs started early beside earlier checks, the drills and
an estimate of the time: the last report's durations when there is one, and always the worst
case, each run's timeout.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainguard._internal.limits import MAX_SECONDS
from trainguard._internal.readers import OWN_FILE_LIMITS, Unreadable, read_json
from trainguard.config import CheckSpec, JobFile, load_config
from trainguard.config.backends import backend_for
from trainguard.config.preflight import preflight
from trainguard.config.registry import check_for
from trainguard.config.settings import Settings
from trainguard.run.declared import declared_runs
from trainguard.run.request import RunRequest, share_key

__all__ = ["CheckPlan", "Plan", "PlannedRun", "make_plan"]


@dataclass(frozen=True)
class PlannedRun:
    """One launch a check makes: what it is for, its length and ranks, and whether it is an
    uninterrupted reference run (launched once for every check that asks for the same one) or a
    run resumed from a kept checkpoint (likewise)."""

    label: str
    steps: int
    world_size: int
    timeout_s: float
    reference: RunRequest | None = None
    #: runs with an equal key are launched once (None: this one always launches)
    share: Hashable | None = None

    def describe(self) -> str:
        return f"{self.label}: {self.steps} steps x {self.world_size} rank(s)"


@dataclass
class CheckPlan:
    """The runs of one check, and what the last report says it took."""

    name: str
    runs: list[PlannedRun]
    note: str = ""
    last_duration_s: float | None = None


@dataclass
class Plan:
    """What ``trainguard check`` (or ``drill``, ``gate``) would launch for a job file."""

    job_file: JobFile
    checks: list[CheckPlan]
    #: runs of later checks started in the background beside earlier ones
    ahead: list[str] = field(default_factory=list)
    #: where the "last time" durations come from (None: no earlier report here)
    history: str | None = None

    def distinct_runs(self) -> list[PlannedRun]:
        """Every run launched, a reference run that several checks ask for once."""
        seen: set[Hashable] = set()
        out = []
        for check in self.checks:
            for run in check.runs:
                if run.share is not None:
                    if run.share in seen:
                        continue
                    seen.add(run.share)
                out.append(run)
        return out

    @property
    def launches(self) -> int:
        """Distinct runs launched: a reference run two checks ask for counts once."""
        return len(self.distinct_runs())

    def shared(self) -> list[tuple[str, list[str]]]:
        """Each reference run asked for by more than one check, with those checks."""
        users: dict[Hashable, list[str]] = {}
        labels: dict[Hashable, str] = {}
        for check in self.checks:
            for run in check.runs:
                if run.share is not None:
                    users.setdefault(run.share, []).append(check.name)
                    what = "reference run" if run.reference is not None else "resumed run"
                    labels[run.share] = f"{what} of {run.steps} steps x {run.world_size} rank(s)"
        return [(labels[r], names) for r, names in users.items() if len(set(names)) > 1]

    @property
    def worst_case_s(self) -> float:
        """Every run to its timeout, one after the other (shared runs once)."""
        return sum(run.timeout_s for run in self.distinct_runs())

    @property
    def estimate_s(self) -> float | None:
        """The sum of the last report's durations of these checks, when every one has one."""
        known = [c.last_duration_s for c in self.checks]
        if not known or any(d is None for d in known):
            return None
        return sum(d for d in known if d is not None)

    @property
    def cost(self) -> Any:
        """:class:`trainguard.session.cost.Cost` of these launches, estimated from the launches
        of the last gate here (``.trainguard/gate/latest.json``) when there is one."""
        from trainguard.session.cost import launch_shapes, planned_cost, records_from_report

        last = self.job_file.state_dir / "gate" / "latest.json"
        target = self.job_file.target
        return planned_cost(launch_shapes(self), records_from_report(last) if last.is_file() else [],
                            str(last), target.startup_minutes if target is not None else None)

    def as_dict(self) -> dict[str, Any]:
        return {
            "job": self.job_file.job.name,
            "job_file": str(self.job_file.path),
            "valid": True,
            "checks": [
                {"name": c.name, "note": c.note, "last_duration_s": c.last_duration_s,
                 "runs": [{"label": r.label, "steps": r.steps, "world_size": r.world_size,
                           "timeout_s": r.timeout_s, "shared_reference": r.reference is not None}
                          for r in c.runs]}
                for c in self.checks
            ],
            "launches": self.launches,
            "shared_references": [{"run": run, "checks": names} for run, names in self.shared()],
            "started_ahead": self.ahead,
            "estimate_s": self.estimate_s,
            "estimate_from": self.history,
            "worst_case_s": self.worst_case_s,
            "cost": {k: v for k, v in self.cost.to_dict().items() if k != "records"},
        }

    def lines(self) -> list[str]:
        """The plan as a person reads it."""
        job = self.job_file.job
        out = [f"job {job.name} ({job.kind}, {job.world_size} rank(s)), working directory {self.job_file.cwd}"]
        if not self.checks:
            out.append("no checks configured: add a `checks:` section (see docs/config.md)")
        for check in self.checks:
            took = f"; took {check.last_duration_s:.0f} s last time" if check.last_duration_s is not None else ""
            out.append(f"  {check.name}: {len(check.runs)} run(s){took}")
            if check.note:
                out.append(f"      {check.note}")
            for run in check.runs:
                share = (" (reference run, shared)" if run.reference is not None
                         else " (shared)" if run.share is not None else "")
                out.append(f"      - {run.describe()}{share}")
        for shape, names in self.shared():
            out.append(f"shared: the {shape} is launched once for {', '.join(dict.fromkeys(names))}")
        for ahead in self.ahead:
            out.append(f"started early, beside the checks before it: {ahead}")
        estimate = self.estimate_s
        guess = (f"about {_minutes(estimate)} (the last report: {self.history})" if estimate is not None
                 else "unknown until it has run once here (no earlier report for these checks)")
        out.append(f"{self.launches} launch(es); time: {guess}; at most {_minutes(self.worst_case_s)} "
                   "if every run went to its timeout")
        out.append(self.cost.line())
        return out


def _minutes(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


def make_plan(config: str | Path | JobFile, settings: Settings, *, only: Iterable[str] | None = None) -> Plan:
    """Load, validate and preflight ``config``; the plan of the checks ``only`` names (all when
    None). Raises :class:`~trainguard.errors.ConfigError` for anything a launch would trip on."""
    job_file = config if isinstance(config, JobFile) else load_config(config)
    preflight(job_file)
    enabled = job_file.enabled_checks(only)
    history, durations = _last_durations(job_file)
    kinds = [check_for(n) for n, _ in enabled]
    firsts = [kind is not None and kind.first for kind in kinds]
    # a check that times its runs goes first, alone (run_in_order); its runs serve the others
    order = sorted(range(len(enabled)), key=lambda i: not firsts[i])
    planned = {i: _runs(job_file, enabled[i][0], enabled[i][1], settings, enabled) for i in order}
    checks = [CheckPlan(name, *planned[i], last_duration_s=durations.get(name))
              for i, (name, _) in enumerate(enabled)]
    if job_file.job.steps_independent:
        _mark_prefixes(checks)
    if enabled and firsts[order[0]] and len(enabled) > 1:
        checks[order[0]].note += ("; runs first, alone (it times its runs), so its runs are the uninterrupted "
                                  "runs the other checks share")
    # the first check's uninterrupted runs ran before the lane starts: an ahead run that is one
    # of them is not launched again
    done = {r.share for i in order if firsts[i] for r in planned[i][0] if r.reference is not None}
    later = [i for i in order if not firsts[i]]
    ahead = []
    for position, i in enumerate(later):
        kind = kinds[i]
        if position and kind is not None and kind.ahead is not None and all(
            kinds[j] is not None and kinds[j].lane for j in later[:position]  # type: ignore[union-attr]
        ) and not (kind.ahead_reference and all(r.share in done for r in planned[i][0] if r.reference is not None)):
            ahead.append(kind.ahead_words)
        # a check before launches its uninterrupted runs in the foreground (lane_plan)
        done |= {r.share for r in planned[i][0] if r.reference is not None}
    if not backend_for(job_file.job.kind).concurrent_runs():
        ahead = []  # e.g. a ray_train job: no background lane
    plan = Plan(job_file, [], ahead, history if durations else None)
    # the runs of the check that goes first are launched first: listed in that order
    plan.checks = [checks[i] for i in order]
    return plan


def _mark_prefixes(checks: list[CheckPlan]) -> None:
    """With ``job.steps_independent``, say which reference may be a longer one's first steps (it
    is counted as a launch: whether it is served depends on the longer run keeping a checkpoint
    of exactly that step)."""
    longer = [r.reference for c in checks for r in c.runs if r.reference is not None]
    for check in checks:
        for i, run in enumerate(check.runs):
            ref = run.reference
            if ref is None:
                continue
            base = share_key(ref)
            hosts = sorted(o.steps for o in longer if o.steps > ref.steps
                           and share_key(dataclasses.replace(o, steps=ref.steps)) == base)
            if hosts:
                check.runs[i] = dataclasses.replace(
                    run, label=f"{run.label} (or the first {ref.steps} steps of the {hosts[0]}-step run, when "
                               f"its checkpoint of step {ref.steps} is kept: job.steps_independent)")


def _runs(job_file: JobFile, name: str, spec: CheckSpec, settings: Settings,
          session: list[tuple[str, CheckSpec]]) -> tuple[list[PlannedRun], str]:
    """The check's runs as it declares them (:func:`~trainguard.run.declared.declared_runs`),
    each with the request it launches and its sharing key."""
    timeout = spec.timeout if spec.timeout is not None else job_file.job.timeout
    declared, note = declared_runs(job_file, name, spec, seed=settings.seed, soak_seed=settings.soak_seed,
                                   session=session)
    return [PlannedRun(d.run.label, d.request.steps, d.request.world_size, timeout,
                       d.request if d.run.reference else None, d.share) for d in declared], note


def _last_durations(job_file: JobFile) -> tuple[str, dict[str, float]]:
    """Check name -> seconds, from the newest report next to the job file (check, drills or
    gate), when one is readable."""
    state = job_file.state_dir
    candidates = [state / "report.json", state / "drills-report.json", state / "gate" / "latest.json"]
    durations: dict[str, float] = {}
    used: list[str] = []
    for path in sorted((p for p in candidates if p.is_file()), key=lambda p: p.stat().st_mtime):
        try:  # a report of trainguard's own, read as data (a huge one or one nested 1000 deep: skipped)
            data = read_json(path, OWN_FILE_LIMITS)
        except (OSError, Unreadable):
            continue
        checks = data.get("checks") if isinstance(data, dict) else None
        if isinstance(data, dict) and checks is None and isinstance(data.get("report"), dict):
            checks = data["report"].get("checks")
        if not isinstance(checks, list):
            continue
        for item in checks:
            if isinstance(item, dict) and isinstance(item.get("name"), str):
                seconds = item.get("duration_s")
                # compared, never converted first: a huge integer has no float
                if isinstance(seconds, (int, float)) and not isinstance(seconds, bool) and 0 <= seconds <= MAX_SECONDS:
                    durations[item["name"]] = float(seconds)
                    if str(path) not in used:
                        used.append(str(path))
    return ", ".join(used), durations
