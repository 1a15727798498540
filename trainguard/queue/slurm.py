"""Submit a promoted job to Slurm: an sbatch script, run with ``sbatch --parsable`` when present.

The script asks for the sized allocation (nodes, GPUs per node, CPUs), a ``--time`` limit from
the predicted wall-clock plus a margin, and ``--requeue``. Slurm sends ``USR1`` to the batch
shell ``signal_lead_s`` seconds before the limit (``--signal=B:USR1@N``); the script's trap
forwards it to the job step (srun passes it to every rank) so the job can write a final
checkpoint, then requeues the job (up to ``max_requeues`` times; after that the script exits 75,
so Slurm records FAILED, not COMPLETED, for a job stopped unfinished). With ``failure_requeues``
N > 0 the script also requeues a job whose step failed (a rank killed, an error) while
``SLURM_RESTART_COUNT`` is below N: a restart policy with a retry limit, its backoff Slurm's own
requeue delay (docs/drills.md, "crash_loop on Slurm requeue"). A requeued job starts with
``SLURM_RESTART_COUNT`` > 0 and the script then appends the job's ``resume_args``. The same holds
for a requeue after a node failure or preemption.

Without ``sbatch`` on PATH the script is still written and returned (``not_submitted``), so a
person can submit it from a login node.
"""

from __future__ import annotations

import json
import math
import os
import shlex
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trainguard._internal import envvars
from trainguard._internal.atomic import write_or_fallback
from trainguard._internal.envvars import MLFLOW_RUN_ID
from trainguard.queue.base import (
    Submission,
    SubmissionError,
    SubmissionSpec,
    SubmissionStatus,
    torchrun_argv,
)

__all__ = ["SlurmBackend", "key_values", "slurm_time"]

_RDZV_PORT = 29500
#: the signals torchrun turns into a shutdown of its workers: its default four + USR1
_TORCHRUN_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"


def slurm_time(seconds: float) -> str:
    """``--time`` in Slurm's ``D-HH:MM:SS`` form, rounded up to the minute."""
    minutes = max(1, math.ceil(seconds / 60.0))
    days, rest = divmod(minutes, 24 * 60)
    hours, mins = divmod(rest, 60)
    return f"{days}-{hours:02d}:{mins:02d}:00" if days else f"{hours:02d}:{mins:02d}:00"


