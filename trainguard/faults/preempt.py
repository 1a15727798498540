"""``preempt``: the scheduler's notice, then the kill, to every rank after step ``after_step``.

What a pre-empting scheduler does, sent to each rank's own process as the scheduler's node agent
would:

* ``style: kubernetes`` (default): SIGTERM, then SIGKILL ``grace`` seconds later (the pod's
  ``terminationGracePeriodSeconds``, 30 by default);
* ``style: slurm``: SIGUSR1 (``sbatch --signal=USR1@lead``), SIGTERM ``lead`` seconds later (the
  time limit; default half the grace), then SIGKILL at ``grace`` seconds after the first signal (Slurm's ``KillWait``).

A rank still running at the end of the grace is killed: that is the scheduler's doing, and the
drill's ``save_and_exit`` judge (:mod:`trainguard.drills.save_and_exit`) reports it as the job's
failure to exit in time. The fault records when each signal went out and when each rank exited,
so the report can give notice -> checkpoint complete -> exit.
"""

from __future__ import annotations

import contextlib
import math
import signal
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from trainguard.config.fault_params import FaultParams
from trainguard.config.faults import Expectation
from trainguard.evidence import Evidence
from trainguard.faults.base import Fault, FaultEvidence

if TYPE_CHECKING:  # pragma: no cover
    from trainguard.launch import Launcher, RunResult

__all__ = ["PREEMPT_STYLES", "PreemptEvidence", "PreemptFault", "SignalSent"]

#: the notice each scheduler sends before the SIGKILL
PREEMPT_STYLES = {"kubernetes": ("SIGTERM",), "slurm": ("SIGUSR1", "SIGTERM")}
_POLL_S = 0.02


