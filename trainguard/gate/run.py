"""``trainguard gate``: run the required checks, decide promote or block, write the report, submit.

The gate runs every check the job file configures (smoke, canary, determinism, resume, parallel,
profile, drills) in one session -- one MLflow parent run, shared reference runs -- then
:func:`trainguard.gate.policy.decide` turns the results, the profile's sizing and this machine's
capabilities into ``promote`` or ``block`` with every reason. The gate report (JSON for machines,
Markdown for a PR comment, a self-contained HTML page) is written atomically under
``.trainguard/gate/``; it carries the provenance (:mod:`trainguard.gate.provenance`) that
``trainguard submit`` checks before it submits a promoted report later.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import json
import math
import os
import stat
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from trainguard._internal.atomic import write_or_fallback
from trainguard._internal.envvars import MLFLOW_RUN_ID, MLFLOW_TRACKING_URI
from trainguard._internal.promoted import record_promotion
from trainguard._internal.readers import OWN_FILE_LIMITS, read_at_most, read_bytes, read_json
from trainguard._version import __version__
from trainguard.config import GatePolicy, JobFile, load_config
from trainguard.config.backends import backend_for
from trainguard.config.queues import QUEUES
from trainguard.errors import ConfigError, TrainguardError
from trainguard.gate.divergences import divergence_tables
from trainguard.gate.policy import (
    Capabilities,
    Decision,
    configured_checks,
    decide,
    gate_checks_to_run,
    sizing_of,
)
from trainguard.gate.provenance import Provenance
from trainguard.launch.pace import RunPace
from trainguard.profiling.render import PACE_TABLE_HTML, PACE_TABLE_MD, failure_rows
from trainguard.profiling.sizing import Sizing
from trainguard.queue.base import Submission
from trainguard.report import CheckResult, Report
from trainguard.run.runner import LaunchRecord
from trainguard.session.cost import Cost
from trainguard.tracking.store import ui_command

__all__ = [
    "GATE_REPORT_VERSION",
    "GateReport",
    "NotSubmitted",
    "StaleReport",
    "SubmittableReport",
    "judged_paces",
    "read_gate_report",
    "run_gate",
    "submit_report",
    "write_gate_report",
]

GATE_REPORT_VERSION = 1


class StaleReport(TrainguardError):
    """A gate report that no longer describes the job (or was not promoted): not submitted."""


@dataclass(frozen=True)
class NotSubmitted:
    """The gate's ``--submit`` submitted nothing (a blocked job, or the production run could
    not be made): why."""

    status: Literal["not_submitted"]
    message: str

    def to_dict(self) -> dict[str, Any]:
        """The gate report's ``submission`` object."""
        return {"status": self.status, "message": self.message}


@dataclass
class GateReport:
    """Everything the gate decided and why (the JSON written to ``.trainguard/gate/``)."""

    job: str
    job_file: str
    decision: Decision
    report: Report
    provenance: Provenance
    capabilities: Capabilities
    policy: GatePolicy
    sizing: Sizing | None = None
    submission: Submission | NotSubmitted | None = None
    tracking_uri: str | None = None
    mlflow_session_run_id: str | None = None
    created_at: float = field(default_factory=time.time)
    duration_s: float = 0.0
    paths: dict[str, str] = field(default_factory=dict)
    #: the launches the gate made and their cost
    cost: Cost | None = None
    #: each judged multi-rank launch's per-rank pace (docs/drills.md "Stragglers")
    paces: list[RunPace] = field(default_factory=list)

    @property
    def promoted(self) -> bool:
        return self.decision.promoted

    def to_dict(self) -> dict[str, Any]:
        return {
            "gate_report_version": GATE_REPORT_VERSION,
            "trainguard_version": __version__,
            "job": self.job,
            "job_file": self.job_file,
            "verdict": self.decision.verdict,
            "decision": self.decision.to_dict(),
            "checks": self.report.to_dict()["checks"],
            "provenance": self.provenance.to_dict(),
            "capabilities": dataclasses.asdict(self.capabilities),
            "policy": self.policy.model_dump(),
            "sizing": self.sizing.to_dict() if self.sizing is not None else None,
            "submission": self.submission.to_dict() if self.submission is not None else None,
            "tracking_uri": self.tracking_uri,
            "mlflow_session_run_id": self.mlflow_session_run_id,
            "created_at": self.created_at,
            "duration_s": round(self.duration_s, 1),
            "cost": self.cost.to_dict() if self.cost is not None else None,
            "reports": self.paths,
            "pace": [p.to_dict() for p in self.paces],
        }


