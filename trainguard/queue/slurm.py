"""Submit a promoted job to Slurm: an sbatch script, run with ``sbatch --parsable`` when present.

The script asks for the sized allocation (nodes, GPUs per node, CPUs), a ``--time`` limit from
the predicted wall-clock plus a margin, and ``--requeue``. Slurm sends ``USR1`` to the batch
shell ``signal_lead_s`` seconds before the limit (``--signal=B:USR1@N``); the script's trap
forwards it to the job step (srun passes it to every rank) so the job can write a final
checkpoint, then requeues the job (up to ``max_requeues`` times). A requeued job starts with
``SLURM_RESTART_COUNT`` > 0 and the script then appends the job's ``resume_args``. The same holds
for a requeue after a node failure or preemption.

Without ``sbatch`` on PATH the script is still written and returned (``not_submitted``), so a
person can submit it from a login node.
"""

from __future__ import annotations

import math
import os
import shlex
import shutil
import subprocess
from pathlib import Path

from trainguard._internal.atomic import write_or_fallback
from trainguard._internal.envvars import MLFLOW_RUN_ID
from trainguard.queue.base import Submission, SubmissionError, SubmissionSpec, torchrun_argv

__all__ = ["SlurmBackend", "slurm_time"]

_RDZV_PORT = 29500


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
        partition, account, qos: the usual directives, when given.
        extra_directives: more ``#SBATCH`` lines, e.g. ``["--constraint=a100"]``.
        sbatch: the sbatch executable (looked up on PATH).
        submit_timeout: seconds sbatch may take.
    """

    name = "slurm"

    def __init__(
        self,
        script_dir: str | os.PathLike[str],
        *,
        margin: float = 0.25,
        min_margin_s: float = 900.0,
        default_time_s: float = 24 * 3600.0,
        signal_lead_s: int = 300,
        max_requeues: int = 3,
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
        self.partition = partition
        self.account = account
        self.qos = qos
        self.extra_directives = list(extra_directives or [])
        self.sbatch = sbatch
        self.submit_timeout = submit_timeout

    # -- the script ------------------------------------------------------------------------

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
            directives.append(
                f"--comment=trainguard gate report {labels['trainguard.gate_report']}"
            )

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
        for key, value in (
            ("TRAINGUARD_GATE_REPORT", labels.get("trainguard.gate_report")),
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
            "fi",
            'exit "$RC"',
            "",
        ]
        return "\n".join(lines)

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
        """The job's state from ``squeue`` (``unknown`` without Slurm tools or a record)."""
        squeue = shutil.which("squeue")
        if squeue is None:
            return Submission(
                backend=self.name,
                status="unknown",
                message="squeue is not on PATH here",
                job_id=job_id,
            )
        try:
            proc = subprocess.run(
                [squeue, "--noheader", "--jobs", job_id, "--format=%T"],
                capture_output=True,
                text=True,
                timeout=self.submit_timeout,
                stdin=subprocess.DEVNULL,
            )
        except subprocess.TimeoutExpired:
            return Submission(
                backend=self.name, status="unknown", message="squeue timed out", job_id=job_id
            )
        state = proc.stdout.strip().upper()
        status = {
            "PENDING": "pending",
            "CONFIGURING": "pending",
            "REQUEUED": "pending",
            "RUNNING": "running",
            "COMPLETING": "running",
            "COMPLETED": "succeeded",
            "FAILED": "failed",
            "TIMEOUT": "failed",
            "NODE_FAIL": "failed",
            "OUT_OF_MEMORY": "failed",
            "CANCELLED": "stopped",
            "PREEMPTED": "pending",
        }.get(state, "unknown")
        return Submission(
            backend=self.name,
            status=status,  # type: ignore[arg-type]
            message=state.lower() or f"squeue has no job {job_id} (finished jobs: sacct)",
            job_id=job_id,
        )
