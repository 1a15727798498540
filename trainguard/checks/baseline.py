"""Canary baselines: a saved trajectory per machine, and the band later canaries must stay in.

``trainguard check --only canary --save-baseline`` stores the canary's trajectories (``loss``,
and ``val_metric`` when configured) as versioned JSON, the way pytest-benchmark stores its runs::

    .trainguard/baselines/<machine-id>/<NNNN>_<commit>[_dirty].json

``<machine-id>`` is ``<system>-<python implementation>-<python major.minor>-<cpu arch>``
(``Linux-CPython-3.11-x86_64``), ``NNNN`` counts up per machine, ``<commit>`` is the job
repository's commit (``nogit`` outside a repository) and ``_dirty`` marks uncommitted changes.
A file is written to a temp file, fsynced and linked into place under a name no other file has,
so two savers never overwrite each other and a reader never sees half a file.

Later canaries compare their run with the **latest** baseline of this machine saved for the same
job (the job file, its command and metrics: :class:`~trainguard.checks.statefiles.JobKey`) and
request (steps, seed, world size, args), or with the file ``checks.canary.baseline`` names, and
must stay inside its band (:mod:`trainguard.checks.band`). Every value is checked when the file is
read (finite, at most 1e300, on the steps of its run); a baseline that fails, or whose steps are
not the run's, is refused with the reason and the canary is an error, never inside its band. The machine id and facts come from
:mod:`trainguard._internal.machine`.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import os
import re
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainguard._internal.atomic import current_umask, fallback_dir, fsync_dir, os_error_text, warn
from trainguard._internal.gitstate import git_state
from trainguard._internal.machine import machine_id, machine_info
from trainguard._internal.readers import Unreadable, active_limits, read_json
from trainguard._version import __version__
from trainguard.checks.band import (
    BandEvidence,
    BandVerdict,
    build_band,
    compare_to_band,
    plot_bands,
)
from trainguard.checks.statefiles import (
    JobKey,
    StoredRequest,
    checked_numbers,
    checked_steps,
    mapping_or_empty,
)
from trainguard.errors import TrainguardError
from trainguard.evidence import UNSET, Evidence, Unset

if TYPE_CHECKING:  # pragma: no cover
    from trainguard.config import CanaryCheck, JobFile
    from trainguard.launch import RunResult
    from trainguard.run.request import RunRequest

__all__ = [
    "FORMAT_VERSION",
    "NOT_SAVED_FAILED",
    "Baseline",
    "BaselineError",
    "BaselineEvidence",
    "BaselineOutcome",
    "VersionedDocument",
    "canary_baseline",
    "find_baseline",
    "load_baseline",
    "read_versioned_json",
    "save_baseline",
    "steps_differ",
    "write_numbered",
]

#: Version of the baseline file format; files of another version are refused, not guessed at.
#: 2: keyed to the job (``job_key``); version 1 files are refused (save a new baseline)
FORMAT_VERSION = 2

_KIND = "trainguard-canary-baseline"
_NAME = re.compile(r"^(\d{4,})_.*\.json$")
PLOT_NAME = "baseline_band.png"


class BaselineError(TrainguardError):
    """A baseline file cannot be read or does not fit the run it would be compared with."""




def baselines_dir(state_dir: Path, machine: str | None = None) -> Path:
    """``<state_dir>/baselines/<machine-id>``."""
    return state_dir / "baselines" / (machine or machine_id())


def baseline_files(directory: Path) -> list[Path]:
    """The baseline files in ``directory``, oldest first (by their ``NNNN`` number)."""
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := _NAME.match(p.name))]
    return [p for _, p in sorted(found)]


# --------------------------------------------------------------------------------------------
# Saving and loading
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Baseline:
    """A loaded baseline file, every value checked (:func:`load_baseline`)."""

    path: Path
    #: steps, seed, world_size, args (and env, for information)
    request: StoredRequest
    #: metric name -> {step: value}
    trajectories: dict[str, dict[int, float]]
    #: the job it was saved for
    job: JobKey
    commit: str | None = None
    dirty: bool | None = None
    created_at: str | None = None
    #: the SHA-256 of the whole job file when it was saved (information: a changed check
    #: setting does not change the run)
    file_sha256: str | None = None

    def mismatch(self, request: StoredRequest, job: JobKey | None = None) -> list[str]:
        """How this baseline's job and request differ from ``job`` and ``request`` (``steps 60,
        this run 30``)."""
        out = self.job.differences(job) if job is not None else []
        out += [f"{key} {_show(mine)} (this run: {_show(theirs)})" for key, mine, theirs in self.request.differences(request)]
        return out


def _show(value: Any) -> str:
    if isinstance(value, tuple):
        return repr(" ".join(map(str, value)))
    return str(value)


def _file_sha256(path: Path) -> str | None:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None


def save_baseline(
    job_file: JobFile,
    request: RunRequest,
    trajectories: Mapping[str, Mapping[int, float]],
    *,
    directory: Path | None = None,
    run: RunResult | None = None,
) -> Path:
    """Store ``trajectories`` (metric -> {step: value}) as the next baseline of this machine and
    return its path. ``directory`` defaults to :func:`baselines_dir` of the job's state dir;
    ``run``: the run they are of (its directory and duration are stored with them)."""
    target_dir = directory or baselines_dir(job_file.state_dir)
    target_dir.mkdir(parents=True, exist_ok=True)
    git = git_state(job_file.cwd)
    commit, dirty = git.commit, git.dirty
    data: dict[str, Any] = {
        "format_version": FORMAT_VERSION,
        "kind": _KIND,
        "trainguard_version": __version__,
        "created_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine_info": machine_info(),
        "job": {
            "name": job_file.job.name,
            "file": str(job_file.path),
            "file_sha256": _file_sha256(job_file.path),
        },
        "job_key": JobKey.of(job_file).to_dict(),
        "commit_info": {"id": commit, "dirty": dirty, "directory": str(job_file.cwd)},
        "request": StoredRequest.of(request).to_dict(),
        "trajectories": {
            name: [[step, float(values[step])] for step in sorted(values)]
            for name, values in trajectories.items()
        },
        **({"run": {"run_dir": str(run.run_dir), "duration_s": round(run.duration_s, 2)}} if run is not None else {}),
    }
    payload = (json.dumps(data, indent=2, allow_nan=True) + "\n").encode()
    suffix = (commit[:12] if commit else "nogit") + ("_dirty" if dirty else "")
    return write_numbered(target_dir, suffix, payload)


def _save_aside(job_file: JobFile, request: RunRequest, trajectories: Mapping[str, Mapping[int, float]]) -> Path | None:
    """The baseline saved under the temp-directory fallback (None: not there either)."""
    base = fallback_dir()
    if base is None:
        return None
    try:
        return save_baseline(job_file, request, trajectories, directory=base / "baselines" / machine_id())
    except (OSError, BaselineError):
        return None


def write_numbered(directory: Path, suffix: str, payload: bytes) -> Path:
    """Write ``payload`` as ``<NNNN>_<suffix>.json`` with the next free number, atomically.

    The content goes to a temp file (fsynced) that is then hard-linked to the final name: a link
    fails when the name exists, so a concurrent saver that picked the same number retries with
    the next one instead of overwriting.
    """
    fd, tmp = tempfile.mkstemp(prefix=".baseline.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(payload)
            handle.flush()
            os.fchmod(handle.fileno(), 0o666 & ~current_umask())
            os.fsync(handle.fileno())
        existing = baseline_files(directory)
        number = int(_NAME.match(existing[-1].name).group(1)) + 1 if existing else 1  # type: ignore[union-attr]
        for _ in range(1000):
            target = directory / f"{number:04d}_{suffix}.json"
            try:
                os.link(tmp, target)
            except FileExistsError:
                number += 1
                continue
            fsync_dir(directory)
            return target
        raise BaselineError(f"{directory}: could not find a free baseline number near {number}")
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


_HOW_TO_SAVE = "trainguard check {job} --only canary --save-baseline"


def how_to_save(job_file: JobFile) -> str:
    """The command that saves a baseline for this job file."""
    return _HOW_TO_SAVE.format(job=_rel(job_file.path))


@dataclass(frozen=True)
class VersionedDocument:
    """A kind of versioned JSON document trainguard writes (a canary or profile baseline): its
    ``kind`` and ``version`` keys, the error it raises, and the words its messages use."""

    kind: str
    version: int
    error: type[TrainguardError]
    #: what it is called in "no such ..." ("baseline file")
    what: str
    #: what it is called in "not a ..." ("trainguard canary baseline")
    kind_name: str
    #: what its version is called in "has ... format version" ("baseline")
    version_label: str
    #: how to get a good one ("save a new one with ...")
    fix: str


def read_versioned_json(path: str | os.PathLike[str], document: VersionedDocument) -> dict[str, Any]:
    """A ``document``: readable JSON with its ``"kind"`` and ``"format_version"``; otherwise its
    error naming the file, what is wrong and its fix. Shared by the canary's and the profile's
    baselines."""
    kind, version, error, what, fix = document.kind, document.version, document.error, document.what, document.fix
    kind_name, version_label = document.kind_name, document.version_label
    target = Path(path)
    if not target.exists() and not target.is_symlink():
        raise error(f"{target}: no such {what}")
    try:  # as data, within the read limits: a baseline is kilobytes, a huge file is not one
        data = read_json(target, active_limits())
    except (OSError, Unreadable) as exc:
        raise error(f"{target}: not a readable {what} ({exc}); delete it or {fix}") from None
    if not isinstance(data, dict) or data.get("kind") != kind:
        raise error(f"{target}: not a {kind_name} (no \"kind\": \"{kind}\"); delete it or {fix}")
    if data.get("format_version") != version:
        raise error(
            f"{target} has {version_label} format version {data.get('format_version')!r}; trainguard "
            f"{__version__} reads version {version}. {fix[0].upper()}{fix[1:]}"
        )
    return data


def load_baseline(path: str | os.PathLike[str]) -> Baseline:
    """Read and validate a baseline file; :class:`BaselineError` says what is wrong with it."""
    target = Path(path)
    data = read_versioned_json(target, _DOCUMENT)
    try:
        request = StoredRequest.from_dict(data.get("request"))
        trajectories = mapping_or_empty(data.get("trajectories"), "trajectories")
        if "loss" not in trajectories:
            raise ValueError("trajectories holds no `loss`")
        commit = mapping_or_empty(data.get("commit_info"), "commit_info")
        job = mapping_or_empty(data.get("job"), "job")
        return Baseline(
            target, request,
            {str(name): _trajectory(f"trajectories.{str(name)[:80]}", points, request.steps)
             for name, points in trajectories.items()},
            JobKey.from_dict(data.get("job_key")),
            _text_or_none(commit.get("id"), "commit_info.id"),
            _bool_or_none(commit.get("dirty"), "commit_info.dirty"),
            _text_or_none(data.get("created_at"), "created_at"),
            _text_or_none(job.get("file_sha256"), "job.file_sha256"),
        )
    except ValueError as exc:
        raise BaselineError(f"{target}: malformed baseline ({exc}); delete it and save a new baseline") from None


#: a canary baseline file, as read_versioned_json checks it
_DOCUMENT = VersionedDocument(
    _KIND, FORMAT_VERSION, BaselineError, what="baseline file", kind_name="trainguard canary baseline",
    version_label="baseline",
    # what to do with a baseline of another format version
    fix=("save a new baseline with this version (`trainguard check CONFIG --only canary --save-baseline`; "
         "version 1 files were not keyed to their job file)"))


def _trajectory(where: str, points: Any, last: int) -> dict[int, float]:
    """``[[step, value], ...]`` of a run of ``last`` steps, every step and value checked."""
    if not isinstance(points, list) or not all(isinstance(p, list) and len(p) == 2 for p in points):
        raise ValueError(f"{where} must be a list of [step, value] pairs")
    steps = checked_steps([p[0] for p in points], f"{where} (its steps)", last)
    return dict(zip(steps, checked_numbers([p[1] for p in points], f"{where} (its values)", len(points)), strict=True))


def _text_or_none(value: Any, where: str) -> str | None:
    if value is not None and (not isinstance(value, str) or len(value) > 200):
        raise ValueError(f"{where} must be a short string or null")
    return value


def _bool_or_none(value: Any, where: str) -> bool | None:
    if value is not None and not isinstance(value, bool):
        raise ValueError(f"{where} must be true, false or null")
    return value


def find_baseline(job_file: JobFile, setting: str, request: StoredRequest) -> Baseline | None:
    """The baseline ``checks.canary.baseline`` selects for ``job_file``'s ``request``.

    ``latest``: the newest file of this machine whose format, job and request match; None when
    the machine has no baseline of this job (another job file's are not this one's);
    :class:`BaselineError` when it has some but none fits, or one that cannot be read (the
    message names the newest one and how it differs). A path (relative to the job file): that
    file, which must exist and fit.
    """
    job = JobKey.of(job_file)
    if setting != "latest":
        try:
            path = Path(setting).expanduser()
        except RuntimeError:  # ~someone who is not a user here
            raise BaselineError(f"checks.canary.baseline: {setting[:200]!r}: the ~user in it does not exist "
                                "here; write the baseline file's path") from None
        baseline = load_baseline(path if path.is_absolute() else job_file.base_dir / path)
        differs = baseline.mismatch(request, job)
        if differs:
            raise _refused(job_file, baseline.path, differs)
        return baseline
    first_problem: BaselineError | None = None
    for path in reversed(baseline_files(baselines_dir(job_file.state_dir))):
        try:
            baseline = load_baseline(path)
        except BaselineError as exc:
            first_problem = first_problem or exc
            continue
        if baseline.job.file != job.file:
            continue  # another job file's, beside this one in the directory
        differs = baseline.mismatch(request, job)
        if not differs:
            return baseline
        first_problem = first_problem or _refused(job_file, path, differs)
    if first_problem is None:
        return None
    raise BaselineError(
        f"no baseline of this machine ({machine_id()}) fits this canary; the newest: "
        f"{first_problem}"
    )


def _refused(job_file: JobFile, path: Path, differs: list[str]) -> BaselineError:
    return BaselineError(
        f"{_rel(path)} was saved for a different run: {'; '.join(differs)}. A band only means "
        f"something for the same job, steps, seed, world size and args: save one for this run with "
        f"`{how_to_save(job_file)}`, or point checks.canary.baseline at a matching file"
    )


def _rel(path: Path) -> str:
    try:
        rel = os.path.relpath(path)
    except ValueError:
        return str(path)
    return rel if not rel.startswith("../../") else str(path)


# --------------------------------------------------------------------------------------------
# The canary's use of all this
# --------------------------------------------------------------------------------------------


#: why a run is not saved as the baseline when the canary failed
NOT_SAVED_FAILED = "the canary failed: a failing run is no baseline"


@dataclass
class BaselineEvidence(Evidence):
    """The canary's baseline step in its report (``baseline``): ``status`` says what was done
    (``off``, ``none``, ``saved``, ``not_saved``, ``compared``, ``calibrated``, ``refused``), the
    other fields what with."""

    status: str
    reason: str | Unset = UNSET
    #: where a baseline that could not be saved in its directory was saved instead
    saved_aside: str | Unset = UNSET
    path: str | Unset = UNSET
    machine_id: str | Unset = UNSET
    directory: str | Unset = UNSET
    how_to_save: str | Unset = UNSET
    commit: str | Unset | None = UNSET
    dirty: bool | Unset | None = UNSET
    created_at: str | Unset | None = UNSET
    job_file_changed: bool | Unset = UNSET
    #: the seeds a calibration ran
    runs: int | Unset = UNSET
    #: per metric compared, its band's verdict; of a baseline just saved, the metrics it holds
    metrics: dict[str, BandEvidence] | list[str] | Unset = UNSET
    tolerance: float | Unset = UNSET
    #: metric -> why it was not compared
    not_compared: dict[str, str] | Unset = UNSET
    plot_error: str | Unset = UNSET


@dataclass
class BaselineOutcome:
    """What the baseline step adds to a canary result."""

    evidence: BaselineEvidence
    problems: list[str] = field(default_factory=list)
    note: str = ""
    plots: list[str] = field(default_factory=list)
    #: the saved baseline (or calibration) could not be compared with: ``problems`` say why, and
    #: the canary is an error, not a pass (nor a failure of the job)
    refused: bool = False

    @classmethod
    def refusal(cls, reason: str, path: str | Unset = UNSET) -> BaselineOutcome:
        """A baseline that cannot be trusted or compared (the one at ``path``), and why."""
        return cls(BaselineEvidence("refused", reason=reason, path=path), problems=[f"baseline refused: {reason}"],
                   refused=True)


def steps_differ(metric: str, run: Mapping[int, float], saved: Mapping[int, float], what: str) -> str | None:
    """Why ``run`` and ``saved`` (one metric's {step: value}) cannot be compared as a band: they
    are not on the same steps (a band compared on a few shared steps, or none, says nothing about
    the rest); None when they are."""
    if set(run) == set(saved):
        return None
    return (f"{what} holds {metric} at {_span(saved)}, this run printed it at {_span(run)}: a band "
            "compares the same steps of the same run")


def _span(values: Mapping[int, float]) -> str:
    steps = sorted(values)
    return f"{len(steps)} step(s) ({steps[0]}-{steps[-1]})" if steps else "no step"


def _plot(outcome: BaselineOutcome, path: Path, verdicts: Sequence[BandVerdict], title: str) -> None:
    # a plot is evidence, not the verdict: a plotting problem is recorded, never fatal
    try:
        outcome.plots.append(str(plot_bands(path, verdicts, title=title)))
    except Exception as exc:
        outcome.evidence.plot_error = f"{type(exc).__name__}: {exc}"


def _metrics(spec: CanaryCheck) -> list[str]:
    return ["loss"] + ([spec.val_metric] if spec.val_metric and spec.val_metric != "loss" else [])


def canary_baseline(
    job_file: JobFile,
    save_baseline: bool,
    spec: CanaryCheck,
    request: RunRequest,
    result: RunResult,
    *,
    canary_ok: bool,
) -> BaselineOutcome:
    """Save the run as this machine's baseline (``settings.save_baseline``; only a run that
    passed the canary's other tests), or compare it with the baseline ``spec.baseline`` selects
    and plot it against the band. A missing baseline is not a failure; one that does not fit
    the run, or cannot be trusted, is refused (the message says why and how to save one)."""
    trajectories = {m: result.trajectory(m) for m in _metrics(spec)}
    trajectories = {m: v for m, v in trajectories.items() if v}
    plot_path = Path(result.run_dir) / PLOT_NAME
    if save_baseline:
        if not canary_ok:
            return BaselineOutcome(
                BaselineEvidence("not_saved", reason=NOT_SAVED_FAILED),
                note="baseline not saved (the canary failed)",
            )
        return _save_run(job_file, spec, request, result, trajectories, plot_path)
    if spec.baseline == "off":
        return BaselineOutcome(BaselineEvidence("off"))
    try:
        baseline = find_baseline(job_file, spec.baseline, StoredRequest.of(request))
    except BaselineError as exc:
        return BaselineOutcome.refusal(str(exc))
    if baseline is None:
        hint = how_to_save(job_file)
        return BaselineOutcome(
            BaselineEvidence("none", machine_id=machine_id(), directory=str(baselines_dir(job_file.state_dir)),
                             how_to_save=hint),
            note=f"no baseline saved for this machine (save one: {hint})",
        )
    return _compare(job_file, spec, baseline, trajectories, plot_path)


def _save_run(job_file: JobFile, spec: CanaryCheck, request: RunRequest, result: RunResult,
              trajectories: Mapping[str, Mapping[int, float]], plot_path: Path) -> BaselineOutcome:
    """The passing run saved as the next baseline, and plotted in its own band."""
    try:
        saved = save_baseline(job_file, request, trajectories, run=result)
    except BaselineError as exc:
        where = baselines_dir(job_file.state_dir)
        return BaselineOutcome(
            BaselineEvidence("not_saved", reason=str(exc)),
            problems=[f"could not save the baseline in {where}: {exc}; make that directory "
                      "writable (or free space) and save again"],
        )
    except OSError as exc:  # read-only, full disk: the trajectory is kept aside, never lost
        where = baselines_dir(job_file.state_dir)
        aside = _save_aside(job_file, request, trajectories)
        text = f"could not save the baseline in {where}: {os_error_text(exc)}; " + (
            f"it was saved to {aside} instead: copy that file into {where} to use it"
            if aside else "make that directory writable (or free space) and save again")
        warn(text)
        return BaselineOutcome(
            BaselineEvidence("not_saved", reason=text, saved_aside=str(aside) if aside else UNSET),
            problems=[text],
        )
    outcome = BaselineOutcome(
        BaselineEvidence("saved", path=str(saved), machine_id=machine_id(), metrics=sorted(trajectories),
                         tolerance=spec.baseline_tolerance),
        note=f"saved as the baseline {_rel(saved)}",
    )
    own = [compare_to_band(v, build_band(m, v, spec.baseline_tolerance))
           for m, v in trajectories.items()]
    _plot(outcome, plot_path, own, f"{job_file.job.name}: saved as the baseline {saved.name}")
    return outcome


def _compare(job_file: JobFile, spec: CanaryCheck, baseline: Baseline,
             trajectories: Mapping[str, Mapping[int, float]], plot_path: Path) -> BaselineOutcome:
    """The run against ``baseline``'s band, metric by metric, on the same steps; a refusal when
    its steps are not the run's or the run has no loss to compare."""
    saved_trajectories = baseline.trajectories
    verdicts: list[BandVerdict] = []
    not_compared: dict[str, str] = {}
    for metric, values in trajectories.items():
        if metric not in saved_trajectories:
            not_compared[metric] = "the baseline has no values of it"
            continue
        differ = steps_differ(metric, values, saved_trajectories[metric], f"baseline {_rel(baseline.path)}")
        if differ is not None:
            return BaselineOutcome.refusal(f"{differ}; save a new baseline with `{how_to_save(job_file)}`",
                                           path=str(baseline.path))
        band = build_band(metric, saved_trajectories[metric], spec.baseline_tolerance)
        verdicts.append(compare_to_band(values, band))
    for metric in _metrics(spec):
        if metric not in trajectories:
            not_compared.setdefault(metric, "this run printed no values of it")
    if "loss" not in trajectories:
        return BaselineOutcome.refusal("this run printed no loss to compare with the baseline", path=str(baseline.path))
    outcome = BaselineOutcome(BaselineEvidence(
        "compared", path=str(baseline.path), commit=baseline.commit, dirty=baseline.dirty,
        created_at=baseline.created_at, job_file_changed=baseline.file_sha256 != _file_sha256(job_file.path),
        metrics={v.band.metric: v.as_evidence() for v in verdicts}, not_compared=not_compared))
    bad = [v for v in verdicts if not v.ok]
    label = baseline.path.name
    status = "outside" if bad else "inside"
    commit = baseline.commit[:12] if baseline.commit else "no commit"
    _plot(outcome, plot_path, verdicts, f"{job_file.job.name} vs baseline {label} ({commit}): {status}")
    if bad:
        plot_note = f"; plot: {outcome.plots[0]}" if outcome.plots else ""
        texts = [v.problem() or "" for v in bad]
        outcome.problems.append(f"{'; '.join(texts)}; baseline {_rel(baseline.path)}{plot_note}")
    else:
        devs = ", ".join(f"{v.band.metric} off by at most {v.max_deviation:.0%}" for v in verdicts)
        outcome.note = (f"inside the baseline band of {label} (±{spec.baseline_tolerance:.0%}: "
                        f"{devs})")
    return outcome
