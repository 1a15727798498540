"""``trainguard toxiproxy-server``: the embedded Toxiproxy-compatible server, standalone.

A drop-in for ``toxiproxy-server`` in users' own tests: same defaults (127.0.0.1:8474), same API,
``--config FILE`` populates proxies at start (as ``toxiproxy-server -config``). Ctrl-C or SIGTERM
stops it and every proxy and connection it holds.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
from pathlib import Path
from typing import Any

from trainguard.errors import ConfigError
from trainguard.faults.toxiproxy.server import DEFAULT_HOST, DEFAULT_PORT, EmbeddedToxiproxy

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> None:
    """Add the ``toxiproxy-server`` subcommand to the ``trainguard`` command's subparsers."""
    parser = sub.add_parser(
        "toxiproxy-server",
        help="run trainguard's Toxiproxy-compatible proxy server",
        description="Run the Toxiproxy-compatible TCP proxy server (the HTTP API of Toxiproxy "
        "2.x) until Ctrl-C or SIGTERM. See docs/faults-network.md.",
    )
    parser.add_argument("--host", default=DEFAULT_HOST,
                        help=f"address the API binds (default: {DEFAULT_HOST}: this machine only)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT,
                        help=f"port of the API (default: {DEFAULT_PORT}; 0: any free port)")
    parser.add_argument("--config", metavar="FILE",
                        help="JSON file with a list of proxies to create at start (as /populate)")
    parser.add_argument("--seed", type=int, help="seed of the toxicity rolls (default: random)")


def run(args: argparse.Namespace) -> int:
    """Serve until interrupted; 0 after a clean stop, 1 when the address cannot be bound."""
    proxies: list[dict[str, Any]] | None = None
    if args.config:
        try:
            proxies = json.loads(Path(args.config).read_text())
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cannot read it as JSON: {exc}", path=args.config) from None
        if not isinstance(proxies, list):
            raise ConfigError("expected a JSON list of proxies, e.g. "
                              '[{"name": "redis", "listen": "127.0.0.1:26379", '
                              '"upstream": "127.0.0.1:6379"}]', path=args.config)
    server = EmbeddedToxiproxy(args.host, args.port, seed=args.seed)
    try:
        server.start()
    except OSError as exc:
        print(f"trainguard: error: cannot listen on {args.host}:{args.port}: {exc.strerror or exc}; "
              "pass another --port (0 picks a free one)", file=sys.stderr)
        return 1
    try:
        if proxies is not None:
            from trainguard.faults.toxiproxy.client import ToxiproxyClient

            created = ToxiproxyClient(server.url).populate(proxies)
            print(f"populated {len(created)} proxies from {args.config}", flush=True)
        print(f"Toxiproxy-compatible API listening on {server.url} (Ctrl-C stops it)", flush=True)
        threading.Event().wait()  # until KeyboardInterrupt (SIGTERM is mapped to it by the CLI)
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
    print("stopped: every proxy and connection closed", flush=True)
    return 0
