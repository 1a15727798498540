"""The ``sdc`` fault: one bit of one element of one tensor flipped on one rank, as a silent data
corruption of a failing chip would (docs/invariants.md, "Silent data corruption drills").

The start-up hook's sdc agent (``_trainguard_sdc_agent.py`` in :mod:`trainguard.launch.hook`)
counts the rank's optimizer steps itself and flips the bit in optimizer step ``after_step + 1``
(from 1, as the step records number steps), in ``params.target``:

* ``parameter``, ``optimizer_state``, ``gradient`` (after DDP's reduction): at the step's
  optimizer pre-hook, before the run agent records the step;
* ``gradient_before_reduction``: in the step's backward, before the gradient is accumulated (and
  all-reduced);
* ``output``: a module's forward output in the step's forward.

``mode: persistent`` keeps the bit stuck from then on. Each flip (rank, step, tensor, element,
bit, old and new value) is written to the hook's event log and to the run directory
(``trainguard-sdc.jsonl``). The drill's expectations are in :mod:`trainguard.drills.sdc`:
``caught`` (default: trainguard's replica invariant, or the first divergence from the reference,
names the flip) and ``detect`` (the job's own defence reports it within ``within_steps``).
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from trainguard._internal import envvars
from trainguard.config.fault_params import FaultParams
from trainguard.config.faults import Expectation
from trainguard.evidence import Evidence
from trainguard.faults.base import FaultContext, FaultEvidence
from trainguard.faults.hook import HookEvent, HookFault
from trainguard.launch.hook import hook_env

if TYPE_CHECKING:  # pragma: no cover
    from trainguard.launch import Launcher, RunResult
    from trainguard.launch.backend import JobBackend

__all__ = ["REPLICATED_TARGETS", "SDC_MODES", "SDC_RECORD", "SDC_TARGETS", "Flip", "SdcEvidence", "SdcFault"]

#: where the bit is flipped
SDC_TARGETS = ("parameter", "optimizer_state", "gradient", "gradient_before_reduction", "output")
#: the targets whose flip stays on one rank, so the replicas show it; the others are averaged into
#: every replica by the reduction and only the reference run shows them
REPLICATED_TARGETS = ("parameter", "optimizer_state", "gradient")
SDC_MODES = ("transient", "persistent")
#: under the run directory: every flip, one JSON line each
SDC_RECORD = "trainguard-sdc.jsonl"


@dataclass
class Flip(Evidence):
    """One bit the sdc agent flipped (its ``flipped`` event)."""

    rank: int
    #: the optimizer step (from 1, as the step records number them)
    step: int
    target: str
    mode: str
    #: the parameter, or the module whose output it was
    tensor: str
    #: the optimizer state's key (``exp_avg``), for target optimizer_state
    state_key: str | None
    #: the element, row-major, in the rank's local tensor (a DTensor's shard)
    index: int
    bit: int
    dtype: str
    old: float
    new: float
    old_bits: str
    new_bits: str

    @classmethod
    def of(cls, event: HookEvent, rank: int) -> Flip:
        """The flip an event records; ``rank``: the drill's, when the event has none."""
        given = str(event.get("rank", ""))
        return cls(int(given) if given.isdigit() else rank, int(event.get("step") or 0), event.get("target", ""),
                   event.get("mode", ""), event.get("tensor", ""), event.get("state_key"), event.get("index", 0),
                   event.get("bit", 0), event.get("dtype", ""), float(event.get("old", 0.0)),
                   float(event.get("new", 0.0)), event.get("old_bits", ""), event.get("new_bits", ""))

    def what(self) -> str:
        """``output of module 6``, ``parameter 0.weight``, ``optimizer state of 0.weight (exp_avg)``."""
        if self.target == "output":
            return f"output of module {self.tensor}" if self.tensor else "output of the model's root module"
        if self.target == "gradient_before_reduction":
            return f"gradient of {self.tensor} (before its reduction)"
        if self.target == "optimizer_state":
            return f"optimizer state of {self.tensor} ({self.state_key})"
        return f"{self.target} {self.tensor}"

    def sentence(self, count: int = 1) -> str:
        """``rank 1's parameter 0.weight: bit 22 of element 0 flipped at step 4 (-0.0039 -> -0.0029)``."""
        more = (f"; persistent: the bit stuck from then on, changing the value at {count} step(s)"
                if self.mode == "persistent" else "")
        return (f"rank {self.rank}'s {self.what()}: bit {self.bit} of element {self.index} flipped at step "
                f"{self.step} ({self.old:.6g} -> {self.new:.6g}{more})")


@dataclass
class SdcEvidence(FaultEvidence):
    """What an ``sdc`` fault was set to flip, and the flips the start-up hook reported."""

    target: str
    mode: str
    bit: str
    #: the ranks whose start-up hook armed ([] when the hook never loaded)
    hook_armed_in_ranks: list[int]
    #: the hook's ``flipped`` events as it wrote them (rank, step, name, index, bit, old, new, ...)
    flips: list[Flip]
    hook_errors: list[str]