class SlurmBackend:
    """The ``slurm`` queue backend.

    Args:
        script_dir: where the sbatch script (and by default the job's Slurm log) is written.
        margin: fraction added to the predicted wall-clock for ``--time`` (0.25: 25 %).
        min_margin_s: the least margin in seconds (short runs still get slack for start-up).
        default_time_s: ``--time`` when the spec has no prediction.
        signal_lead_s: seconds before the limit at which USR1 asks for a final checkpoint.
        max_requeues: how many times the script requeues itself after a time-limit checkpoint.
        failure_requeues: how many times in all (``SLURM_RESTART_COUNT``) the script requeues a
            job whose step failed (0: never; Slurm then records it FAILED).
        partition, account, qos: the usual directives, when given.
        extra_directives: more ``#SBATCH`` lines, e.g. ``["--constraint=a100"]``.
        sbatch: the sbatch executable (looked up on PATH).
        submit_timeout: seconds sbatch may take.
    """

    name = "slurm"

    # documented keyword-only constructor (docs/queue.md): its options are its parameters (pyproject.toml, PLR0913)
    def __init__(  # noqa: PLR0913
        self,
        script_dir: str | os.PathLike[str],
        *,
        margin: float = 0.25,
        min_margin_s: float = 900.0,
        default_time_s: float = 24 * 3600.0,
        signal_lead_s: int = 300,
        max_requeues: int = 3,
        failure_requeues: int = 0,
        partition: str | None = None,
        account: str | None = None,
        qos: str | None = None,
        extra_directives: list[str] | None = None,
        sbatch: str = "sbatch",
        submit_timeout: float = 60.0,
    ) -> None:
        if margin < 0 or min_margin_s < 0:
            raise ValueError("margin and min_margin_s must be >= 0")
        if signal_lead_s < 0:
            raise ValueError("signal_lead_s must be >= 0")
        self.script_dir = Path(script_dir)
        self.margin = margin
        self.min_margin_s = min_margin_s
        self.default_time_s = default_time_s
        self.signal_lead_s = signal_lead_s
        self.max_requeues = max_requeues
        if failure_requeues < 0:
            raise ValueError("failure_requeues must be >= 0")
        self.failure_requeues = failure_requeues
        self.partition = partition
        self.account = account
        self.qos = qos
        self.extra_directives = list(extra_directives or [])
        self.sbatch = sbatch
        self.submit_timeout = submit_timeout

    # -- the script ------------------------------------------------------------------------

    @classmethod
    def submit_and_follow(cls, spec: SubmissionSpec, *, state_dir: Path, wait_s: float) -> Submission:
        """The gate's submission: sbatch the spec from ``state_dir/slurm``, then follow the job
        for up to ``wait_s`` seconds (to its final state when it ends sooner); the record
        (submission, states seen, final state) is also written next to the script as
        ``submission-JOBID.json``."""
        script_dir = state_dir / "slurm"
        backend = cls(script_dir)
        submission = backend.submit(spec)
        if submission.job_id and wait_s > 0:
            followed = backend.wait(submission.job_id, wait_s)
            submission.status = followed.status
            submission.message = f"{submission.message}; {followed.message}"
            submission.evidence.update(followed.evidence)
        if submission.job_id:
            record = write_or_fallback(script_dir / f"submission-{submission.job_id}.json",
                                       json.dumps(submission.to_dict(), indent=2, default=str),
                                       what="the submission record")
            if record.path is not None:
                submission.links["record"] = str(record.path)
        return submission

    def time_limit_s(self, spec: SubmissionSpec) -> float:
        """Predicted wall-clock + margin (+ the signal lead, so the checkpoint fits inside)."""
        if spec.time_limit_s is None:
            return self.default_time_s
        margin = max(spec.time_limit_s * self.margin, self.min_margin_s)
        return spec.time_limit_s + margin + self.signal_lead_s

    def render(self, spec: SubmissionSpec) -> str:
        """The sbatch script for ``spec`` (a bash script; ``bash -n`` clean)."""
        q = shlex.quote
        log = self.script_dir / f"slurm-{spec.job_name}-%j.out"
        directives = [
            f"--job-name={spec.job_name}",
            f"--nodes={spec.nodes}",
            "--ntasks-per-node=1",  # one launcher (torchrun) per node starts the node's ranks
            f"--cpus-per-task={spec.cpus_per_node}",
            f"--time={slurm_time(self.time_limit_s(spec))}",
            "--requeue",
            f"--signal=B:USR1@{self.signal_lead_s}",
            "--open-mode=append",  # a requeued run appends to the same log
            f"--output={log}",
        ]
        if spec.gpus_per_node:
            directives.insert(3, f"--gpus-per-node={spec.gpus_per_node}")
        if self.partition:
            directives.append(f"--partition={self.partition}")
        if self.account:
            directives.append(f"--account={self.account}")
        if self.qos:
            directives.append(f"--qos={self.qos}")
        directives += self.extra_directives
        labels = spec.labels()
        if "trainguard.gate_report" in labels:
            # quoted: sbatch splits an #SBATCH line at spaces (unquoted, "gate" was read as a
            # directive of its own and a real sbatch refused the script)
            report = labels["trainguard.gate_report"].replace('"', "")
            directives.append(f'--comment="trainguard gate report {report}"')

        if spec.launcher == "torchrun" and (spec.world_size > 1 or spec.nodes > 1):
            argv = torchrun_argv(
                spec.entrypoint,
                nproc_per_node=spec.ranks_per_node,
                nnodes=spec.nodes,
                rdzv_endpoint=f'"$MASTER_ADDR:{_RDZV_PORT}"' if spec.nodes > 1 else None,
                rdzv_id='"$SLURM_JOB_ID"' if spec.nodes > 1 else None,
            )
        else:
            argv = list(spec.entrypoint)
        # the rendezvous values are shell expansions; everything else is quoted
        command = " ".join(t if '"$' in t else q(t) for t in argv)
        resume = " ".join(q(a) for a in spec.resume_args)
        always_resume = spec.resume and bool(spec.resume_args)

        env_lines = [f"export {k}={q(v)}" for k, v in sorted(spec.env.items())]
        if argv[:1] == ["torchrun"]:
            # srun delivers the forwarded USR1 to every process of the step, torchrun included,
            # whose default action for it is to die: the step then ends (--kill-on-bad-exit) and
            # takes the ranks down mid-checkpoint (seen on a real slurmctld). Told to handle USR1,
            # torchrun passes it to its workers and waits for them to exit: its
            # --signals-to-handle (pytorch/pytorch#160690), which reads PET_SIGNALS_TO_HANDLE;
            # an older torchrun ignores the variable
            env_lines.append(f"export PET_SIGNALS_TO_HANDLE={_TORCHRUN_SIGNALS}")
        for key, value in (
            (envvars.GATE_REPORT, labels.get("trainguard.gate_report")),
            (MLFLOW_RUN_ID, labels.get("trainguard.mlflow_run_id")),
            ("MLFLOW_RUN_ID", labels.get("trainguard.mlflow_run_id")),
        ):
            if value:
                env_lines.append(f"export {key}={q(value)}")

        lines = [
            "#!/bin/bash",
            *(f"#SBATCH {d}" for d in directives),
            "",
            f"# Written by trainguard for job {spec.job_name}; submit with: sbatch <this file>",
            *(f"# {k}: {v}" for k, v in labels.items()),
            "set -uo pipefail",
            f"cd {q(str(spec.working_dir))}",
            *env_lines,
            'MASTER_ADDR="$(scontrol show hostnames "${SLURM_JOB_NODELIST:-localhost}" '
            '2>/dev/null | head -n 1)"',
            'export MASTER_ADDR="${MASTER_ADDR:-localhost}"',
            "",
            "# one line per attempt in the log (appended to on requeue): drills split it here",
            'echo "trainguard: attempt ${SLURM_RESTART_COUNT:-0} of job ${SLURM_JOB_ID:-?} starts '
            'on $(hostname) at $(date +%s.%N)"',
            "",
            "# a requeued job (time-limit checkpoint, node failure, preemption) resumes",
            "RESUME_ARGS=()",
            f'if [ "${{SLURM_RESTART_COUNT:-0}}" -gt 0 ] || [ {int(always_resume)} -eq 1 ]; then',
            f"  RESUME_ARGS=({resume})",
            "fi",
            "",
            "# Slurm sends USR1 to this shell before the time limit: pass it on to every rank so",
            "# the job writes a final checkpoint, then requeue to continue from it",
            "TIME_LIMIT_HIT=0",
            "forward_usr1() {",
            "  TIME_LIMIT_HIT=1",
            '  echo "trainguard: USR1 (time limit near): forwarding to the job step" >&2',
            '  if [ -n "${STEP_PID:-}" ]; then kill -USR1 "$STEP_PID" 2>/dev/null; fi',
            "}",
            "trap forward_usr1 USR1",
            "",
            f'srun --kill-on-bad-exit=1 {command} ${{RESUME_ARGS[@]+"${{RESUME_ARGS[@]}}"}} &',
            "STEP_PID=$!",
            "# `wait` returns early when a trapped signal arrives: wait again until the step exits",
            "while :; do",
            '  wait "$STEP_PID"; RC=$?',
            '  if ! kill -0 "$STEP_PID" 2>/dev/null; then break; fi',
            "done",
            f'if [ "$TIME_LIMIT_HIT" -eq 1 ] && [ "${{SLURM_RESTART_COUNT:-0}}" -lt {self.max_requeues} ]; then',
            '  echo "trainguard: requeueing job $SLURM_JOB_ID to resume from its checkpoint" >&2',
            '  scontrol requeue "$SLURM_JOB_ID"',
            'elif [ "$TIME_LIMIT_HIT" -eq 1 ]; then',
            "  # the job saved and exited 0 on the notice, unfinished: Slurm must not call it COMPLETED",
            f'  echo "trainguard: time limit near and {self.max_requeues} requeue(s) used: job '
            '$SLURM_JOB_ID stops unfinished at its checkpoint (resubmit to go on)" >&2',
            "  RC=75",
            *self._failure_requeue(),
            "fi",
            'exit "$RC"',
            "",
        ]
        return "\n".join(lines)

    def _failure_requeue(self) -> list[str]:
        """The script's branch that requeues a failed job (none without ``failure_requeues``)."""
        if not self.failure_requeues:
            return []
        n = self.failure_requeues
        return [
            f'elif [ "$RC" -ne 0 ] && [ "${{SLURM_RESTART_COUNT:-0}}" -lt {n} ]; then',
            f'  echo "trainguard: the job step failed (exit $RC): requeueing job $SLURM_JOB_ID '
            f'(restart $(( ${{SLURM_RESTART_COUNT:-0}} + 1 )) of {n})" >&2',
            '  scontrol requeue "$SLURM_JOB_ID"',
        ]

    def write_script(self, spec: SubmissionSpec) -> Path:
        """Write the script atomically to ``script_dir/<job_name>.sbatch`` (where that fails,
        to the temp-directory fallback, said on stderr; a :class:`SubmissionError` when no
        place takes it)."""
        written = write_or_fallback(self.script_dir / f"{spec.job_name}.sbatch", self.render(spec),
                                    what="the sbatch script")
        if written.path is None:
            raise SubmissionError(written.problem or f"cannot write {written.requested}")
        written.path.chmod(0o755)
        return written.path

    # -- submit / status -------------------------------------------------------------------

    def submit(self, spec: SubmissionSpec) -> Submission:
        """Write the script; run ``sbatch --parsable`` on it when sbatch is on PATH."""
        path = self.write_script(spec)
        script = path.read_text(encoding="utf-8")
        links = {"script": str(path), "log": str(self.script_dir / f"slurm-{spec.job_name}-%j.out")}
        evidence = {"time_limit": slurm_time(self.time_limit_s(spec))}
        sbatch = shutil.which(self.sbatch)
        if sbatch is None:
            return Submission(
                backend=self.name,
                status="not_submitted",
                message=(
                    f"sbatch is not on PATH here: the script is at {path}; submit it on a Slurm "
                    f"login node with `sbatch {path}`"
                ),
                links=links,
                script=script,
                evidence=evidence,
            )
        try:
            proc = subprocess.run(
                [sbatch, "--parsable", str(path)],
                capture_output=True,
                text=True,
                timeout=self.submit_timeout,
                cwd=spec.working_dir,
                stdin=subprocess.DEVNULL,
            )
        except subprocess.TimeoutExpired:
            raise SubmissionError(
                f"sbatch did not answer within {self.submit_timeout:g} s for {path}; is the "
                "Slurm controller reachable (`scontrol ping`)?"
            ) from None
        if proc.returncode != 0:
            raise SubmissionError(
                f"sbatch refused {path} (exit {proc.returncode}): {proc.stderr.strip()}"
            )
        # --parsable prints "jobid" or "jobid;cluster"
        job_id = proc.stdout.strip().splitlines()[-1].split(";")[0] if proc.stdout.strip() else ""
        if not job_id:
            raise SubmissionError(f"sbatch printed no job id for {path}: {proc.stdout!r}")
        links["log"] = links["log"].replace("%j", job_id)
        return Submission(
            backend=self.name,
            status="submitted",
            message=f"submitted {spec.job_name} to Slurm as job {job_id}",
            job_id=job_id,
            links=links,
            script=script,
            evidence={**evidence, "sbatch": sbatch},
        )

    def status(self, job_id: str) -> Submission:
        """The job's state: ``scontrol show job`` while the controller holds the record (for
        ``MinJobAge`` after the end), then ``sacct`` where accounting exists, else ``unknown``.
        ``evidence`` carries Slurm's own state, ``restarts`` (requeues so far), ``exit_code``,
        ``reason`` and ``nodes``, and which tool answered (``source``)."""
        record = self._scontrol_job(job_id)
        source = "scontrol"
        if record is None:
            record, source = self._sacct_job(job_id), "sacct"
        if record is None:
            return Submission(
                backend=self.name,
                status="unknown",
                message=(f"Slurm has no record of job {job_id} (scontrol: not in the controller; "
                         "sacct: no accounting here or no such job)"),
                job_id=job_id,
            )
        state = record.get("JobState", "").upper().split(" ")[0].split("+")[0]
        status = _STATUS.get(state, "unknown")
        restarts = int(record["Restarts"]) if record.get("Restarts", "").isdigit() else None
        evidence: dict[str, Any] = {"state": state, "source": source}
        if restarts is not None:
            evidence["restarts"] = restarts
        for key, name in (("ExitCode", "exit_code"), ("Reason", "reason"), ("NodeList", "nodes")):
            if record.get(key) and record[key] not in ("(null)", "None"):
                evidence[name] = record[key]
        message = state.lower()
        if evidence.get("reason"):
            message += f" ({evidence['reason']})"
        return Submission(backend=self.name, status=status, message=message, job_id=job_id,
                          evidence=evidence)

    def wait(
        self,
        job_id: str,
        timeout: float,
        *,
        until: Callable[[Submission], bool] = lambda s: s.terminal,
        poll_s: float = 1.0,
    ) -> Submission:
        """Follow the job: poll :meth:`status` every ``poll_s`` until ``until(status)`` (default:
        a terminal state) or ``timeout`` seconds; returns the last status either way (never waits
        longer), its ``evidence["states"]`` the transitions seen (``[seconds, state, restarts]``)
        and ``evidence["followed_s"]``."""
        started = time.monotonic()
        deadline = started + timeout
        seen: list[list[Any]] = []

        def poll() -> Submission:
            now = self.status(job_id)
            mark = [round(time.monotonic() - started, 1), now.evidence.get("state", now.status),
                    now.evidence.get("restarts")]
            if not seen or seen[-1][1:] != mark[1:]:
                seen.append(mark)
            return now

        state = poll()
        while not until(state) and time.monotonic() < deadline:
            time.sleep(min(poll_s, max(0.0, deadline - time.monotonic())))
            state = poll()
        state.evidence["states"] = seen
        state.evidence["followed_s"] = round(time.monotonic() - started, 1)
        if not state.terminal and not until(state):
            state.message += (f"; still {state.status} after following it for {timeout:g} s "
                              f"(follow on with `squeue -j {job_id}` or `scontrol show job {job_id}`)")
        return state

    def requeue(self, job_id: str) -> None:
        """``scontrol requeue JOB``: Slurm stops the running job and queues it again (what a
        preemption with ``PreemptMode=REQUEUE`` does); raises :class:`SubmissionError`."""
        self.scontrol("requeue", job_id)

    def scontrol(self, *args: str) -> str:
        """Run ``scontrol ARGS`` (bounded by ``submit_timeout``); its stdout, or a
        :class:`SubmissionError` naming the command and Slurm's message."""
        return self.client("scontrol", *args)

    def client(self, tool: str, *args: str) -> str:
        """Run the Slurm client ``tool`` (scontrol, scancel, squeue) with ``args``, bounded by
        ``submit_timeout``; its stdout, or a :class:`SubmissionError` naming the command and
        Slurm's message."""
        path = shutil.which(tool)
        if path is None:
            raise SubmissionError(f"{tool} is not on PATH here; run this on a Slurm login node")
        try:
            proc = subprocess.run([path, *args], capture_output=True, text=True,
                                  timeout=self.submit_timeout, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            raise SubmissionError(f"{tool} {' '.join(args)} did not answer within "
                                  f"{self.submit_timeout:g} s; is the controller up (`scontrol ping`)?") from None
        if proc.returncode:
            raise SubmissionError(f"{tool} {' '.join(args)} exited {proc.returncode}: {proc.stderr.strip()}")
        return proc.stdout

    def signal_steps(self, job_id: str, signal: str = "KILL") -> list[str]:
        """Send ``signal`` to the tasks of the running job's steps (``scancel --signal=SIG
        JOB.STEP``; the batch shell is spared, so the job script sees its step fail); the steps
        signalled (none: the job runs no step now)."""
        listed = self.client("squeue", "--steps", "--jobs", job_id, "--noheader", "--format=%i").split()
        steps = [s for s in listed if s.partition(".")[2].isdigit()]
        for step in steps:
            self.client("scancel", f"--signal={signal}", step)
        return steps

    def _scontrol_job(self, job_id: str) -> dict[str, str] | None:
        try:
            text = self.scontrol("show", "job", "--oneliner", job_id)
        except SubmissionError:
            return None
        return key_values(text) or None

    def _sacct_job(self, job_id: str) -> dict[str, str] | None:
        sacct = shutil.which("sacct")
        if sacct is None:
            return None
        fields = ("JobState", "ExitCode", "Restarts", "NodeList", "Reason")
        try:
            proc = subprocess.run(
                [sacct, "--noheader", "--parsable2", "--allocations", "--jobs", job_id,
                 "--format=State,ExitCode,Restart,NodeList,Reason"],
                capture_output=True, text=True, timeout=self.submit_timeout, stdin=subprocess.DEVNULL,
            )
        except subprocess.TimeoutExpired:
            return None
        lines = proc.stdout.strip().splitlines()
        if proc.returncode or not lines:
            return None
        return dict(zip(fields, lines[-1].split("|")))


#: Slurm's job states as submission statuses (a requeued or preempted job is pending again)
_STATUS: dict[str, SubmissionStatus] = {
    "PENDING": "pending",
    "CONFIGURING": "pending",
    "REQUEUED": "pending",
    "REQUEUE_FED": "pending",
    "REQUEUE_HOLD": "pending",
    "RESV_DEL_HOLD": "pending",
    "PREEMPTED": "pending",
    "SUSPENDED": "pending",
    "RUNNING": "running",
    "COMPLETING": "running",
    "RESIZING": "running",
    "SIGNALING": "running",
    "STAGE_OUT": "running",
    "COMPLETED": "succeeded",
    "FAILED": "failed",
    "TIMEOUT": "failed",
    "NODE_FAIL": "failed",
    "OUT_OF_MEMORY": "failed",
    "BOOT_FAIL": "failed",
    "DEADLINE": "failed",
    "CANCELLED": "stopped",
    "REVOKED": "stopped",
}


def key_values(text: str) -> dict[str, str]:
    """``scontrol show -o``'s ``Key=Value Key=Value`` line as a dict (values without spaces;
    the few with spaces, like ``Command``, are cut at the first one, which is all we read)."""
    out: dict[str, str] = {}
    for token in text.split():
        key, sep, value = token.partition("=")
        if sep and key and key not in out:
            out[key] = value
    return out
