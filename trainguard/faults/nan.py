"""The ``nan`` fault: a NaN (or Inf) put into one rank's loss or gradients, from inside the
process, through the start-up hook (docs/faults-numerics.md).

After the target rank has printed step ``after_step`` the drill pulls the hook's trigger, and the
rank's next training step takes the value (``_trainguard_nan_agent.py`` in
:mod:`trainguard.launch.hook`):

* ``target: loss`` (default): the next loss a ``torch.nn.functional`` loss function (or a
  ``torch.nn`` ``*Loss`` module) computes with autograd on comes back multiplied by ``value``; a
  loss computed by hand takes it at ``backward()``;
* ``target: grads``: the next backward fills every parameter's gradient with ``value`` before it
  is accumulated, so before DDP's all-reduce and ``optimizer.step()``.

``policy`` says what the job is meant to do about it (``stop`` or ``skip``), judged by the
``handle_nonfinite`` expectation (:mod:`trainguard.drills.nonfinite`).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from trainguard.config.fault_params import FaultParams
from trainguard.config.faults import Expectation
from trainguard.evidence import UNSET, Unset
from trainguard.faults.base import FaultContext, FaultEvidence
from trainguard.faults.hook import HookEvent, HookFault, pull_trigger
from trainguard.launch.hook import hook_env

if TYPE_CHECKING:  # pragma: no cover
    from trainguard.launch import Launcher, RunResult
    from trainguard.launch.backend import JobBackend

__all__ = ["NAN_POLICIES", "NAN_TARGETS", "NAN_VALUES", "NanEvidence", "NanFault"]

#: what the job is meant to do about a non-finite value
NAN_POLICIES = ("stop", "skip")
#: where the value goes in
NAN_TARGETS = ("loss", "grads")
#: the value put in
NAN_VALUES = ("nan", "inf", "-inf")


def _value_name(value: Any) -> str | None:
    """``nan``, ``inf`` or ``-inf`` for a string or a YAML float (``.nan``, ``.inf``); else None."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, str) and value.strip().lower() in NAN_VALUES:
        return value.strip().lower()
    return None


@dataclass
class NanEvidence(FaultEvidence):
    """What a ``nan`` fault put where, and what the start-up hook reported doing it."""

    policy: str
    target: str
    value: str
    #: the ranks whose start-up hook armed ([] when the hook never loaded)
    hook_armed_in_ranks: list[int]
    torch_patched: bool
    #: the hook's ``injected`` event as it wrote it (rank, step, via, target, value, ...)
    injection: dict[str, Any] | None
    #: what the hook reported going wrong (arming, patching torch)
    hook_errors: list[str | None] | Unset = UNSET


class NanFault(HookFault):
    """A non-finite value in rank ``rank``'s loss or gradients at the step after ``after_step``."""

    kind: ClassVar[str] = "nan"
    expectations: ClassVar[tuple[Expectation, ...]] = (Expectation.HANDLE_NONFINITE, Expectation.RECOVER, Expectation.FAIL_CLEAN,
                                                          Expectation.CONTINUE)
    defaults: ClassVar[FaultParams] = FaultParams({"policy": "stop", "target": "loss", "value": "nan"})

    @classmethod
    def validate(cls, params: FaultParams) -> list[tuple[str, str]]:
        problems = super().validate(params)
        for key, allowed, example in (
            ("policy", NAN_POLICIES, "`policy: skip` (the job skips the step and goes on) or "
                                     "`policy: stop` (it exits non-zero with an error)"),
            ("target", NAN_TARGETS, "`target: grads`"),
        ):
            value = params.raw(key, cls.defaults.raw(key))
            if value not in allowed:
                problems.append((key, f"expected one of {', '.join(allowed)}, got {str(value)[:40]!r}; "
                                 f"e.g. {example}"))
        if _value_name(params.raw("value", "nan")) is None:
            problems.append(("value", f"expected one of {', '.join(NAN_VALUES)}, got "
                             f"{str(params.raw('value'))[:40]!r}; e.g. `value: inf`"))
        return problems

    @property
    def policy(self) -> str:
        return self.params.text("policy")

    @property
    def target(self) -> str:
        return self.params.text("target")

    @property
    def value(self) -> str:
        return _value_name(self.params.raw("value")) or "nan"

    # -- life cycle --------------------------------------------------------------------------

    @classmethod
    def unavailable_for(cls, backend: JobBackend) -> str | None:
        return None if backend.rank_at_start() else (
            "the nan fault finds its rank by RANK when the start-up hook loads, which a Ray "
            "Train worker does not have yet; drill numerics on a command job (torchrun-style)")

    def setup(self, ctx: FaultContext) -> None:
        self.require_job_kind(ctx)
        self._prepare(ctx)

    def launch_env(self, ctx: FaultContext) -> dict[str, str]:
        spec = {"fault": "nan", "rank": self.rank, "trigger": str(self.trigger),
                "events": str(self.events_path), "step": self.after_step,
                "target": self.target, "value": self.value}
        return hook_env(spec, ctx.env)

    def inject(self, launcher: Launcher) -> None:
        self.injected_at = launcher.elapsed()
        pull_trigger(self.trigger)

    def clear(self) -> None:
        """One value, once: the hook disarms itself; no later run takes it."""
        if self._ctx is not None:
            with contextlib.suppress(OSError):
                self.trigger.unlink()

    def teardown(self) -> None:
        self.clear()

    # -- what happened -------------------------------------------------------------------------

    def injection(self) -> HookEvent | None:
        """The hook's ``injected`` event (rank, step, via, target, value), or None."""
        return next((e for e in self.hook_events() if e.get("event") == "injected"), None)

    def evidence(self) -> NanEvidence:
        events = self.hook_events()
        armed = sorted({int(str(e.get("rank"))) for e in events if e.get("event") == "armed"
                        and str(e.get("rank", "")).isdigit()})
        errors = [e.get("error") for e in events if e.get("event") == "error"]
        return NanEvidence(*self.struck(), policy=self.policy, target=self.target, value=self.value,
                           hook_armed_in_ranks=armed,
                           torch_patched=any(e.get("event") == "torch_patched" for e in events),
                           injection=dict(injected) if (injected := self.injection()) is not None else None,
                           hook_errors=errors or UNSET)

    def classify(self, result: RunResult) -> str:
        injected = self.injection()
        where = (f" after the {self.value} put into rank {self.rank}'s {self.target} at step "
                 f"{injected.get('step') or '?'}") if injected else ""
        return f"{result.reason or result.outcome}{where}"