def run_gate(
    config: str | os.PathLike[str] | JobFile,
    *,
    submit: bool = False,
    seed: int | None = None,
    echo: Callable[[int, str, str], None] | None = None,
    on_start: Callable[[str], None] | None = None,
    on_result: Callable[[CheckResult], None] | None = None,
    submit_wait_s: float = 30.0,
) -> GateReport:
    """Run the gate on a job file: every configured check, the decision, the report (written),
    and -- with ``submit`` and a ``promote`` -- the submission to ``gate.queue``."""
    from trainguard.gate.provenance import provenance_for
    from trainguard.session import open_session, run_in_order, session_settings

    started = time.monotonic()
    job_file = config if isinstance(config, JobFile) else load_config(config)
    policy = job_file.gate or GatePolicy.model_validate({})
    settings = session_settings(seed=seed)
    capabilities = Capabilities.probe()
    report = Report(job=job_file.job.name, job_file=str(job_file.path))
    with open_session(job_file, settings, command="gate", echo=echo) as session:
        tracker = session.tracker

        def assemble(decision: Decision) -> GateReport:
            from trainguard.session.cost import measured_cost

            minutes = job_file.target.startup_minutes if job_file.target is not None else None
            return GateReport(
                job=job_file.job.name,
                job_file=str(job_file.path),
                decision=decision,
                report=report,
                provenance=provenance_for(job_file.path),
                capabilities=capabilities,
                policy=policy,
                sizing=sizing_of(report),
                tracking_uri=session.tracking_uri,
                cost=dataclasses.replace(measured_cost(list(session.runner.launches), minutes),
                                         reads=shared_reads(report)),
                paces=judged_paces(session.runner.launches),
            )

        try:
            run_in_order(session.runner, gate_checks_to_run(job_file), report, on_start=on_start,
                         on_result=on_result)
        except KeyboardInterrupt:  # Ctrl-C, SIGTERM: the finished checks kept, in a blocked report
            report.interrupted = True
            stopped = assemble(Decision("block", [
                f"interrupted (Ctrl-C or SIGTERM) after {len(report.checks)} check(s); run "
                "`trainguard gate` again to decide"]))
            stopped.duration_s = time.monotonic() - started
            write_gate_report(stopped, job_file.state_dir / "gate")
            raise
        decision = decide(report, policy, capabilities, sizing=sizing_of(report),
                          configured=configured_checks(job_file), paces=judged_paces(session.runner.launches))
        gate = assemble(decision)
        if tracker is not None and tracker.session is not None:
            tracker.set_tags(tracker.session, {"trainguard.gate": decision.verdict,
                                               "trainguard.kind": "gate"})
            tracker.session_failed = not decision.promoted
            gate.mlflow_session_run_id = tracker.session.run_id
        if submit and decision.promoted:
            gate.submission = _submit(job_file, gate, policy, session.runner, wait_s=submit_wait_s)
        elif submit:
            gate.submission = NotSubmitted("not_submitted", "blocked: nothing was submitted")
        gate.duration_s = time.monotonic() - started
        write_gate_report(gate, job_file.state_dir / "gate")
        for kind in ("json", "markdown", "html"):
            session.log_artifact(gate.paths[kind], "gate")
    return gate


def shared_reads(report: Report) -> dict[str, float]:
    """The seconds of the invariants check when it read another check's run and launched
    nothing (its evidence's ``shared_run``): what it adds to the gate's cost."""
    from trainguard.checks.invariants_check import InvariantsEvidence

    return {c.name: c.duration_s for c in report.checks
            if isinstance(c.evidence, InvariantsEvidence) and isinstance(c.evidence.shared_run, str)}


def judged_paces(launches: Iterable[LaunchRecord]) -> list[RunPace]:
    """The pace of each launch whose step clocks were judged (multi-rank, long enough)."""
    return [RunPace(r.label, r.world_size, r.pace) for r in launches if r.pace is not None and r.pace.judged]


# -- submission -----------------------------------------------------------------------------


@dataclass(frozen=True)
class SubmittableReport:
    """What ``trainguard submit`` reads of a gate report (:func:`read_gate_report` checked
    each): the verdict and its reasons, the job file, the provenance, the sizing, this machine's
    GPUs and the gate's MLflow session run; and what the gate hands its submission of the report
    it just decided."""

    verdict: str
    reasons: list[str]
    job_file: str
    provenance: Provenance
    sizing: Sizing | None
    gpus: float
    mlflow_session_run_id: str | None

    @classmethod
    def of(cls, gate: GateReport) -> SubmittableReport:
        """The gate's report as submit reads it."""
        return cls(gate.decision.verdict, list(gate.decision.reasons), gate.job_file, gate.provenance,
                   gate.sizing, gate.capabilities.gpus, gate.mlflow_session_run_id)


