"""``trainguard toxiproxy-server``: the embedded Toxiproxy-compatible server, standalone.

A drop-in for ``toxiproxy-server`` in users' own tests: same defaults (127.0.0.1:8474), same API,
``--config FILE`` populates proxies at start (as ``toxiproxy-server -config``). Ctrl-C or SIGTERM
stops it and every proxy and connection it holds. Proxies listen on loopback addresses only
unless ``--allow-remote-listen``.
"""

from __future__ import annotations

import argparse
import difflib
import errno
import socket
import sys
import threading
from pathlib import Path
from typing import Any

from trainguard.errors import ConfigError
from trainguard.faults.toxiproxy.addresses import (
    DEFAULT_HOST,
    DEFAULT_PORT,
    RESOLVE_TIMEOUT_S,
    AddressError,
)
from trainguard.faults.toxiproxy.httpio import loads_strict
from trainguard.faults.toxiproxy.server import EmbeddedToxiproxy
from trainguard.faults.toxiproxy.toxics import ApiError, brief

__all__ = ["add_parser", "run"]

#: the keys of one proxy in a ``--config`` file, and their JSON types
CONFIG_KEYS: dict[str, tuple[type, str]] = {
    "name": (str, "a string"),
    "upstream": (str, 'a "host:port" string'),
    "listen": (str, 'a "host:port" string'),
    "enabled": (bool, "true or false"),
}
MAX_CONFIG_BYTES = 16 << 20
_EXAMPLE = '[{"name": "redis", "listen": "127.0.0.1:26379", "upstream": "127.0.0.1:6379"}]'


def _port(text: str) -> int:
    digits = text.strip()
    if not digits.isascii() or not digits.isdigit() or len(digits) > 5 or int(digits) > 65535:
        raise argparse.ArgumentTypeError(
            f"expected a port number from 0 to 65535 (0: any free port), got {brief(text)}")
    return int(digits)


def _host(text: str) -> str:
    if not text or "\0" in text:
        raise argparse.ArgumentTypeError(f"expected an address of this machine, e.g. "
                                         f"{DEFAULT_HOST}, got {brief(text)}")
    outcome: list[str | None] = []

    def lookup() -> None:
        try:
            socket.getaddrinfo(text, None, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
            outcome.append(None)
        except (OSError, ValueError) as exc:  # gaierror, an IDNA label too long
            outcome.append(exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc))

    thread = threading.Thread(target=lookup, name="trainguard-resolve", daemon=True)
    thread.start()
    thread.join(RESOLVE_TIMEOUT_S)  # a resolver that does not answer is not waited for
    reason = outcome[0] if outcome else f"no answer within {RESOLVE_TIMEOUT_S:g} s"
    if reason is not None:
        raise argparse.ArgumentTypeError(
            f"{brief(text)} does not resolve ({reason}); give an address of this machine, "
            f"e.g. {DEFAULT_HOST} (this machine only) or 0.0.0.0 (every interface)")
    return text


def add_parser(sub: Any) -> None:
    """Add the ``toxiproxy-server`` subcommand to the ``trainguard`` command's subparsers."""
    parser = sub.add_parser(
        "toxiproxy-server",
        help="run trainguard's Toxiproxy-compatible proxy server",
        description="Run the Toxiproxy-compatible TCP proxy server (the HTTP API of Toxiproxy "
        "2.x) until Ctrl-C or SIGTERM. See docs/faults-network.md.",
    )
    parser.add_argument("--host", type=_host, default=DEFAULT_HOST,
                        help=f"address the API binds (default: {DEFAULT_HOST}: this machine only)")
    parser.add_argument("--port", type=_port, default=DEFAULT_PORT,
                        help=f"port of the API, 0 to 65535 (default: {DEFAULT_PORT}; 0: any free port)")
    parser.add_argument("--config", metavar="FILE",
                        help="JSON file with a list of proxies to create at start (as /populate)")
    parser.add_argument("--seed", type=int, help="seed of the toxicity rolls (default: random)")
    parser.add_argument("--allow-remote-listen", action="store_true",
                        help="let proxies listen on non-loopback addresses (0.0.0.0, a LAN "
                        "address), for clients on other hosts; the API has no authentication, "
                        "so by default a proxy may only listen on loopback")


