"""The check registry: one typed descriptor per check (:class:`Check`), registered by name.

A check is one module that defines its spec model (a :class:`~trainguard.config.checks.CheckSpec`
subclass), the function that runs it and a :class:`Check` that ties them together with what it
needs from the job, the runs it plans, its lane, its gate default and its pytest marks; and one
registration line in :data:`CHECKS` (docs/architecture.md, "Adding a check"), a
:class:`~trainguard._internal.registry.Registry` as every extension's is. The job-file
schema (``checks:``), ``trainguard validate``, the planner, the lane, the gate, pytest collection
and the CLI all read this one registry.

The lines name ``"module:attribute"`` and are resolved on first use, as entry points are: the
check modules sit above this layer (they run jobs), and naming them here imports nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Generic, Protocol, TypeVar, runtime_checkable

from pydantic import BeforeValidator, Field, GetCoreSchemaHandler, create_model
from pydantic_core import CoreSchema

from trainguard._internal.registry import Registry
from trainguard.config.checks import Checks, CheckSpec
from trainguard.errors import ConfigError
from trainguard.evidence import Evidence

if TYPE_CHECKING:  # pragma: no cover
    from trainguard.launch import Launcher, MetricPoint, RunResult
    from trainguard.report import CheckResult

__all__ = [
    "CHECKS",
    "Check",
    "CheckContextProtocol",
    "CheckNotInstalled",
    "ChecksField",
    "JobFacts",
    "Later",
    "PlanContext",
    "Resumes",
    "Run",
    "check_for",
    "check_named",
    "check_names",
    "checks_model",
    "no_checks",
    "on_change",
    "register",
    "registered",
    "unregister",
]

S = TypeVar("S", bound=CheckSpec)
S_co = TypeVar("S_co", covariant=True)


@dataclass(frozen=True)
class Resumes:
    """Where a resumed run starts: the checkpoint kept after ``after_step`` of the uninterrupted
    run of the same steps, seed, args and env at ``world_size`` ranks (None: the check's own),
    copied while that run was stopped there (:mod:`trainguard.run.keep`)."""

    after_step: int
    world_size: int | None = None


@dataclass(frozen=True)
class Run:
    """One launch a check plans, as data. Its sharing key is the request it becomes (steps, seed,
    world size, args, env: :meth:`trainguard.run.request.RunRequest.make`); a ``reference`` run
    (uninterrupted) is launched once for every check that plans an equal one, and a run that
    ``resumes`` from a kept checkpoint once for every check that plans it from the same one."""

    label: str
    #: ranks (None: the check's own world size, ``world_size`` of its spec or ``job.world_size``)
    world_size: int | None = None
    #: steps (None: the spec's ``steps``)
    steps: int | None = None
    reference: bool = False
    resumes: Resumes | None = None


@dataclass(frozen=True)
class PlanContext:
    """What the runs of a check depend on besides its spec."""

    #: the loaded :class:`~trainguard.config.schema.JobFile` (the schema builds its ``checks:``
    #: from this module, so it is not imported here)
    job_file: Any
    #: the ``soak_seed`` setting (a soak's schedule replayed with it)
    soak_seed: int | None = None
    #: every check of the session, (name, spec) in run order (smoke folds into their runs)
    session: tuple[tuple[str, Any], ...] = ()


@dataclass(frozen=True)
class JobFacts:
    """What the checks' requirements read of the job: the job file, and the command, resume
    args and env values joined, and the placeholders the job uses."""

    #: the loaded :class:`~trainguard.config.schema.JobFile`
    job_file: Any
    command_text: str
    env_text: str
    used: frozenset[str]

    @property
    def checkpoints(self) -> bool:
        """Whether the job is told where to checkpoint ({checkpoint_dir} in command or env)."""
        return "{checkpoint_dir}" in self.command_text + " " + self.env_text


@dataclass(frozen=True)
class Later:
    """What a check's ``run`` returns when the rest of its verdict waits on untimed runs only
    (a fail_clean drill's resume from the checkpoint the fault left): ``finish()`` makes the
    result. :func:`trainguard.session.run_in_order` calls it once the session's timed checks
    are done, beside the other checks' ``finish``; a check returns one only while
    ``ctx.state.untimed_later`` is set."""

    finish: Callable[[], CheckResult]


@runtime_checkable
class CheckContextProtocol(Protocol[S_co]):
    """What a check's ``run``, ``ahead`` and ``prepare`` receive, as far as this layer can name
    it: :class:`trainguard.checks.context.CheckContext` (above this layer) satisfies it, and
    :class:`Check`'s constructor has mypy check that each check's functions take a context that
    does. A check names its runs to it (a declared :class:`Run` or its label); it does not see
    the runner."""

    @property
    def name(self) -> str:
        """The check's name in reports (``resume``, ``drill:<name>``)."""

    @property
    def spec(self) -> S_co:
        """The check's spec."""

    @property
    def metric(self) -> str:
        """The metric its runs' progress is followed by."""

    @property
    def job_file(self) -> Any:
        """The loaded job file (:class:`~trainguard.config.schema.JobFile`, built from here)."""

    @property
    def note(self) -> str:
        """The one line its declaration says it judges."""

    def reference(self, which: Run | str | None = None) -> RunResult:
        """The uninterrupted run of a declared reference run, launched once and shared."""

    def run(self, which: Run | str, *, label: str,
            on_metric: Callable[[MetricPoint, Launcher], None] | None = None, resume: bool = False,
            checkpoint_dir: Path | None = None, keep: bool = True) -> RunResult:
        """Launch the declared run ``which`` now, in a new run directory."""

    def prefetch(self, which: Run | str | None = None) -> None:
        """Start the declared reference run ``which`` in the background."""

    def take_ahead(self, which: Run | str) -> RunResult | None:
        """The declared run ``which`` the lane started ahead for this check, else None."""

    def stop_background(self, reason: str) -> None:
        """Stop the runs started in the background (the check was interrupted)."""


#: the context type a check's functions take (one per check: run, ahead and prepare agree)
C = TypeVar("C", bound=CheckContextProtocol[Any])


def _nothing(_spec: Any, _facts: JobFacts) -> list[tuple[str, str]]:
    return []


def _named(check: Check[Any], _spec: Any) -> list[tuple[str, tuple[Any, ...]]]:
    return [(check.name, ())]


@dataclass(frozen=True)
class Check(Generic[S]):
    """A check, typed: everything trainguard needs to know of it, in one place."""

    #: its key under ``checks:`` and its name in reports, ``--only`` and ``gate.require``
    name: str
    #: the model of its spec (``checks.<name>``; with ``many``, of each list entry)
    spec: type[S]
    #: ``(ctx) -> CheckResult``: runs it (or a :class:`Later` for its untimed rest); ``ctx`` is
    #: its :class:`trainguard.checks.context.CheckContext` (spec, request, declared runs), a
    #: :class:`CheckContextProtocol`
    run: Callable[[CheckContextProtocol[S]], CheckResult | Later]
    #: ``(spec, context) -> (runs, note)``: the launches it makes and one line on what it judges
    runs: Callable[[S, PlanContext], tuple[list[Run], str]]
    #: ``(spec, facts) -> [(key, message)]``: what it needs from the job, with the fix
    requires: Callable[[S, JobFacts], list[tuple[str, str]]] = _nothing
    #: its runs are not timed against anything: runs of later checks may start beside it
    lane: bool = False
    #: ``(ctx) -> AheadRun``: its declared run that may start early, beside the lane checks
    #: before it; ``ahead_words`` says which run that is (``trainguard validate``)
    ahead: Callable[[CheckContextProtocol[S]], Any] | None = None
    ahead_words: str = ""
    #: its ahead run is the uninterrupted run of its request: not launched when one ran already
    ahead_reference: bool = False
    #: ``(ctx) -> None``: called just before :attr:`run` inside the check's tracking
    #: (a drill starts its uninterrupted run there, while the fault run starts up)
    prepare: Callable[[CheckContextProtocol[S]], None] | None = None
    #: it times its runs, so it runs before every other check, alone, and its runs are the
    #: uninterrupted runs the others share (its result keeps its place in the report)
    first: bool = False
    #: ``gate.require`` names it when the job file does not say
    gate_default: bool = True
    #: ``checks.<name>`` is a list; each entry runs as ``<item_prefix>:<entry.name>``
    many: bool = False
    item_prefix: str = ""
    #: ``(spec) -> [(marker, args)]``: the pytest marks of its item (default: its name)
    marks: Callable[[S], list[tuple[str, tuple[Any, ...]]]] | None = None
    #: ``(spec, soak_seed) -> [(suffix, spec)]``: its pytest items when one spec makes several
    items: Callable[[S, int | None], list[tuple[str, S]]] | None = None
    #: ``(spec) -> [world size, ...]``: the reference runs whose calibration widens its tolerance
    #: (``trainguard calibrate`` runs them; None: the job's world size); None: not calibrated
    calibrates: Callable[[S], Sequence[int | None]] | None = None
    #: the evidence records its results hold, its verdict's first (an error's, a skip's after): a
    #: loaded report's evidence object becomes the first that reads it (none: a generic record)
    evidence: tuple[type[Evidence], ...] = ()

    if TYPE_CHECKING:  # the dataclass's own __init__ at run time; for mypy, typed by the context
        def __init__(  # noqa: PLR0913 -- the documented constructor of a check (docs/architecture.md)
            self, name: str, spec: type[S], run: Callable[[C], CheckResult | Later],
            runs: Callable[[S, PlanContext], tuple[list[Run], str]],
            requires: Callable[[S, JobFacts], list[tuple[str, str]]] = _nothing, lane: bool = False,
            ahead: Callable[[C], Any] | None = None, ahead_words: str = "", ahead_reference: bool = False,
            prepare: Callable[[C], None] | None = None, first: bool = False, gate_default: bool = True,
            many: bool = False, item_prefix: str = "",
            marks: Callable[[S], list[tuple[str, tuple[Any, ...]]]] | None = None,
            items: Callable[[S, int | None], list[tuple[str, S]]] | None = None,
            calibrates: Callable[[S], Sequence[int | None]] | None = None,
            evidence: tuple[type[Evidence], ...] = (),
        ) -> None:
            """A check whose ``run``, ``ahead`` and ``prepare`` take one context type ``C`` that
            satisfies :class:`CheckContextProtocol` (mypy says which member it lacks)."""

    def pytest_marks(self, spec: S) -> list[tuple[str, tuple[Any, ...]]]:
        return self.marks(spec) if self.marks is not None else _named(self, spec)


class CheckNotInstalled(ConfigError):
    """A registration line names a module or attribute that cannot be imported, or something
    that is not a :class:`Check` (said in words, as a job-file error is)."""


#: check name -> its registration line, in the order ``trainguard check`` runs the checks
CHECKS: Registry[Check[Any]] = Registry("check", {
    "smoke": "trainguard.checks.smoke:SMOKE",
    "canary": "trainguard.checks.canary:CANARY",
    "determinism": "trainguard.checks.equivalence:DETERMINISM",
    "resume": "trainguard.checks.resume:RESUME",
    "compat": "trainguard.checks.compat:COMPAT",
    "parallel": "trainguard.checks.equivalence:PARALLEL",
    "invariants": "trainguard.checks.invariants_check:INVARIANTS",
    "reshard": "trainguard.checks.reshard:RESHARD",
    "profile": "trainguard.profiling.check:PROFILE",
    "crash_points": "trainguard.drills.crash_points:CRASH_POINTS",
    "drills": "trainguard.drills.check:DRILLS",
}, accepts=lambda value: isinstance(value, Check), a="a trainguard Check", name_of=lambda check: check.name,
    error=CheckNotInstalled)


def registered() -> tuple[Check[Any], ...]:
    """Every registered check, in run order (the lines are resolved on first use)."""
    return CHECKS.entries()


def check_named(name: str) -> Check[Any] | None:
    """The check registered as ``name`` (a list check by its name, e.g. ``drills``), else None."""
    return CHECKS.find(name)


def check_for(name: str) -> Check[Any] | None:
    """The check a report or ``--only`` name runs: ``resume`` -> resume's, ``drill:<name>`` ->
    the list check whose items are ``drill:`` (the drills)."""
    prefix, colon, _ = name.partition(":")
    if colon:
        return next((c for c in registered() if c.many and c.item_prefix == prefix), None)
    return check_named(name)


def check_names(*, many: bool = False) -> list[str]:
    """The names of the single checks in run order (``many=True``: the list checks' names too)."""
    return [c.name for c in registered() if many or not c.many]


def register(line: str, *, before: str | None = None) -> Check[Any]:
    """Add a registration line at run time (a check outside trainguard, or a test's): the job
    file's ``checks:`` schema is rebuilt with it. ``before`` names the check it runs before
    (default: the end, after the drills)."""
    check = CHECKS.load(line)
    if before is not None and before not in CHECKS:
        raise CheckNotInstalled(f"register({line!r}, before={before!r}): no check is registered as "
                                f"{before!r}; registered: {', '.join(CHECKS.names())}")
    CHECKS.register(check.name, line, before=before)
    return check


def unregister(line: str) -> None:
    """Take a line :func:`register` added out again."""
    for name, registered_line in CHECKS.lines().items():
        if registered_line == line:
            CHECKS.unregister(name)


def on_change(hook: Callable[[], None]) -> None:
    """Call ``hook`` whenever :func:`register` / :func:`unregister` change the registry."""
    CHECKS.on_change(hook)


def _forget_model() -> None:
    global _model
    _model = None


# ---------------------------------------------------------------------------------------------
# ``checks:`` of the job file, made from the registry


def _null_means_defaults(value: Any) -> Any:
    # ``smoke:`` with nothing after it reads as "enabled, with defaults".
    return {} if value is None else value


def _null_means_list(value: Any) -> Any:
    return [] if value is None else value


_model: type[Checks] | None = None
CHECKS.on_change(_forget_model)


def checks_model() -> type[Checks]:
    """The ``checks:`` model of the registered checks (made once, again after :func:`register`)."""
    global _model
    if _model is None:
        fields: dict[str, Any] = {}
        for check in registered():
            if check.many:
                fields[check.name] = (Annotated[list[check.spec], BeforeValidator(_null_means_list)],  # type: ignore[name-defined]
                                      Field(default_factory=list))
            else:
                fields[check.name] = (Annotated[check.spec | None, BeforeValidator(_null_means_defaults)], None)
        _model = create_model("Checks", __base__=Checks, __module__=__name__, **fields)
    return _model


class ChecksField:
    """The annotation of ``checks:`` in the job-file model: its schema is :func:`checks_model`'s,
    built when the document's schema is (``defer_build``), after every module is imported."""

    @classmethod
    def __get_pydantic_core_schema__(cls, source: Any, handler: GetCoreSchemaHandler) -> CoreSchema:
        return handler(checks_model())


def no_checks() -> Checks:
    """An empty ``checks:`` (the default of a job file without one)."""
    return checks_model().model_validate({})