def _production_spec(job_file: JobFile, gate: SubmittableReport, report_path: str | None) -> Any:
    """The sized production run: the recommended world size, the target's steps, the predicted
    wall-clock as the time limit."""
    from trainguard.queue.base import spec_from_job
    from trainguard.run.request import RunRequest
    from trainguard.run.runner import JobRunner

    sizing = gate.sizing
    world = (sizing.recommended if sizing is not None else None) or job_file.job.world_size
    candidate = sizing.candidate(world) if sizing is not None else None
    steps = (job_file.target.steps if job_file.target is not None and job_file.target.steps else None) \
        or (candidate.steps if candidate is not None else None) or 1
    request = RunRequest.make(steps=int(steps), seed=0, world_size=int(world))
    run_dir = job_file.state_dir / "production"
    values = JobRunner(job_file).placeholders(request, run_dir, None)
    hours = candidate.hours_with_failures if candidate is not None else None
    on_gpu = gate.gpus > 0
    spec = spec_from_job(
        job_file, values, world_size=int(world), num_gpus=1.0 if on_gpu else 0.0, num_cpus=1.0,
        time_limit_s=float(hours) * 3600 if hours else None, gate_report=report_path,
        mlflow_run_id=gate.mlflow_session_run_id,
    )
    return backend_for(job_file.job.kind).production_spec(spec, job_file.job.command, job_file.cwd)


def _production_run(runner: Any, spec: Any, wait_s: float = 10.0) -> Any:
    """With tracking on: an MLflow run for the submitted production run (nested under the gate's
    session run) whose id goes to the job (``TRAINGUARD_MLFLOW_RUN_ID``/``_TRACKING_URI``: a
    ``ray_train`` job's designated worker writer logs into it) and into the Ray Job's metadata."""
    from trainguard.tracking import tracker_of
    tracker = tracker_of(runner)
    if tracker is None or tracker.session is None:
        return spec
    handle = tracker.start_run(
        f"production {spec.job_name}", parent=tracker.session,
        tags={"trainguard.kind": "production", "trainguard.job": spec.job_name},
        params={"command": " ".join(spec.rank_argv()), "world_size": spec.world_size},
    )
    if not handle.created.wait(wait_s) or handle.run_id is None:
        return spec
    env = {**spec.env, MLFLOW_RUN_ID: handle.run_id,
           MLFLOW_TRACKING_URI: tracker.tracking_uri}
    return dataclasses.replace(spec, env=env, metadata={**spec.metadata,
                                                        "trainguard.mlflow_production_run_id": handle.run_id})


def _submit_spec(spec: Any, queue: str, job_file: JobFile, *, wait_s: float) -> Submission:
    """Submit to the queue ``gate.queue`` names and follow the job up to ``wait_s`` seconds, as
    that queue's backend does it (:data:`trainguard.config.queues.QUEUES`)."""
    submission: Submission = QUEUES.get(queue).submit_and_follow(spec, state_dir=job_file.state_dir, wait_s=wait_s)
    return submission


def _submit(job_file: JobFile, gate: GateReport, policy: GatePolicy, runner: Any, *,
            wait_s: float) -> Submission | NotSubmitted:
    path = str(job_file.state_dir / "gate" / "latest.json")
    try:
        spec = _production_run(runner, _production_spec(job_file, SubmittableReport.of(gate), path))
        return _submit_spec(spec, policy.queue, job_file, wait_s=wait_s)
    except TrainguardError as exc:
        return NotSubmitted("not_submitted", str(exc))


def submit_report(path: str | os.PathLike[str], *, wait_s: float = 30.0, queue: str | None = None) -> Submission:
    """``trainguard submit REPORT``: submit the job a promoted, fresh gate report describes.
    Raises :class:`StaleReport` naming every reason when the report is blocked or stale, and
    :class:`ConfigError` (a usage error) when ``path`` is not a gate report
    (:func:`read_gate_report`)."""
    from trainguard.gate.provenance import staleness

    data = read_gate_report(path)
    if data.verdict != "promote":
        reasons = "; ".join(data.reasons) or "no reason recorded"
        raise StaleReport(f"{path}: the gate blocked this job ({reasons}); fix it and run "
                          "`trainguard gate` again -- a blocked report is never submitted")
    try:
        job_file = load_config(data.job_file)
    except ConfigError as exc:
        raise ConfigError(f"the job file this report was made from cannot be loaded ({exc}); run "
                          "`trainguard gate CONFIG` again on the job file", path=str(path),
                          key="job_file") from None
    policy = job_file.gate or GatePolicy.model_validate({})
    stale = staleness(data.provenance, job_file.path, max_age=policy.max_report_age)
    if stale:
        raise StaleReport(f"{path} is stale: " + "; ".join(stale) + ". Run `trainguard gate "
                          f"{job_file.path}` again")
    spec = _production_spec(job_file, data, str(path))
    return _submit_spec(spec, queue or policy.queue, job_file, wait_s=wait_s)