def load_config(path: str) -> list[dict[str, Any]]:
    """The proxies of a ``--config`` file, each checked: ConfigError naming the file, the entry
    and the key otherwise."""
    try:
        with Path(path).open("rb") as file:
            raw = file.read(MAX_CONFIG_BYTES + 1)
        if len(raw) > MAX_CONFIG_BYTES:
            raise ConfigError(f"over {MAX_CONFIG_BYTES // (1 << 20)} MiB: not a list of proxies",
                              path=path)
        data = loads_strict(raw)
    except OSError as exc:
        raise ConfigError(f"cannot read it: {exc.strerror or exc}", path=path) from None
    except ValueError as exc:
        raise ConfigError(f"not valid JSON: {str(exc)[:200]}; expected a list of "
                          f"proxies, e.g. {_EXAMPLE}", path=path) from None
    if not isinstance(data, list):
        raise ConfigError(f"expected a JSON list of proxies, e.g. {_EXAMPLE}", path=path)
    for i, item in enumerate(data, start=1):
        where = f"entry {i}"
        if not isinstance(item, dict):
            raise ConfigError(f"expected a JSON object with name, upstream and optional listen "
                              f"and enabled, got {brief(item)}", path=path, key=where)
        if isinstance(item.get("name"), str) and item["name"]:
            where = f"entry {i} ({brief(item['name'])})"
        for key in item:
            if key not in CONFIG_KEYS:
                close = difflib.get_close_matches(str(key), CONFIG_KEYS, n=1)
                hint = f"did you mean {close[0]!r}? " if close else ""
                raise ConfigError(f"unknown key {brief(key)}; {hint}a proxy has "
                                  f"{', '.join(CONFIG_KEYS)}", path=path, key=where)
        for key in ("name", "upstream"):
            if key not in item or item[key] == "":
                raise ConfigError(f"missing {key!r}; e.g. {_EXAMPLE}", path=path, key=where)
        for key, (kind, what) in CONFIG_KEYS.items():
            if key in item and not isinstance(item[key], kind):
                raise ConfigError(f"expected {what}, got {brief(item[key])}", path=path,
                                  key=f"{where}: {key}")
    return data


def run(args: argparse.Namespace) -> int:
    """Serve until interrupted; 0 after a clean stop, 1 when the port cannot be bound, 2 for a
    bad ``--host`` or ``--config``."""
    proxies = load_config(args.config) if args.config else None
    server = EmbeddedToxiproxy(args.host, args.port, seed=args.seed,
                               allow_remote_listen=args.allow_remote_listen)
    try:
        server.start()
    except (OSError, AddressError) as exc:
        if isinstance(exc, OSError) and exc.errno == errno.EADDRNOTAVAIL:
            print(f"trainguard: error: argument --host: {args.host} is not an address of this "
                  f"machine; give one of its addresses, e.g. {DEFAULT_HOST}", file=sys.stderr)
            return 2
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        print(f"trainguard: error: cannot listen on {args.host}:{args.port}: {reason}; "
              "pass another --port (0 picks a free one)", file=sys.stderr)
        return 1
    try:
        if proxies is not None:
            created = _populate(server, proxies, args.config)
            print(f"populated {len(created)} proxies from {args.config}", flush=True)
        print(f"Toxiproxy-compatible API listening on {server.url} (Ctrl-C stops it)", flush=True)
        threading.Event().wait()  # until KeyboardInterrupt (SIGTERM is mapped to it by the CLI)
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
    print("stopped: every proxy and connection closed", flush=True)
    return 0


def _populate(server: EmbeddedToxiproxy, proxies: list[dict[str, Any]], path: str) -> list[Any]:
    try:
        return list(server.call(lambda: server.server.populate_proxies(proxies), timeout=60.0))
    except ApiError as exc:
        where = f"entry {exc.index}" if exc.index else None
        if exc.index and isinstance(proxies[exc.index - 1].get("name"), str):
            where = f"entry {exc.index} ({brief(proxies[exc.index - 1]['name'])})"
        if where and exc.field:
            where = f"{where}: {exc.field}"
        raise ConfigError(exc.message, path=path, key=where) from None
