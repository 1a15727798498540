"""The Ray driver trainguard launches for a ``ray_train`` job (``python -m trainguard.raytrain.driver``).

It imports nothing of the user's until a Ray worker runs their function: each worker first wraps
``ray.train.report`` so that world rank 0 prints ``trainguard-report step=N name=value ...``
(Ray forwards worker output to the driver, whose stdout the launcher reads), then calls the user's
``train_func(config)`` unchanged. Exit code 0 when the fit finished, 1 when it raised.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import inspect
import json
import math
import os
import shutil
import sys
import tempfile
from typing import Any

from trainguard._internal import envvars
from trainguard.raytrain import REPORT_PREFIX, format_worker_line, ray_train_defaults
from trainguard.raytrain.job import render_config

_SPEC_KEY = "__trainguard__"


def _import_func(target: str) -> Any:
    module_name, _, attr = target.partition(":")
    module = importlib.import_module(module_name)
    func = module
    for part in attr.split("."):
        func = getattr(func, part)
    return func


def _format(value: Any) -> str | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return repr(float(value)) if isinstance(value, float) and not math.isfinite(value) else str(value)


def _worker_entry(config: dict[str, Any]) -> Any:
    """Runs in every Ray Train worker: wrap ``ray.train.report``, then call the user's function."""
    import ray.train

    config = dict(config)
    spec = config.pop(_SPEC_KEY)
    context = ray.train.get_context()
    rank = context.get_world_rank()
    # node: a fault drill signals the pid only on its own machine (trainguard.raytrain.workers)
    node = ray.util.get_node_ip_address()
    node_id = ray.get_runtime_context().get_node_id()  # the nodes of one machine share the IP
    print(format_worker_line(rank, os.getpid(), node, node_id), file=sys.stderr, flush=True)
    from trainguard.launch.hook import mark_training_thread

    mark_training_thread()  # a drill's raise (crash_loop how: raise) lands in the train function
    if spec.get("run_hook"):
        _install_run_agent(spec["run_hook"], rank, context.get_world_size())
    original = ray.train.report
    step_key = spec["step_key"]
    counter = {"n": 0}
    from trainguard.raytrain.tracking import writer_from_env

    writer = writer_from_env(rank)  # the designated MLflow writer: world rank 0 only

    def report(metrics: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        result = original(metrics, *args, **kwargs)  # checkpoint first: "step N" means it exists
        counter["n"] += 1
        if rank == 0:
            step = metrics.get(step_key, counter["n"])
            fields = " ".join(
                f"{k}={text}" for k, v in metrics.items() if k != step_key and (text := _format(v)) is not None
            )
            print(f"{REPORT_PREFIX} step={int(step)} {fields}", flush=True)
            if writer is not None:
                writer.log(int(step), {k: v for k, v in metrics.items() if k != step_key})
        return result

    ray.train.report = report
    func = _import_func(spec["train_func"])
    takes_config = bool(inspect.signature(func).parameters)
    try:
        return func(config) if takes_config else func()
    finally:
        if writer is not None:
            writer.close()
        if spec.get("run_hook"):  # Ray ends the worker's process without its exit handlers
            from trainguard.launch.hook import flush_run_agent

            flush_run_agent()


def _install_run_agent(raw_spec: str, rank: int, world_size: int) -> None:
    """The run agent's step records in this worker (docs/step-records.md), under its world rank:
    Ray starts a worker's process before it has one, so the start-up hook cannot install it."""
    os.environ["RANK"], os.environ["WORLD_SIZE"] = str(rank), str(world_size)
    from trainguard.launch.hook import install_run_agent

    try:
        install_run_agent(raw_spec)
    except Exception as exc:  # the job goes on without step records: said on stderr
        print(f"trainguard run hook not installed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m trainguard.raytrain.driver")
    p.add_argument("--train-func", required=True)
    p.add_argument("--config", default="{}", help="train_loop_config as JSON")
    p.add_argument("--num-workers", type=int, default=1)
    p.add_argument("--use-gpu", action="store_true")
    p.add_argument("--resources-per-worker", default=None, help="JSON")
    p.add_argument("--storage-path", required=True)
    p.add_argument("--name", required=True)
    p.add_argument("--max-failures", type=int, default=0)
    p.add_argument("--step-key", default="step")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--run-dir", default="")
    p.add_argument("--batch-size", default="")
    p.add_argument("--resume", action="store_true", help="continue the run in --storage-path/--name")
    p.add_argument("--num-cpus", type=int, default=None, help="CPUs of the local Ray instance")
    args = p.parse_args(argv)

    # every report line matters: Ray's log deduplication would fold similar lines, and its
    # colour codes would wrap them
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    os.environ.setdefault("RAY_COLOR_PREFIX", "0")
    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    values: dict[str, str | int] = {
        "steps": args.steps, "seed": args.seed, "world_size": args.num_workers,
        "checkpoint_dir": args.storage_path, "run_dir": args.run_dir,
        "batch_size": int(args.batch_size) if args.batch_size.isdigit() else args.batch_size,
    }
    config = render_config(json.loads(args.config), values)
    experiment = os.path.join(os.path.abspath(args.storage_path), args.name)
    if not args.resume and os.path.isdir(experiment) and any(n.startswith("checkpoint_") for n in os.listdir(experiment)):
        # Ray Train would silently continue that run: a fresh run must start fresh
        print(f"trainguard: {experiment} already holds checkpoints of a run; pass --resume to continue "
              "it or use another --storage-path", file=sys.stderr, flush=True)
        return 2
    # the run agent's spec goes to the workers with their function, not in an environment the
    # driver's own processes or Ray's other workers would start with
    run_hook = os.environ.pop(envvars.WORKER_RUN_HOOK, None)
    config[_SPEC_KEY] = {"train_func": args.train_func, "step_key": args.step_key, "run_hook": run_hook}
    # the user's modules must be importable in the workers: the driver's cwd and PYTHONPATH
    entries = [os.getcwd(), *os.environ.get("PYTHONPATH", "").split(os.pathsep)]
    pythonpath = os.pathsep.join(dict.fromkeys(os.path.abspath(e) for e in entries if e))
    env_vars = {"PYTHONPATH": pythonpath, "PYTHONUNBUFFERED": "1"}
    for name in ("OMP_NUM_THREADS", envvars.FAULT_HOOK):
        if name in os.environ:
            env_vars[name] = os.environ[name]
    from trainguard.raytrain.tracking import worker_env

    env_vars.update(worker_env())  # the MLflow run id, store and run dir for the designated writer
    # the fault hook's "first process" mark belongs to this driver, not to the workers a private
    # Ray instance would start with this environment
    os.environ.pop(envvars.FAULT_HOOK_PID, None)
    temp_dir = None
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"], runtime_env={"env_vars": env_vars}, log_to_driver=True)
    else:
        # trainguard's own instance: Ray Train's pace for short fits unless the environment sets
        # it (its processes inherit this environment; Ray Train hands it to its controller)
        os.environ.update(ray_train_defaults(os.environ))
        # a private instance in a short private temp dir: a stale /tmp/ray session cannot interfere
        temp_dir = tempfile.mkdtemp(prefix="tgray-", dir="/tmp")
        ray.init(
            address="local", num_cpus=args.num_cpus or max(2, args.num_workers + 1),
            object_store_memory=128 * 1024 * 1024, include_dashboard=False, _temp_dir=temp_dir,
            runtime_env={"env_vars": env_vars}, log_to_driver=True,
        )
    try:
        trainer = TorchTrainer(
            _worker_entry,
            train_loop_config=config,
            scaling_config=ScalingConfig(
                num_workers=args.num_workers, use_gpu=args.use_gpu,
                resources_per_worker=json.loads(args.resources_per_worker) if args.resources_per_worker else None,
            ),
            run_config=RunConfig(
                name=args.name, storage_path=os.path.abspath(args.storage_path),
                failure_config=FailureConfig(max_failures=args.max_failures),
            ),
        )
        try:
            result = trainer.fit()
        except Exception as exc:  # Ray Train raises TrainingFailedError with the workers' errors
            print(f"trainguard: the Ray Train fit failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
            return 1
        if getattr(result, "error", None):
            print(f"trainguard: the Ray Train fit failed: {result.error}", file=sys.stderr, flush=True)
            return 1
        return 0
    finally:
        ray.shutdown()
        if temp_dir:
            shutil.rmtree(temp_dir, ignore_errors=True)


def _exit_now(code: int) -> None:
    """End the process without the interpreter's teardown of torch and Ray, which took 1.5-4 s
    after every fit on a busy machine (most of a fit's tail): the fit is over, Ray is shut down
    and the temp dir removed; only the output buffers are left to flush."""
    import logging

    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed or broken pipe: nothing reaches it
            stream.flush()
    os._exit(code)


if __name__ == "__main__":
    _exit_now(main())