#: the largest file :func:`read_gate_report` reads (a gate report is a few kilobytes)
MAX_GATE_REPORT_BYTES = 16 * 2**20
#: what ``trainguard submit`` reads of a gate report: key -> (expected types, in words);
#: checked once, in :func:`read_gate_report`
_REPORT_KEYS: dict[str, tuple[tuple[type, ...], str]] = {
    "verdict": ((str,), "promote or block"),
    "decision": ((dict,), "an object with the decision's reasons"),
    "job_file": ((str,), "the path of the job file"),
    "provenance": ((dict,), "an object (the provenance record)"),
    "sizing": ((dict, type(None)), "an object or null"),
    "capabilities": ((dict, type(None)), "an object or null"),
    "mlflow_session_run_id": ((str, type(None)), "a string or null"),
}


def read_gate_report(path: str | os.PathLike[str]) -> SubmittableReport:
    """What :func:`submit_report` uses of the gate report at ``path``
    (``.trainguard/gate/latest.json``), read and checked in one place: every key is there with
    its type. Anything else -- no such file, a directory, not JSON, truncated, a JSON list, a
    missing or mistyped key -- raises :class:`ConfigError` naming the file and the key and
    saying what to do (the CLI's exit 2)."""
    fix = "run `trainguard gate CONFIG` to write one, then pass .trainguard/gate/latest.json"
    where = str(path)
    data = _report_object(_report_text(path, where, fix), where, fix)
    again = "the report is not one trainguard wrote, or it was edited; run `trainguard gate CONFIG` again"
    _check_key_types(data, where, again)
    _check_values(data, where, again)
    sizing = _check_sizing(data["sizing"], where, again) if data.get("sizing") else None
    return SubmittableReport(data["verdict"], data["decision"]["reasons"], data["job_file"],
                             Provenance.from_dict(data["provenance"]), sizing,
                             (data.get("capabilities") or {}).get("gpus", 0), data.get("mlflow_session_run_id"))


def _report_text(path: str | os.PathLike[str], where: str, fix: str) -> str:
    """The text of the file at ``path``: a regular file of UTF-8 text, at most
    :data:`MAX_GATE_REPORT_BYTES`."""
    try:
        # a regular file only (never /dev/zero or a FIFO), read up to a bound: a gate report is
        # kilobytes, a file past the bound is not one
        with open(os.open(path, os.O_RDONLY | os.O_NONBLOCK), "rb") as stream:  # a FIFO: no wait
            mode = os.fstat(stream.fileno()).st_mode
            if stat.S_ISDIR(mode):
                raise IsADirectoryError(path)
            if not stat.S_ISREG(mode):
                raise ConfigError(f"not a regular file, not a gate report; {fix}", path=where)
            raw = read_at_most(stream, MAX_GATE_REPORT_BYTES + 1)
        if len(raw) > MAX_GATE_REPORT_BYTES:
            raise ConfigError(f"over {MAX_GATE_REPORT_BYTES // 2**20} MiB, not a gate report; {fix}",
                              path=where)
        return raw.decode("utf-8")
    except FileNotFoundError:
        raise ConfigError(f"no such gate report; {fix}", path=where) from None
    except IsADirectoryError:
        raise ConfigError(f"is a directory, not a gate report; {fix}", path=where) from None
    except UnicodeDecodeError:
        raise ConfigError(f"not a gate report (not UTF-8 text); {fix}", path=where) from None
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read the gate report ({exc.__class__.__name__}: "
                          f"{_cut(str(exc))}); {fix}", path=where) from None


