"""The embedded Toxiproxy-compatible proxy (not a CI test): latency accuracy and throughput.

    .venv/bin/python tests/benchmarks/bench_toxiproxy.py [--pings 200] [--latency 50] [--mb 200]

* latency accuracy: round trips of 4 bytes to an echo server through the proxy, without a toxic
  and with a ``latency`` toxic (downstream); the toxic's error is (RTT with it) - (median RTT
  without it) - latency, per ping: median, p5/p95 and max of its absolute value. Goal: within
  +/- 2 ms at 50 ms.
* throughput: a source server streams ``--mb`` MB as fast as it can; the client reads it directly
  and through the proxy with no toxic, alternating, ``--repeats`` times; MB/s and the ratio.
* round trips per second without a toxic, direct vs through the proxy.

The proxy runs as ``trainguard toxiproxy-server --port 0`` in its own process (as a job's proxy
does: no GIL shared with the client and the servers, which run here).
"""

from __future__ import annotations

import argparse
import re
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from trainguard.faults.toxiproxy import ToxiproxyClient


def serve(handler: Callable[[socket.socket], None]) -> tuple[socket.socket, str]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)

    def accept() -> None:
        while True:
            try:
                conn, _ = sock.accept()
            except OSError:
                return
            threading.Thread(target=handler, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    return sock, f"127.0.0.1:{sock.getsockname()[1]}"


def echo(conn: socket.socket) -> None:
    with conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while data := conn.recv(65536):
            conn.sendall(data)


def delayed_echo(delay_s: float) -> Callable[[socket.socket], None]:
    """The noise floor: an echo that sleeps ``delay_s`` (time.sleep) before each answer."""

    def handle(conn: socket.socket) -> None:
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while data := conn.recv(65536):
                time.sleep(delay_s)
                conn.sendall(data)

    return handle


def source(total: int) -> Callable[[socket.socket], None]:
    block = memoryview(b"x" * (1 << 20))

    def send(conn: socket.socket) -> None:
        with conn:
            left = total
            while left > 0:
                n = min(left, len(block))
                conn.sendall(block[:n])
                left -= n

    return send


def addr(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)


def rtts(address: str, n: int) -> list[float]:
    with socket.create_connection(addr(address)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        out = []
        for _ in range(n):
            started = time.perf_counter()
            sock.sendall(b"ping")
            got = 0
            while got < 4:
                got += len(sock.recv(64))
            out.append((time.perf_counter() - started) * 1000)
        return out


def read_all(address: str) -> float:
    """MB/s reading a source to its end."""
    buf = bytearray(1 << 20)
    view = memoryview(buf)
    total = 0
    started = time.perf_counter()
    with socket.create_connection(addr(address)) as sock:
        while n := sock.recv_into(view):
            total += n
    return total / 1e6 / (time.perf_counter() - started)


@contextmanager
def standalone_server() -> Iterator[str]:
    proc = subprocess.Popen([sys.executable, "-m", "trainguard.cli", "toxiproxy-server", "--port", "0"],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if match := re.search(r"listening on (http://\S+)", line):
                yield match.group(1)
                break
        else:
            raise RuntimeError("trainguard toxiproxy-server did not start")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pings", type=int, default=200)
    parser.add_argument("--latency", type=int, default=50)
    parser.add_argument("--mb", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    echo_sock, echo_addr = serve(echo)
    control_sock, control_addr = serve(delayed_echo(args.latency / 1000))
    source_sock, source_addr = serve(source(args.mb * 1_000_000))
    with standalone_server() as url:
        client = ToxiproxyClient(url)
        echo_proxy = client.proxy_address(client.create_proxy("echo", echo_addr))
        source_proxy = client.proxy_address(client.create_proxy("source", source_addr))

        direct = rtts(echo_addr, args.pings)
        plain = rtts(echo_proxy, args.pings)
        client.add_toxic("echo", "latency", {"latency": args.latency})
        toxic = rtts(echo_proxy, args.pings)
        client.remove_toxic("echo", "latency_downstream")
        base = statistics.median(plain)
        errors = [t - base - args.latency for t in toxic]
        absolute = [abs(e) for e in errors]
        within = sum(a <= 2.0 for a in absolute) / len(absolute)
        print(f"round trip, median: direct {statistics.median(direct):.3f} ms, "
              f"proxied {base:.3f} ms ({1000 / statistics.median(direct):.0f} vs "
              f"{1000 / base:.0f} round trips/s)")
        print(f"latency {args.latency} ms toxic, {args.pings} pings: added delay median "
              f"{statistics.median(toxic) - base:.3f} ms; error median {statistics.median(errors):+.3f} ms, "
              f"p5 {pct(errors, 0.05):+.3f}, p95 {pct(errors, 0.95):+.3f}, max |error| "
              f"{max(absolute):.3f} ms; {within:.1%} within +/-2 ms")

        control = [t - statistics.median(direct) - args.latency for t in rtts(control_addr, args.pings)]
        print(f"control (no proxy: an echo sleeping {args.latency} ms): error median "
              f"{statistics.median(control):+.3f} ms, p95 {pct(control, 0.95):+.3f}, max "
              f"{max(abs(c) for c in control):.3f} ms; "
              f"{sum(abs(c) <= 2.0 for c in control) / len(control):.1%} within +/-2 ms")

        rates: dict[str, list[float]] = {"direct": [], "proxied": []}
        for i in range(args.repeats):
            order = ("direct", "proxied") if i % 2 == 0 else ("proxied", "direct")
            for which in order:
                rates[which].append(read_all(source_addr if which == "direct" else source_proxy))
        d, p = statistics.median(rates["direct"]), statistics.median(rates["proxied"])
        print(f"throughput, {args.mb} MB, no toxic: direct {[round(r) for r in rates['direct']]} MB/s, "
              f"proxied {[round(r) for r in rates['proxied']]} MB/s; medians {d:.0f} vs {p:.0f} MB/s "
              f"(proxied/direct {p / d:.2f})")
    echo_sock.close()
    control_sock.close()
    source_sock.close()


if __name__ == "__main__":
    main()
