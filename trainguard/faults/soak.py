"""``soak``: a chaos soak -- several faults drawn at random from a seed during one longer run.

A soak drill is a schedule, not a fault of its own: ``(kind, rank, trigger step)`` events drawn
from ``seed`` (:func:`soak_schedule`), each injected by that kind's own :class:`Fault` when the
watched rank prints the trigger step, whichever attempt of the run is going then. The drill
(:mod:`trainguard.drills.soak`) restarts the job after each fault (``max_restarts``) and judges
the whole run like a recover drill: it completes and matches the uninterrupted run on every step.

The same seed gives the same schedule on every machine (Python's :class:`random.Random` seeded
with a string is stable across platforms and versions); when a fault strikes, in wall-clock
time, follows the job's output, which is read with a lag of a step or two.

Parameters (``params`` of a ``fault: soak`` drill):

* ``kinds``: the fault kinds to draw from (default ``[kill_rank]``); any of :data:`SOAK_KINDS`;
* ``seed``: the schedule's seed (default 0; the ``soak_seed`` setting overrides it); or
  ``seeds``: several, each its own run (one pytest item per seed, ``drill:NAME[seed=N]``);
* ``every_steps``: the mean number of steps between two faults (a Poisson process in steps);
  or ``faults``: exactly this many faults, spread at random (not both; default ``every_steps``
  = steps / 6, about five faults);
* ``min_gap``: the fewest steps between two faults, and after the last one (default 3), so the job
  makes progress between them;
* ``ranks``: the ranks faults may strike (default: every rank);
* ``fault_params``: each kind's own parameters, e.g. ``{preempt: {grace: 5}}``.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, ClassVar, TypeGuard

from trainguard.config.fault_params import FaultParams
from trainguard.config.faults import Expectation
from trainguard.faults.base import Fault

if TYPE_CHECKING:  # pragma: no cover
    from trainguard.config import DrillSpec
    from trainguard.config.registry import Run
    from trainguard.launch import Launcher
    from trainguard.launch.backend import JobBackend

__all__ = ["SOAK_KINDS", "SoakEvent", "SoakFault", "soak_schedule", "soak_seeds"]

#: kinds a soak can draw: each ends the attempt it strikes (the job is then restarted) and needs
#: nothing set up per fault (a mount, a cgroup) that a second fault of the run would collide with
SOAK_KINDS = ("kill_rank", "hang", "preempt", "kill_worker")
#: the most faults one soak may hold
MAX_SOAK_FAULTS = 1000


@dataclass(frozen=True)
class SoakEvent:
    """One fault of the schedule: ``kind`` on ``rank`` once the job prints step ``step``."""

    index: int
    kind: str
    rank: int
    step: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value: object) -> TypeGuard[float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


# the soak schedule: keyword-only, documented below: its options are its parameters (pyproject.toml, PLR0913)
def soak_schedule(  # noqa: PLR0913
    seed: int,
    steps: int,
    world_size: int,
    *,
    kinds: Sequence[str] = ("kill_rank",),
    every_steps: float | None = None,
    faults: int | None = None,
    min_gap: int = 3,
    ranks: Sequence[int] | None = None,
) -> list[SoakEvent]:
    """The schedule of a soak: faults by increasing trigger step, at least ``min_gap`` steps
    apart and ``min_gap`` before the last step. ``ValueError`` when it cannot be drawn (the
    message says what to change)."""
    if min_gap < 1:
        raise ValueError("min_gap must be at least 1")
    targets = sorted(set(ranks)) if ranks is not None else list(range(world_size))
    if not targets or not kinds:
        raise ValueError("a soak needs at least one kind and one rank")
    rng = random.Random(f"trainguard-soak:{seed}")
    last = steps - min_gap  # the last trigger step: the job has min_gap steps left after it
    triggers: list[int] = []
    if faults is not None:
        slack = last - min_gap * faults
        if faults < 1 or slack < 0:
            raise ValueError(f"{faults} faults at least {min_gap} steps apart do not fit in "
                             f"{steps} steps; lower `faults` or `min_gap`, or raise `steps`")
        spots = sorted(rng.randint(0, slack) for _ in range(faults))
        triggers = [spot + (i + 1) * min_gap for i, spot in enumerate(spots)]
    else:
        mean = every_steps if every_steps is not None else steps / 6
        if mean <= 0:
            raise ValueError("every_steps must be > 0")
        step = 0
        while len(triggers) < MAX_SOAK_FAULTS:
            step += max(min_gap, round(rng.expovariate(1.0 / mean)))
            if step > last:
                break
            triggers.append(step)
    return [SoakEvent(i, kinds[rng.randrange(len(kinds))], targets[rng.randrange(len(targets))], step)
            for i, step in enumerate(triggers)]


def soak_seeds(params: FaultParams, setting: int | None) -> list[int]:
    """The seeds a soak drill runs with: the ``soak_seed`` setting when given (a replay), else
    ``params.seeds``, else ``[params.seed]`` (0)."""
    if setting is not None:
        return [int(setting)]
    seeds = params.raw("seeds")
    if isinstance(seeds, list) and seeds:
        return list(dict.fromkeys(int(x) for x in seeds))
    return [params.integer("seed") if "seed" in params else 0]


class SoakFault(Fault):
    """The ``soak`` entry of the fault registry: its parameters and its schedule; the drill
    injects the scheduled faults through their own classes (this one injects nothing)."""

    kind: ClassVar[str] = "soak"
    #: a soak is judged as one long recover
    expectations: ClassVar[tuple[Expectation, ...]] = (Expectation.RECOVER,)
    drill_runner: ClassVar[str | None] = "trainguard.drills.soak:run_soak"
    spec_keys_not_applying: ClassVar[tuple[tuple[str, ...], str]] = (
        ("after_step", "duration"),
        "its faults strike at the steps its schedule draws from `params.seed`, and each ends the "
        "attempt it strikes; remove it, and set how many faults and how far apart with "
        "`params.faults` (or `every_steps`) and `params.min_gap`")
    defaults: ClassVar[FaultParams] = FaultParams({
        "kinds": ["kill_rank"], "seed": 0, "seeds": None, "every_steps": None, "faults": None, "min_gap": 3,
        "ranks": None, "fault_params": {},
    })

    @classmethod
    def drill_runs(cls, spec: DrillSpec, world_size: int, seed: int | None) -> tuple[list[Run], str] | None:
        """The uninterrupted run, then per seed one run with up to max_restarts restarts; the
        schedule of each seed, as it will be drawn."""
        from trainguard.config.registry import Run

        runs, words = [Run("reference", world_size, reference=True)], []
        for one in soak_seeds(spec.fault_params, seed):
            events = cls.schedule_of(spec.fault_params, spec.steps, world_size, one)
            limit = spec.max_restarts if spec.max_restarts is not None else len(events) + 2
            runs += [Run(f"seed {one}, attempt {i}", world_size) for i in range(min(limit, len(events)) + 1)]
            shown = ", ".join(f"{e.kind} r{e.rank} @{e.step}" for e in events[:8])
            words.append(f"seed {one}: {len(events)} faults ({shown}{', ...' if len(events) > 8 else ''})")
        return runs, "chaos soak, expect recover every time; " + "; ".join(words)

    @classmethod
    def drill_items(cls, spec: DrillSpec, seed: int | None) -> list[tuple[str, DrillSpec]]:
        """One pytest item per seed (a replay is one test)."""
        return [(f"[seed={one}]", spec.model_copy(update={"params": {**spec.params, "seed": one, "seeds": None}}))
                for one in soak_seeds(spec.fault_params, seed)]

    @classmethod
    def validate(cls, params: FaultParams) -> list[tuple[str, str]]:
        from trainguard.config.faults import fault_class

        problems = super().validate(params)
        kinds = params.raw("kinds", ["kill_rank"])
        if (not isinstance(kinds, list) or not kinds
                or not all(isinstance(k, str) and k in SOAK_KINDS for k in kinds)):
            problems.append(("kinds", f"expected a list of fault kinds from {', '.join(SOAK_KINDS)}, "
                             "e.g. `kinds: [kill_rank, preempt]` (faults that end the attempt they strike)"))
            kinds = []
        seed = params.raw("seed", 0)
        if not _int(seed) or not 0 <= seed < 2**32:
            problems.append(("seed", "expected an integer between 0 and 2**32-1, e.g. `seed: 7`"))
        seeds = params.raw("seeds")
        if seeds is not None and (not isinstance(seeds, list) or not seeds
                                  or not all(_int(x) and 0 <= x < 2**32 for x in seeds)):
            problems.append(("seeds", "expected a list of seeds (integers from 0 to 2**32-1), "
                             "e.g. `seeds: [1, 2, 3]`"))
        every, count = params.raw("every_steps"), params.raw("faults")
        if every is not None and count is not None:
            problems.append(("faults", "give `every_steps` (a rate) or `faults` (a count), not both"))
        if every is not None and (not _number(every) or every <= 0):
            problems.append(("every_steps", "expected the mean number of steps between two faults "
                             "(a number > 0), e.g. `every_steps: 15`"))
        if count is not None and (not _int(count) or not 1 <= count <= MAX_SOAK_FAULTS):
            problems.append(("faults", f"expected a number of faults from 1 to {MAX_SOAK_FAULTS}"))
        gap = params.raw("min_gap", 3)
        if not _int(gap) or gap < 1:
            problems.append(("min_gap", "expected a number of steps >= 1, e.g. `min_gap: 3`"))
        ranks = params.raw("ranks")
        if ranks is not None and (not isinstance(ranks, list) or not ranks
                                  or not all(_int(r) and r >= 0 for r in ranks)):
            problems.append(("ranks", "expected a list of ranks, e.g. `ranks: [0, 1]`"))
        own = params.raw("fault_params", {})
        if not isinstance(own, dict):
            problems.append(("fault_params", "expected a mapping of kind -> its parameters, "
                             "e.g. `fault_params: {preempt: {grace: 5}}`"))
            own = {}
        for kind, kind_params in own.items():
            if kind not in kinds:
                problems.append((f"fault_params.{kind}", f"{kind!r} is not among `kinds`; add it "
                                 "there or remove its parameters"))
            elif not isinstance(kind_params, dict):
                problems.append((f"fault_params.{kind}", "expected a mapping of that fault's parameters"))
            else:
                problems += [(f"fault_params.{kind}.{key}", message)
                             for key, message in fault_class(kind).validate(FaultParams(kind_params))]
        return problems

    @classmethod
    def unavailable_for(cls, backend: JobBackend) -> str | None:
        # the soak relaunches the group after each fault: a backend that recovers one of its
        # faults inside the launch itself would restart under the soak's feet
        if not any(backend.drill_restarts(kind, "recover", 1).in_launch for kind in SOAK_KINDS):
            return None
        return ("a soak runs a torchrun-style job (trainguard restarts its ranks); for a ray_train job "
                "use kill_rank and node_loss drills, which Ray Train recovers inside one fit")

    @classmethod
    def plan_problems(cls, params: FaultParams, steps: int, world_size: int) -> list[tuple[str, str]]:
        """What is wrong with the schedules of these (valid) ``params``, as ``(param, message)``:
        ranks beyond ``world_size`` (a fault could strike no process), a schedule that does not fit
        ``steps``, or one that holds no fault for a seed of the job file (the soak could only be
        an error). A seed given at run time (``--seed``) is checked when it runs."""
        ranks = params.over(cls.defaults).optional_integers("ranks") or []
        beyond = sorted({r for r in ranks if r >= world_size})
        if beyond:
            return [("ranks", f"rank(s) {', '.join(map(str, beyond))} do not exist in a run of {world_size} "
                     f"rank(s); use ranks from 0 to {world_size - 1}, or set the drill's world_size")]
        for seed in soak_seeds(params, None):
            try:
                events = cls.schedule_of(params, steps, world_size, seed)
            except ValueError as exc:
                return [("", str(exc))]
            if not events:
                return [("every_steps", f"the schedule of seed {seed} holds no fault in {steps} steps "
                         "(`every_steps` draws how many, which can be none); raise `steps`, lower "
                         "`every_steps`, or give an exact count with `faults: N`")]
        return []

    @classmethod
    def schedule_of(cls, params: FaultParams, steps: int, world_size: int,
                    seed: int | None = None) -> list[SoakEvent]:
        """The schedule of a drill with these (valid) ``params``; ``seed`` overrides theirs."""
        merged = params.over(cls.defaults)
        return soak_schedule(
            merged.integer("seed") if seed is None else seed, steps, world_size,
            kinds=merged.texts("kinds"), every_steps=merged.optional_number("every_steps"),
            faults=merged.optional_integer("faults"), min_gap=merged.integer("min_gap"),
            ranks=merged.optional_integers("ranks"),
        )

    def inject(self, launcher: Launcher) -> None:
        raise NotImplementedError("a soak injects its scheduled faults through their own classes "
                                  "(trainguard.drills.soak)")