def _report_object(text: str, where: str, fix: str) -> dict[str, Any]:
    """``text`` as a JSON object of this version of the gate report."""
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError is a ValueError; [[[[... nests
        raise ConfigError(f"not a gate report: not valid JSON ({_cut(str(exc))}; truncated?); "
                          f"{fix}", path=where) from None
    if not isinstance(data, dict):
        raise ConfigError(f"not a gate report: the file holds a JSON {_json_type(data)}, not an "
                          f"object; {fix}", path=where)
    if data.get("gate_report_version") != GATE_REPORT_VERSION:
        raise ConfigError(f"not a gate report of version {GATE_REPORT_VERSION} (found "
                          f"{_cut(repr(data.get('gate_report_version')))}); run `trainguard gate "
                          "CONFIG` again", path=where, key="gate_report_version")
    return data


def _check_key_types(data: dict[str, Any], where: str, again: str) -> None:
    """Each key of :data:`_REPORT_KEYS` there with one of its types (one that may be null may
    be missing)."""
    for key, (types, words) in _REPORT_KEYS.items():
        if key not in data:
            if type(None) in types:
                continue
            raise ConfigError(f"missing; expected {words}: {again}", path=where, key=key)
        if not isinstance(data[key], types):
            raise ConfigError(f"is a JSON {_json_type(data[key])} ({_cut(repr(data[key]))}), "
                              f"expected {words}: {again}", path=where, key=key)


def _check_values(data: dict[str, Any], where: str, again: str) -> None:
    """The values submit relies on, once their types are right: a verdict it knows, the
    decision's reasons a list of strings (an empty one when missing), the job file a path, the
    provenance readable with a finite creation time, the GPUs a number (the sizing:
    :func:`_check_sizing`)."""
    if data["verdict"] not in ("promote", "block"):
        raise ConfigError(f"is {_cut(repr(data['verdict']))}, expected promote or block: {again}",
                          path=where, key="verdict")
    reasons = data["decision"].get("reasons", [])
    if not isinstance(reasons, list) or not all(isinstance(r, str) for r in reasons):
        raise ConfigError(f"is {_cut(repr(reasons))}, expected a list of strings: {again}",
                          path=where, key="decision.reasons")
    data["decision"]["reasons"] = reasons
    if not data["job_file"].strip() or "\0" in data["job_file"]:
        raise ConfigError(f"is {_cut(repr(data['job_file']))}, expected the path of the job file: "
                          f"{again}", path=where, key="job_file")
    try:
        created = Provenance.from_dict(data["provenance"]).created_at
    except ValueError as exc:
        raise ConfigError(f"{_cut(str(exc))}: {again}", path=where, key="provenance") from None
    if not math.isfinite(created):  # NaN would pass every age comparison: never stale
        raise ConfigError(f"is {created!r}, expected a time in seconds: {again}", path=where,
                          key="provenance.created_at")
    gpus = (data.get("capabilities") or {}).get("gpus", 0)
    if isinstance(gpus, bool) or not isinstance(gpus, (int, float)):
        raise ConfigError(f"is {_cut(repr(gpus))}, expected a number: {again}", path=where,
                          key="capabilities.gpus")


def _check_sizing(data: object, where: str, again: str) -> Sizing:
    """The sizing, read as its record, with the fields the production run reads in range: the
    recommended size and, per candidate, its size, steps and hours."""
    try:
        sizing = Sizing.from_dict(data, "sizing")
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"{_cut(str(exc))}: {again}", path=where, key="sizing") from None
    fields: list[tuple[str, float | None]] = [("sizing.recommended", sizing.recommended)]
    for i, candidate in enumerate(sizing.candidates):
        fields += [(f"sizing.candidates[{i}].gpus", candidate.gpus), (f"sizing.candidates[{i}].steps", candidate.steps),
                   (f"sizing.candidates[{i}].hours_with_failures", candidate.hours_with_failures)]
    for key, value in fields:
        # a size whose failures leave no progress predicts an infinite wall-clock (never recommended)
        endless = key.endswith("hours_with_failures") and value == math.inf
        if value is not None and not 0 <= value < 1e12 and not endless:
            raise ConfigError(f"is {_cut(repr(value))}, expected a number >= 0: {again}",
                              path=where, key=key)
    return sizing


def _json_type(value: Any) -> str:
    names = {dict: "object", list: "list", str: "string", bool: "boolean", int: "number",
             float: "number", type(None): "null"}
    return names.get(type(value), type(value).__name__)


def _cut(text: str, limit: int = 120) -> str:
    """``text`` cut to ``limit`` characters: a message never echoes a whole file."""
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} characters)"


# -- the report files -----------------------------------------------------------------------

_MARKDOWN = """\
# trainguard gate: {{ verdict | upper }} -- {{ job }}

{% if reasons %}**Blocked because:**
{% for r in reasons %}- {{ r }}
{% endfor %}{% else %}Every required check passed{% if sizing %} and the sizing meets every threshold{% endif %}.
{% endif %}
| check | status | summary |
|---|---|---|
{% for c in checks %}| {{ c.name }} | {{ c.status }} | {{ c.summary | replace("|", "/") }} |
{% endfor %}
{% if warnings %}**Warnings:**
{% for w in warnings %}- {{ w }}
{% endfor %}
{% endif %}{% for p in paces %}**Ranks of {{ p.run }}** ({{ p.summary }}):

""" + PACE_TABLE_MD + """
{% endfor %}{% if recommendation %}**Sizing:** {{ recommendation }}
{% endif %}{% if goodput %}
**Goodput forecast:** {{ goodput }}
{% endif %}{% if restart_policy %}
**Recommended restart policy** at {{ restart_policy[0].gpus }} GPU(s) (`job.restart`, `job.max_restarts`):
{% for t in restart_policy %}- `{{ t.setting }}`: {{ t.value }} -- {{ t.reason }}
{% endfor %}{% endif %}{% if fallbacks %}
**Fallbacks that ran:**
{% for f in fallbacks %}- {{ f }}
{% endfor %}{% endif %}{% if notes %}
<details><summary>Notes</summary>

{% for n in notes %}- {{ n }}
{% endfor %}
</details>
{% endif %}
{% if cost_line %}{{ cost_line }}.
{% endif %}Machine: {{ machine }}. Provenance: {{ provenance }}. {{ duration }} s.
"""

_HTML = """<!doctype html>
<html><head><meta charset="utf-8"><title>trainguard gate: {{ verdict }} -- {{ job }}</title>
<style>
body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;color:#222;padding:0 1em}
.banner{padding:1em 1.4em;border-radius:8px;font-size:1.4em;font-weight:600}
.promote{background:#e6f4ea;color:#0b6b2b}.block{background:#fdecea;color:#a4161a}
table{border-collapse:collapse;width:100%;margin:1em 0}td,th{border-bottom:1px solid #ddd;padding:.4em .6em;text-align:left;vertical-align:top;font-size:.92em}
.passed{color:#0b6b2b}.failed,.error{color:#a4161a}.skipped{color:#8a6d00}
img{max-width:100%;border:1px solid #eee;margin:.5em 0}.meta{color:#666;font-size:.9em}
</style></head><body>
<div class="banner {{ verdict }}">{{ verdict | upper }} &mdash; {{ job }}</div>
<p class="meta">{{ job_file }} &middot; {{ machine }} &middot; {{ created }} &middot; {{ duration }} s &middot; trainguard {{ version }}</p>
{% if cost_line %}<p class="meta">{{ cost_line }}</p>{% endif %}
{% if reasons %}<h2>Why it is blocked</h2><ul>{% for r in reasons %}<li>{{ r }}</li>{% endfor %}</ul>{% endif %}
<h2>Checks</h2><table><tr><th>check</th><th>status</th><th>summary</th><th>s</th></tr>
{% for c in checks %}<tr><td>{{ c.name }}</td><td class="{{ c.status }}">{{ c.status }}</td><td>{{ c.summary }}</td><td>{{ "%.1f" % c.duration_s }}</td></tr>{% endfor %}
</table>
{% for t in divergences %}<h3>{{ t.check }}: where the runs first differ</h3><p>{{ t.divergence.sentence }}</p>{% if t.divergence.compared_by %}<p class="meta">{{ t.divergence.compared_by }}</p>{% endif %}
<table><tr><th>step</th><th>first differing quantity</th><th>reference</th><th>other run</th></tr>{% for r in t.divergence.steps %}<tr><td>{{ r.step }}{% if r.rank %} (rank {{ r.rank }}){% endif %}</td><td>{{ r.kind ~ ": " ~ r.name if r.kind else "nothing differs" }}</td><td>{{ r.reference }}</td><td>{{ r.other }}</td></tr>{% endfor %}</table>{% endfor %}
{% if warnings %}<h2>Warnings</h2><ul>{% for w in warnings %}<li>{{ w }}</li>{% endfor %}</ul>{% endif %}
{% for p in paces %}<h3>Ranks of {{ p.run }}</h3><p>{{ p.summary }}</p>""" + PACE_TABLE_HTML + """{% endfor %}
{% if recommendation %}<h2>Sizing</h2><p>{{ recommendation }}</p>{% endif %}
{% if candidates %}<table><tr><th>GPUs</th><th>efficiency</th><th>hours</th><th>GPU-hours</th><th>cost</th><th>goodput</th><th>GPU-hours wasted</th><th>checkpoint every</th><th></th></tr>
{% for c in candidates %}<tr><td>{{ c.gpus }}{% if c.extrapolated %} (extrapolated){% endif %}</td><td>{{ "%.2f" % c.efficiency }}</td><td>{{ "%.2f" % c.hours_with_failures }}</td><td>{{ "%.1f" % c.gpu_hours }}</td><td>{{ "%.2f" % c.cost }}</td><td>{{ "%.2f%%" % (c.goodput * 100) if c.goodput is not none else "-" }}</td><td>{{ "%.3g" % c.wasted_gpu_hours if c.wasted_gpu_hours is not none else "-" }}</td><td>{{ c.checkpoint_every_steps or "-" }} steps</td><td>{{ "; ".join(c.why_not) }}</td></tr>{% endfor %}
</table>{% endif %}
{% if goodput %}<p><b>Goodput forecast:</b> {{ goodput }}</p>{% endif %}
{% if failure_rows %}<table><tr><th>goodput input</th><th>value</th><th>source</th></tr>{% for name, value, source in failure_rows %}<tr><td>{{ name }}</td><td>{{ value }}</td><td>{{ source }}</td></tr>{% endfor %}</table>{% endif %}
{% if timeouts %}<h3>Recommended timeouts at {{ timeouts[0].gpus }} GPU(s)</h3><table><tr><th>setting</th><th>value</th><th>reason</th></tr>{% for t in timeouts %}<tr><td>{{ t.setting }}</td><td>{{ t.value }}</td><td>{{ t.reason }}</td></tr>{% endfor %}</table>{% endif %}
{% for title, image in images %}<h3>{{ title }}</h3><img alt="{{ title }}" src="data:image/png;base64,{{ image }}">{% endfor %}
{% if fallbacks %}<h2>Fallbacks that ran</h2><ul>{% for f in fallbacks %}<li>{{ f }}</li>{% endfor %}</ul>{% endif %}
{% if submission %}<h2>Submission</h2><pre>{{ submission }}</pre>{% endif %}
<h2>Notes</h2><ul>{% for n in notes %}<li>{{ n }}</li>{% endfor %}</ul>
<h2>Provenance</h2><pre>{{ provenance }}</pre>
{% if tracking_uri %}<p class="meta">MLflow: <code>{{ mlflow_ui }}</code></p>{% endif %}
</body></html>
"""


def _images(data: dict[str, Any]) -> list[tuple[str, str]]:
    """(title, base64 PNG) of every plot: the profile's (step times, scaling, loss, cost) and
    each check's own (e.g. the canary's baseline band)."""
    out: list[tuple[str, str]] = []
    for check in data["checks"]:
        evidence = check.get("evidence") or {}
        if check["name"] == "profile" and evidence.get("report_json"):
            try:
                from trainguard.profiling.render import PLOTS, render_plots

                # the profile wrote its plots next to its report: embed those (rendering them
                # again costs seconds of matplotlib); render only what is missing
                run_dir = Path(evidence.get("run_dir") or "")
                saved = {key: run_dir / f"{key}.png" for key in PLOTS}
                pngs = {key: read_bytes(path, OWN_FILE_LIMITS) for key, path in saved.items()
                        if evidence.get("run_dir") and path.is_file()}
                if not pngs:
                    profile = read_json(Path(evidence["report_json"]), OWN_FILE_LIMITS)
                    pngs = render_plots(profile)
                pngs.pop("goodput", None)  # drawn below from the gate's sizing (the drills' inputs)
                for key, png in pngs.items():
                    out.append((f"profile: {PLOTS.get(key, key)}", base64.b64encode(png).decode("ascii")))
            except (OSError, ValueError, TypeError, KeyError, ImportError):  # Unreadable is a ValueError
                pass
        for plot in evidence.get("plots") or []:
            with contextlib.suppress(OSError, ValueError, TypeError):
                out.append((f"{check['name']}: {Path(plot).stem.replace('_', ' ')}",
                            base64.b64encode(read_bytes(Path(plot), OWN_FILE_LIMITS)).decode("ascii")))
    if data.get("sizing"):
        with contextlib.suppress(ImportError, ValueError, KeyError):
            from trainguard.profiling.render import PLOTS, plot_goodput

            drawn = plot_goodput({"sizing": data["sizing"],
                                  "gate_thresholds": (data.get("policy") or {}).get("thresholds")})
            if drawn is not None:
                out.append((f"profile: {PLOTS['goodput']}", base64.b64encode(drawn).decode("ascii")))
    return out


def _goodput_line(sizing: Sizing, policy: GatePolicy) -> str | None:
    """The recommended size's goodput forecast and the gate's minimum, in one sentence."""
    chosen = next((c for c in sizing.candidates if c.gpus == sizing.recommended), None)
    if chosen is None or chosen.goodput is None:
        return None
    limit = policy.thresholds.min_goodput
    return (f"{chosen.goodput:.2%} at {chosen.gpus} GPU(s): {chosen.expected_failures:.3g} failures "
            f"expected, {chosen.wasted_gpu_hours or 0:.3g} GPU-hours wasted, checkpoint every "
            f"{(chosen.checkpoint_every_s or 0) / 60:.3g} min"
            + (f" (gate.thresholds.min_goodput {limit:.1%})" if limit else ""))


def _context(gate: GateReport, checks: list[dict[str, Any]]) -> dict[str, Any]:
    """The pages' names: the gate's decision, ``checks`` as the report holds them, the sizing."""
    decision, sizing, caps, prov = gate.decision, gate.sizing, gate.capabilities, gate.provenance
    commit = prov.git_commit
    return {
        "verdict": decision.verdict, "job": gate.job, "job_file": gate.job_file,
        "reasons": decision.reasons, "notes": decision.notes, "fallbacks": decision.fallbacks,
        "warnings": decision.warnings, "paces": [p.to_dict() for p in gate.paces],
        "checks": checks, "sizing": sizing is not None,
        "recommendation": sizing.recommendation if sizing is not None else None,
        "candidates": sizing.candidates if sizing is not None else [],
        "goodput": _goodput_line(sizing, gate.policy) if sizing is not None else None,
        "failure_rows": failure_rows(sizing.to_dict()) if sizing is not None else [],
        "timeouts": (sizing.timeouts if sizing is not None else None) or [],
        "restart_policy": [t for t in (sizing.timeouts if sizing is not None else None) or []
                           if t.setting.startswith("job.restart") or "max_restarts" in t.setting],
        "machine": f"{caps.gpus} GPU(s), {'root' if caps.root else 'not root'}, "
                   f"{'Ray' if caps.ray else 'no Ray'}",
        "provenance": f"job file sha256 {prov.job_file_sha256[:12]}, commit "
                      f"{commit[:12] if commit else 'none'}{' (dirty)' if prov.git_dirty else ''}",
        "duration": round(gate.duration_s, 1), "version": __version__,
        "cost_line": gate.cost.reported().line() if gate.cost is not None else "",
        "created": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(gate.created_at)),
        "submission": json.dumps(gate.submission.to_dict(), indent=2, default=str) if gate.submission else None,
        "tracking_uri": gate.tracking_uri,
        "mlflow_ui": ui_command(gate.tracking_uri) if gate.tracking_uri else None,
    }


