"""Every ``TRAINGUARD_*`` environment variable trainguard sets or reads that is not a setting,
named once (docs/markers-and-options.md, "Environment variables").

The settings (``TRAINGUARD_SEED``, ``TRAINGUARD_TRACKING``, ...: ``TRAINGUARD_<NAME>`` of each
option) have their own table, :data:`trainguard.config.settings.OPTIONS`. Everything else a
launched job, a Ray worker, a ``@pytest.mark.ddp`` child or the start-up hook finds in its
environment is here, with what it is for (:data:`VARIABLES`). The start-up hook's agents run in
the user's process on the standard library alone, so they spell their two names out; the
structure test checks those spellings against this table.
"""

from __future__ import annotations

__all__ = [
    "DDP_CHILD",
    "FAULT_HOOK",
    "FAULT_HOOK_PID",
    "GATE_REPORT",
    "MLFLOW_RUN_ID",
    "MLFLOW_RUN_ID_FILE",
    "MLFLOW_TRACKING_URI",
    "PROXY_ADDR",
    "RAY_DRIVER",
    "RAY_HEAD",
    "RAY_SIGNALS",
    "RUN_DIR",
    "RUN_HOOK",
    "STEP_STATE_EVERY",
    "VARIABLES",
    "WORKER_RUN_HOOK",
]

#: the MLflow run a launched process logs to (``trainguard.tracking.track``, the Ray workers' writer)
MLFLOW_RUN_ID = "TRAINGUARD_MLFLOW_RUN_ID"
#: a file the run's id is written to when the process starts before its run exists
MLFLOW_RUN_ID_FILE = "TRAINGUARD_MLFLOW_RUN_ID_FILE"
#: the tracking URI of that run's store
MLFLOW_TRACKING_URI = "TRAINGUARD_MLFLOW_TRACKING_URI"
#: the run directory of a launched run (each rank's logs, the hook's records)
RUN_DIR = "TRAINGUARD_RUN_DIR"
#: the fault agent's spec (JSON), read by the start-up hook in each rank
FAULT_HOOK = "TRAINGUARD_FAULT_HOOK"
#: the pid the fault agent armed in (children inherit the hook inert)
FAULT_HOOK_PID = "TRAINGUARD_FAULT_HOOK_PID"
#: the run agent's spec (JSON): trainer metrics and sample indices
RUN_HOOK = "TRAINGUARD_RUN_HOOK"
#: the run agent's spec (JSON) for a backend whose ranks the launcher does not start (Ray Train):
#: its driver installs the agent in each rank once the rank is known, not at start-up
WORKER_RUN_HOOK = "TRAINGUARD_WORKER_RUN_HOOK"
#: the step records read the optimizer state and the RNG states every this many steps, over the
#: job's ``record_state_every`` (the sdc drill of an optimizer state sets 1 for its runs)
STEP_STATE_EVERY = "TRAINGUARD_STEP_STATE_EVERY"
#: how a drill signals a Ray Train worker: ``api`` (through Ray), ``pid`` or ``auto``
RAY_SIGNALS = "TRAINGUARD_RAY_SIGNALS"
#: the temp dir of a Ray head trainguard started (to find and stop what it left)
RAY_HEAD = "TRAINGUARD_RAY_HEAD"
#: the host and pid of the Ray Train driver (``host:pid``), for its workers' writer
RAY_DRIVER = "TRAINGUARD_RAY_DRIVER"
#: a network drill's proxy address, handed to the job (the default of ``params.env``)
PROXY_ADDR = "TRAINGUARD_PROXY_ADDR"
#: set in a ``@pytest.mark.ddp`` child process: the backend its ranks use
DDP_CHILD = "TRAINGUARD_DDP_CHILD"
#: the gate report a job submitted to Slurm was promoted by
GATE_REPORT = "TRAINGUARD_GATE_REPORT"

#: name -> what it is for (the docs' table is checked against this)
VARIABLES: dict[str, str] = {
    MLFLOW_RUN_ID: "the MLflow run a launched process logs to",
    MLFLOW_RUN_ID_FILE: "a file that holds that run's id once the run exists",
    MLFLOW_TRACKING_URI: "the tracking URI of that run's store",
    RUN_DIR: "the run directory of a launched run",
    FAULT_HOOK: "the fault agent's spec (JSON), read by the start-up hook",
    FAULT_HOOK_PID: "the pid the fault agent armed in (children inherit the hook inert)",
    RUN_HOOK: "the run agent's spec (JSON): trainer metrics, sample indices",
    WORKER_RUN_HOOK: "the run agent's spec for Ray Train workers: the driver installs it in each",
    STEP_STATE_EVERY: "the step records read the optimizer and RNG states every this many steps (over the job's)",
    RAY_SIGNALS: "how a drill signals a Ray Train worker: api, pid or auto",
    RAY_HEAD: "the temp dir of a Ray head trainguard started",
    RAY_DRIVER: "host:pid of the Ray Train driver, for its workers' writer",
    PROXY_ADDR: "a network drill's proxy address (the default of params.env)",
    DDP_CHILD: "set in a @pytest.mark.ddp child: the backend of its ranks",
    GATE_REPORT: "the gate report a job submitted to Slurm was promoted by",
}
