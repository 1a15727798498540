"""A job that calls a service each step: one HTTP GET to ``$TRAINGUARD_PROXY_ADDR`` (the network
drill's proxy in front of the service), then ``step N loss L`` (network drill tests).

``--timeout T`` bounds each request (a failed or timed-out request is reported on stderr and the
step goes on); ``--timeout 0`` waits for the answer forever -- the defect: a call in the
training loop without a timeout stalls training as long as the service does.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import urllib.request


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--sleep", type=float, default=0.05)
    parser.add_argument("--timeout", type=float, default=1.0, help="0: no timeout")
    parser.add_argument("--ckpt-dir", default=None)
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args()
    url = "http://" + os.environ["TRAINGUARD_PROXY_ADDR"] + "/"
    for step in range(1, args.steps + 1):
        time.sleep(args.sleep)
        try:
            timeout = args.timeout if args.timeout > 0 else None
            with urllib.request.urlopen(url, timeout=timeout) as resp:
                resp.read()
        except OSError as exc:  # socket.timeout is an OSError
            print(f"http_job: step {step}: request failed: {exc}", file=sys.stderr, flush=True)
        print(f"step {step} loss {1.0 / step:.6f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