def write_gate_report(gate: GateReport, out_dir: Path) -> dict[str, str]:
    """Write ``gate-<stamp>.{json,md,html}`` and ``latest.{json,md,html}`` into ``out_dir``,
    each atomically; sets and returns ``gate.paths``. A promoted report is also made the newest
    of the promoted-report index (``promoted.json``, :mod:`trainguard._internal.promoted`).

    A file that cannot be written there (read-only, full disk) is said on stderr with the errno
    and goes to the temp-directory fallback, whose path ``gate.paths`` then holds
    (:func:`~trainguard._internal.atomic.write_or_fallback`); with no place at all, the JSON
    report is printed on stdout: a decision is never lost."""
    import jinja2

    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(gate.created_at))
    gate.paths = {
        "json": str(out_dir / "latest.json"), "markdown": str(out_dir / "latest.md"),
        "html": str(out_dir / "latest.html"), "json_stamped": str(out_dir / f"gate-{stamp}.json"),
    }
    data = gate.to_dict()
    context = _context(gate, data["checks"])
    text_md = jinja2.Environment(autoescape=False, undefined=jinja2.StrictUndefined).from_string(_MARKDOWN).render(**context)
    html_env = jinja2.Environment(autoescape=True, undefined=jinja2.StrictUndefined)
    text_html = html_env.from_string(_HTML).render(**context, images=_images(data),
                                                   divergences=divergence_tables(data["checks"]))
    text_json = json.dumps(data, indent=2, default=str) + "\n"
    for key, text in (("json", text_json), ("json_stamped", text_json), ("markdown", text_md), ("html", text_html)):
        written = write_or_fallback(gate.paths[key], text, what=f"the gate report ({key})")
        if written.path is not None:
            gate.paths[key] = str(written.path)
        elif key == "json":
            print(text_json, end="", flush=True)  # nowhere took it: the decision stays on stdout
    if gate.promoted:  # `base: promoted` finds it however many reports come after it
        record_promotion(out_dir, Path(gate.paths["json_stamped"]), gate.provenance.git_commit,
                         gate.created_at)
    return gate.paths

