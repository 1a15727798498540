"""A job that calls a service each step: one HTTP GET to ``$TRAINGUARD_PROXY_ADDR`` (the network
drill's proxy in front of the service), then ``step N loss L`` (network drill tests).

``--timeout T`` bounds each request (a failed or timed-out request is reported on stderr and the
step goes on); ``--timeout 0`` waits for the answer forever -- the defect: a call in the
training loop without a timeout stalls training as long as the service does.

``--background`` sends the requests from a background thread (a tracking client's logger):
training never waits for them; at exit the job waits at most ``--flush-timeout`` seconds for the
queue to drain (0: until it drains -- the defect: a shutdown that blocks on the service).
"""

from __future__ import annotations

import argparse
import os
import queue
import sys
import threading
import time
import urllib.request


def call(url: str, timeout: float, step: int) -> None:
    try:
        with urllib.request.urlopen(url, timeout=timeout if timeout > 0 else None) as resp:
            resp.read()
    except OSError as exc:  # socket.timeout is an OSError
        print(f"http_job: step {step}: request failed: {exc}", file=sys.stderr, flush=True)


def sender(url: str, timeout: float, pending: queue.Queue[int | None]) -> None:
    while (step := pending.get()) is not None:
        call(url, timeout, step)
        pending.task_done()
    pending.task_done()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--sleep", type=float, default=0.05)
    parser.add_argument("--timeout", type=float, default=1.0, help="0: no timeout")
    parser.add_argument("--ckpt-dir", default=None)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--background", action="store_true")
    parser.add_argument("--flush-timeout", type=float, default=1.0, help="0: wait until drained")
    args = parser.parse_args()
    url = "http://" + os.environ["TRAINGUARD_PROXY_ADDR"] + "/"
    pending: queue.Queue[int | None] = queue.Queue()
    if args.background:
        threading.Thread(target=sender, args=(url, args.timeout, pending), daemon=True).start()
    for step in range(1, args.steps + 1):
        time.sleep(args.sleep)
        if args.background:
            pending.put(step)
        else:
            call(url, args.timeout, step)
        print(f"step {step} loss {1.0 / step:.6f}", flush=True)
    if args.background:
        pending.put(None)
        if args.flush_timeout > 0:
            deadline = time.monotonic() + args.flush_timeout
            while pending.unfinished_tasks and time.monotonic() < deadline:
                time.sleep(0.05)
            if pending.unfinished_tasks:
                print(f"http_job: gave up on {pending.unfinished_tasks} queued calls at exit",
                      file=sys.stderr, flush=True)
        else:
            pending.join()
    return 0


if __name__ == "__main__":
    sys.exit(main())