def _seconds(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


@dataclass
class SignalSent(Evidence):
    """One signal of a pre-emption's schedule: which, when (seconds after the notice), to whom."""

    signal: str
    at_s: float
    ranks: list[int]


@dataclass
class PreemptEvidence(FaultEvidence):
    """The schedule a ``preempt`` fault ran and how each rank answered it."""

    style: str
    grace_s: float
    signals_sent: list[SignalSent]
    rank_exit_after_notice_s: dict[int, float]
    killed_at_grace: list[int]


class PreemptFault(Fault):
    """The notice (SIGTERM, or SIGUSR1 then SIGTERM) to every rank, SIGKILL after ``grace``."""

    kind: ClassVar[str] = "preempt"
    expectations: ClassVar[tuple[Expectation, ...]] = (Expectation.SAVE_AND_EXIT, Expectation.RECOVER, Expectation.FAIL_CLEAN,
                                                          Expectation.CONTINUE)
    defaults: ClassVar[FaultParams] = FaultParams({"style": "kubernetes", "grace": 30.0, "lead": None})

    def __init__(self, params: FaultParams | None = None, **kwargs: Any) -> None:
        super().__init__(params, **kwargs)
        #: time.time() when the first signal went out (compared with checkpoint mtimes)
        self.notice_wall: float | None = None
        self.notice_mono: float | None = None
        self.sent: list[SignalSent] = []
        self.exits: dict[int, float] = {}  # rank -> seconds after the notice it exited
        self.killed_at_grace: list[int] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def validate(cls, params: FaultParams) -> list[tuple[str, str]]:
        problems = super().validate(params)
        style = params.raw("style", "kubernetes")
        if style not in PREEMPT_STYLES:
            problems.append(("style", f"expected one of {', '.join(PREEMPT_STYLES)}, got "
                             f"{str(style)[:40]!r}; e.g. `params: {{style: slurm}}`"))
        grace = _seconds(params.raw("grace", 30.0))
        if grace is None or not 0 < grace <= 3600:
            problems.append(("grace", "expected seconds from the notice to the SIGKILL, more than 0 and at "
                             "most 3600 (Kubernetes' default is 30), e.g. `grace: 10`"))
        if params.raw("lead") is None:
            return problems
        lead = _seconds(params.raw("lead"))
        if style != "slurm":
            problems.append(("lead", "applies to `style: slurm` only (seconds from SIGUSR1 to SIGTERM); "
                             "remove it or set the style"))
        elif lead is None or lead < 0 or (grace is not None and lead >= grace):
            problems.append(("lead", "expected seconds from SIGUSR1 to SIGTERM (slurm style), at least 0 "
                             "and less than grace, e.g. `lead: 5`"))
        return problems

    @property
    def grace(self) -> float:
        return float(self.params.number("grace"))

    @property
    def lead(self) -> float:
        """slurm: seconds from SIGUSR1 to SIGTERM (default: half the grace)."""
        lead = self.params.optional_number("lead")
        return self.grace / 2 if lead is None else float(lead)

    @property
    def signals(self) -> tuple[str, ...]:
        return PREEMPT_STYLES[self.params.text("style")]

    def inject(self, launcher: Launcher) -> None:
        self.notice_wall = time.time()
        self.notice_mono = time.monotonic()
        self._send(launcher, self.signals[0])
        self._thread = threading.Thread(target=self._follow, args=(launcher,),
                                        name="trainguard-preempt", daemon=True)
        self._thread.start()

    def _send(self, launcher: Launcher, name: str) -> None:
        assert self.notice_mono is not None
        ranks = [rp.rank for rp in launcher.ranks if rp.popen.poll() is None]
        for rank in ranks:
            launcher.kill_rank(rank, signal.Signals[name])
        self.sent.append(SignalSent(name, round(time.monotonic() - self.notice_mono, 3), ranks))

    def _follow(self, launcher: Launcher) -> None:
        """The rest of the schedule: later signals, each rank's exit time, SIGKILL at grace."""
        assert self.notice_mono is not None
        later = list(self.signals[1:])
        lead = self.lead
        while True:  # look first, then wait: ranks that exit at once are timed, not missed
            since = time.monotonic() - self.notice_mono
            for rp in launcher.ranks:
                if rp.rank not in self.exits and rp.popen.poll() is not None:
                    self.exits[rp.rank] = round(since, 3)
            if len(self.exits) == len(launcher.ranks) or self._stop.is_set():
                return
            if later and since >= lead:
                self._send(launcher, later.pop(0))
            if since >= self.grace:
                alive = [rp.rank for rp in launcher.ranks if rp.popen.poll() is None]
                for rank in alive:
                    launcher.kill_rank(rank, signal.SIGKILL)
                self.killed_at_grace = alive
                self.sent.append(SignalSent("SIGKILL", round(since, 3), alive))
                deadline = time.monotonic() + 5
                while time.monotonic() < deadline and any(rp.popen.poll() is None for rp in launcher.ranks):
                    time.sleep(_POLL_S)
                for rp in launcher.ranks:
                    if rp.rank not in self.exits and rp.popen.poll() is not None:
                        self.exits[rp.rank] = round(time.monotonic() - self.notice_mono, 3)
                return
            self._stop.wait(_POLL_S)

    def clear(self) -> None:
        """The schedule ends with the attempt (a verification run gets no signals)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def teardown(self) -> None:
        with contextlib.suppress(Exception):
            self.clear()

    def evidence(self) -> PreemptEvidence:
        return PreemptEvidence(*self.struck(), style=self.params.text("style"), grace_s=self.grace,
                               signals_sent=list(self.sent), rank_exit_after_notice_s=dict(sorted(self.exits.items())),
                               killed_at_grace=list(self.killed_at_grace))

    def classify(self, result: RunResult) -> str:
        if self.killed_at_grace:
            return (f"rank(s) {', '.join(map(str, self.killed_at_grace))} still running {self.grace:g} s "
                    "after the notice, killed (SIGKILL) at the end of the grace")
        if self.exits:
            last = max(self.exits.values())
            return f"every rank exited within {last:.2f} s of the notice ({' then '.join(self.signals)})"
        return super().classify(result)