class SdcFault(HookFault):
    """One bit of one element of rank ``rank``'s ``target`` flipped at optimizer step ``after_step + 1``."""

    kind: ClassVar[str] = "sdc"
    expectations: ClassVar[tuple[Expectation, ...]] = (Expectation.CAUGHT, Expectation.DETECT)
    defaults: ClassVar[FaultParams] = FaultParams({"target": "parameter", "mode": "transient", "bit": "mantissa",
                                                   "index": 0, "name": "", "within_steps": 2,
                                                   "detect_pattern": ""})

    @classmethod
    def validate(cls, params: FaultParams) -> list[tuple[str, str]]:
        problems = super().validate(params)
        for key, allowed, example in (("target", SDC_TARGETS, "`target: optimizer_state`"),
                                      ("mode", SDC_MODES, "`mode: persistent` (a stuck bit from that step on)")):
            value = params.raw(key, cls.defaults.raw(key))
            if value not in allowed:
                problems.append((key, f"expected one of {', '.join(allowed)}, got {str(value)[:40]!r}; e.g. {example}"))
        bit = params.raw("bit", "mantissa")
        if not (bit in ("exponent", "mantissa") or (isinstance(bit, int) and not isinstance(bit, bool)
                                                     and 0 <= bit < 64)):
            problems.append(("bit", f"expected exponent, mantissa or a bit index (0: the lowest, below 64), got "
                             f"{str(bit)[:40]!r}; e.g. `bit: exponent` (the highest exponent bit: a value "
                             "that jumps by orders of magnitude)"))
        for key, low in (("index", 0), ("within_steps", 1)):
            value = params.raw(key, cls.defaults.raw(key))
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                problems.append((key, f"expected a whole number >= {low}, got {str(value)[:40]!r}"))
        pattern = params.raw("detect_pattern", "")
        if not isinstance(pattern, str):
            problems.append(("detect_pattern", f"expected a regular expression (a string), got {str(pattern)[:40]!r}"))
        else:
            try:
                re.compile(pattern)
            except re.error as exc:
                problems.append(("detect_pattern", f"not a regular expression ({exc}): {pattern[:40]!r}"))
        return problems

    @property
    def target(self) -> str:
        return self.params.text("target")

    @property
    def mode(self) -> str:
        return self.params.text("mode")

    @property
    def bit(self) -> str:
        return str(self.params.raw("bit"))

    @property
    def flip_step(self) -> int:
        """The optimizer step (from 1) whose tensor takes the flip."""
        return self.after_step + 1

    # -- life cycle --------------------------------------------------------------------------

    @classmethod
    def unavailable_for(cls, backend: JobBackend) -> str | None:
        return None if backend.rank_at_start() else (
            "the sdc fault finds its rank by RANK when the start-up hook loads, which a Ray Train "
            "worker does not have yet; drill silent data corruption on a command job (torchrun-style)")

    def setup(self, ctx: FaultContext) -> None:
        self.require_job_kind(ctx)
        self._prepare(ctx)

    def launch_env(self, ctx: FaultContext) -> dict[str, str]:
        bit = self.params.raw("bit")
        spec = {"fault": "sdc", "rank": self.rank, "trigger": str(self.trigger), "events": str(self.events_path),
                "step": self.flip_step, "target": self.target, "mode": self.mode, "bit": bit,
                "index": self.params.integer("index"), "name": self.params.text("name") or None}
        # a flipped optimizer state is seen at the next step only if the step records read the
        # state at every step (not on their schedule): this drill's runs do
        every = {envvars.STEP_STATE_EVERY: "1"} if self.target == "optimizer_state" else {}
        return {**hook_env(spec, ctx.env), **every}

    def inject(self, launcher: Launcher) -> None:
        """Nothing to pull: the agent counts the steps itself and flips at ``flip_step``; the
        time is kept for the report's rates."""
        self.injected_at = launcher.elapsed()

    def teardown(self) -> None:
        if self._ctx is not None:
            with contextlib.suppress(OSError):
                self.trigger.unlink()

    # -- what happened -------------------------------------------------------------------------

    def flips(self) -> list[Flip]:
        """The hook's ``flipped`` events, in order."""
        return [Flip.of(e, self.rank) for e in self.hook_events() if e.get("event") == "flipped"]

    def evidence(self) -> SdcEvidence:
        events = self.hook_events()
        armed = sorted({int(str(e.get("rank"))) for e in events if e.get("event") == "armed"
                        and str(e.get("rank", "")).isdigit()})
        return SdcEvidence(*self.struck(), target=self.target, mode=self.mode, bit=self.bit,
                           hook_armed_in_ranks=armed, flips=self.flips()[:20],
                           hook_errors=[str(e.get("error")) for e in events if e.get("event") == "error"])

    def classify(self, result: RunResult) -> str:
        flips = self.flips()
        where = (f" after the bit flipped in rank {self.rank}'s {self.target} at step {flips[0].step}"
                 if flips else "")
        return f"{result.reason or result.outcome}{where}"
