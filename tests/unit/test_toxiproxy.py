"""The embedded Toxiproxy-compatible server: every endpoint with raw HTTP (status codes, error
bodies, JSON shapes as Toxiproxy's api.go), each toxic measured on real loopback sockets through
a small echo server, the unmodified ``toxiproxy-python`` client against it, trainguard's own
client, and the ``trainguard toxiproxy-server`` command.

Every server binds a free port on 127.0.0.1 (xdist-safe); timing bounds are wide (2 shared CPUs).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from trainguard._internal.signals import restore_default_signals
from trainguard.faults.toxiproxy import (
    API_VERSION,
    EmbeddedToxiproxy,
    ToxiproxyClient,
    ToxiproxyError,
    open_toxiproxy,
)

# --------------------------------------------------------------------------------------------
# Helpers: upstream servers, raw HTTP, sockets
# --------------------------------------------------------------------------------------------


class TcpServer:
    """A threaded TCP server on a free loopback port running ``handler(conn)`` per connection."""

    def __init__(self, handler: Callable[[socket.socket], None]) -> None:
        self.handler = handler
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.accepted = 0
        self._conns: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            self._conns.append(conn)
            threading.Thread(target=self._run, args=(conn,), daemon=True).start()

    def _run(self, conn: socket.socket) -> None:
        with contextlib.suppress(OSError), conn:
            self.handler(conn)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        for conn in self._conns:
            with contextlib.suppress(OSError):
                conn.close()
        self._thread.join(5)


def echo_handler(conn: socket.socket) -> None:
    while data := conn.recv(65536):
        conn.sendall(data)


def bye_handler(conn: socket.socket) -> None:
    conn.sendall(b"bye")
    conn.shutdown(socket.SHUT_WR)
    while conn.recv(65536):
        pass


@pytest.fixture
def echo() -> Iterator[TcpServer]:
    server = TcpServer(echo_handler)
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def tp() -> Iterator[EmbeddedToxiproxy]:
    with EmbeddedToxiproxy(seed=1) as server:
        yield server


def api(tp: EmbeddedToxiproxy, method: str, path: str, body: Any = None,
        headers: dict[str, str] | None = None, raw: bytes | None = None) -> tuple[int, Any, dict[str, str]]:
    """One raw HTTP request: (status, decoded JSON or text or None, headers)."""
    conn = http.client.HTTPConnection(tp.host, tp.port, timeout=10)
    try:
        data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        conn.request(method, path, body=data, headers=headers or {})
        resp = conn.getresponse()
        payload = resp.read()
        decoded: Any = None
        if payload:
            try:
                decoded = json.loads(payload)
            except ValueError:
                decoded = payload.decode()
        return resp.status, decoded, {k.lower(): v for k, v in resp.getheaders()}
    finally:
        conn.close()


def hostport(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host, int(port)


def make_proxy(tp: EmbeddedToxiproxy, upstream: str, name: str = "echo") -> tuple[str, int]:
    status, proxy, _ = api(tp, "POST", "/proxies", {"name": name, "upstream": upstream})
    assert status == 201, proxy
    return hostport(proxy["listen"])


def connect(address: tuple[str, int], timeout: float = 5.0) -> socket.socket:
    sock = socket.create_connection(address, timeout=timeout)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def rtt_ms(sock: socket.socket, payload: bytes = b"ping") -> float:
    started = time.perf_counter()
    sock.sendall(payload)
    got = b""
    while len(got) < len(payload):
        chunk = sock.recv(65536)
        assert chunk, "connection closed"
        got += chunk
    return (time.perf_counter() - started) * 1000


def median_rtt(sock: socket.socket, n: int = 5) -> float:
    return statistics.median(rtt_ms(sock) for _ in range(n))


def recv_all(sock: socket.socket, timeout: float = 5.0) -> bytes:
    sock.settimeout(timeout)
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def add_toxic(tp: EmbeddedToxiproxy, toxic: dict[str, Any], proxy: str = "echo") -> dict[str, Any]:
    status, answer, _ = api(tp, "POST", f"/proxies/{proxy}/toxics", toxic)
    assert status == 200, answer
    return answer


# --------------------------------------------------------------------------------------------
# The HTTP API, raw
# --------------------------------------------------------------------------------------------

PROXY_KEYS = {"name", "listen", "upstream", "enabled", "toxics"}
TOXIC_KEYS = {"attributes", "name", "type", "stream", "toxicity"}


def test_version_and_unknown_routes(tp: EmbeddedToxiproxy) -> None:
    status, body, headers = api(tp, "GET", "/version")
    assert status == 200 and body["version"] == API_VERSION and "trainguard" in body
    assert headers["content-type"].startswith("application/json")
    # every error is Toxiproxy's JSON error body (Toxiproxy's router answers these in plain text)
    status, body, _ = api(tp, "GET", "/nope")
    assert status == 404 and body == {"error": "404 page not found", "status": 404}
    status, body, headers = api(tp, "PUT", "/proxies")
    assert status == 405 and body["status"] == 405 and headers["allow"] == "GET, POST"
    status, _, _ = api(tp, "GET", "/reset")
    assert status == 405
    # Toxiproxy refuses browsers (a web page must not drive the proxies)
    status, body, _ = api(tp, "GET", "/proxies", headers={"User-Agent": "Mozilla/5.0"})
    assert status == 403 and body == {"error": "User agent not allowed", "status": 403}


def test_proxy_endpoints(tp: EmbeddedToxiproxy, echo: TcpServer) -> None:
    status, proxy, _ = api(tp, "POST", "/proxies", {"name": "echo", "upstream": echo.address})
    assert status == 201
    assert set(proxy) == PROXY_KEYS
    assert proxy["enabled"] is True and proxy["toxics"] == [] and proxy["upstream"] == echo.address
    host, port = hostport(proxy["listen"])
    assert host == "127.0.0.1" and port > 0  # the address bound, not 127.0.0.1:0

    status, body, _ = api(tp, "POST", "/proxies", {"name": "echo", "upstream": echo.address})
    assert (status, body) == (409, {"error": "proxy already exists", "status": 409})
    status, body, _ = api(tp, "POST", "/proxies", {"upstream": echo.address})
    assert (status, body) == (400, {"error": "missing required field: name", "status": 400})
    status, body, _ = api(tp, "POST", "/proxies", {"name": "x"})
    assert (status, body) == (400, {"error": "missing required field: upstream", "status": 400})
    status, body, _ = api(tp, "POST", "/proxies", raw=b"{not json")
    assert status == 400 and body["error"].startswith("bad request body") and body["status"] == 400
    status, body, _ = api(tp, "POST", "/proxies", {"name": "busy", "upstream": echo.address,
                                                   "listen": proxy["listen"]})
    assert status == 500 and "listen" in body["error"] and body["status"] == 500

    status, body, _ = api(tp, "GET", "/proxies")
    assert status == 200 and set(body) == {"echo"} and body["echo"] == proxy
    status, body, _ = api(tp, "GET", "/proxies/echo")
    assert status == 200 and body == proxy
    status, body, _ = api(tp, "GET", "/proxies/nope")
    assert (status, body) == (404, {"error": "proxy not found", "status": 404})

    # disable (PATCH) closes the listener; enable (deprecated POST) binds the same address again
    status, body, _ = api(tp, "PATCH", "/proxies/echo", {"enabled": False})
    assert status == 200 and body["enabled"] is False and body["listen"] == proxy["listen"]
    with pytest.raises(ConnectionRefusedError):
        connect((host, port))
    status, body, _ = api(tp, "POST", "/proxies/echo", {"enabled": True})
    assert status == 200 and body["enabled"] is True
    with connect((host, port)) as sock:
        assert rtt_ms(sock) < 1000

    # a new upstream restarts the proxy
    other = TcpServer(bye_handler)
    try:
        status, body, _ = api(tp, "PATCH", "/proxies/echo", {"upstream": other.address})
        assert status == 200 and body["upstream"] == other.address and body["enabled"] is True
        with connect(hostport(body["listen"])) as sock:
            assert recv_all(sock) == b"bye"
    finally:
        other.close()

    status, body, _ = api(tp, "DELETE", "/proxies/echo")
    assert status == 204 and body is None
    with pytest.raises(ConnectionRefusedError):
        connect((host, port))
    status, body, _ = api(tp, "DELETE", "/proxies/echo")
    assert (status, body) == (404, {"error": "proxy not found", "status": 404})


def test_toxic_endpoints(tp: EmbeddedToxiproxy, echo: TcpServer) -> None:
    make_proxy(tp, echo.address)
    status, toxic, _ = api(tp, "POST", "/proxies/echo/toxics",
                           {"type": "latency", "attributes": {"latency": 100}})
    assert status == 200
    assert toxic == {"attributes": {"latency": 100, "jitter": 0}, "name": "latency_downstream",
                     "type": "latency", "stream": "downstream", "toxicity": 1.0}
    status, body, _ = api(tp, "POST", "/proxies/echo/toxics", {"type": "latency"})
    assert (status, body) == (409, {"error": "toxic already exists", "status": 409})
    status, body, _ = api(tp, "POST", "/proxies/echo/toxics", {"type": "nope"})
    assert (status, body) == (400, {"error": "invalid toxic type", "status": 400})
    status, body, _ = api(tp, "POST", "/proxies/echo/toxics", {"type": "latency", "stream": "sideways"})
    assert status == 400 and body["error"] == "stream was invalid, can be either upstream or downstream"
    status, body, _ = api(tp, "POST", "/proxies/echo/toxics",
                          {"type": "bandwidth", "attributes": {"rate": "fast"}})
    assert status == 400 and body["error"].startswith("bad request body")
    status, body, _ = api(tp, "POST", "/proxies/nope/toxics", {"type": "latency"})
    assert (status, body) == (404, {"error": "proxy not found", "status": 404})

    status, up, _ = api(tp, "POST", "/proxies/echo/toxics",
                        {"name": "cut", "type": "limit_data", "stream": "upstream",
                         "toxicity": 0.5, "attributes": {"bytes": 10, "ignored": 1}})
    assert status == 200 and set(up) == TOXIC_KEYS
    assert up["attributes"] == {"bytes": 10} and up["stream"] == "upstream" and up["toxicity"] == 0.5

    status, body, _ = api(tp, "GET", "/proxies/echo/toxics")
    assert status == 200 and [t["name"] for t in body] == ["cut", "latency_downstream"]  # upstream first
    status, body, _ = api(tp, "GET", "/proxies/echo")
    assert [t["name"] for t in body["toxics"]] == ["cut", "latency_downstream"]
    status, body, _ = api(tp, "GET", "/proxies/echo/toxics/cut")
    assert status == 200 and body == up
    status, body, _ = api(tp, "GET", "/proxies/echo/toxics/nope")
    assert (status, body) == (404, {"error": "toxic not found", "status": 404})

    # update: only what is given changes (PATCH, and the deprecated POST)
    status, body, _ = api(tp, "PATCH", "/proxies/echo/toxics/latency_downstream",
                          {"attributes": {"jitter": 5}})
    assert status == 200 and body["attributes"] == {"latency": 100, "jitter": 5}
    status, body, _ = api(tp, "POST", "/proxies/echo/toxics/latency_downstream", {"toxicity": 0.25})
    assert status == 200 and body["toxicity"] == 0.25 and body["attributes"]["jitter"] == 5
    status, body, _ = api(tp, "PATCH", "/proxies/echo/toxics/nope", {"toxicity": 1})
    assert (status, body) == (404, {"error": "toxic not found", "status": 404})

    status, body, _ = api(tp, "DELETE", "/proxies/echo/toxics/cut")
    assert status == 204 and body is None
    status, body, _ = api(tp, "DELETE", "/proxies/echo/toxics/cut")
    assert (status, body) == (404, {"error": "toxic not found", "status": 404})


def test_populate_and_reset(tp: EmbeddedToxiproxy, echo: TcpServer) -> None:
    status, body, _ = api(tp, "POST", "/populate", [
        {"name": "a", "upstream": echo.address},
        {"name": "b", "upstream": echo.address, "enabled": False},
    ])
    assert status == 201 and set(body) == {"proxies"}
    a, b = body["proxies"]
    assert set(a) == PROXY_KEYS and a["enabled"] is True and b["enabled"] is False
    # same listen and upstream: the proxy is kept (open connections survive)
    with connect(hostport(a["listen"])) as sock:
        status, body, _ = api(tp, "POST", "/populate", [{"name": "a", "upstream": echo.address,
                                                         "listen": a["listen"]}])
        assert status == 201 and body["proxies"][0]["listen"] == a["listen"]
        assert rtt_ms(sock) < 1000
    status, body, _ = api(tp, "POST", "/populate", [{"name": "c"}])
    assert status == 400 and body["error"] == "missing required field: upstream at proxy 1"
    assert body["proxies"] is None
    status, body, _ = api(tp, "GET", "/proxies")
    assert set(body) == {"a", "b"}  # nothing applied from the rejected request

    add_toxic(tp, {"type": "latency", "attributes": {"latency": 1000}}, proxy="a")
    status, body, _ = api(tp, "POST", "/reset")
    assert status == 204 and body is None
    status, body, _ = api(tp, "GET", "/proxies")
    assert body["a"]["toxics"] == [] and body["b"]["enabled"] is True


def test_keep_alive_and_chunked_bodies(tp: EmbeddedToxiproxy, echo: TcpServer) -> None:
    conn = http.client.HTTPConnection(tp.host, tp.port, timeout=10)
    try:
        for _ in range(3):  # one connection, several requests (requests/urllib3 pools them)
            conn.request("GET", "/version")
            resp = conn.getresponse()
            assert resp.status == 200 and json.loads(resp.read())["version"]
        body = json.dumps({"name": "echo", "upstream": echo.address}).encode()
        conn.request("POST", "/proxies", body=iter([body[:7], body[7:]]),
                     headers={"Transfer-Encoding": "chunked"}, encode_chunked=True)
        resp = conn.getresponse()
        assert resp.status == 201 and json.loads(resp.read())["name"] == "echo"
    finally:
        conn.close()


# --------------------------------------------------------------------------------------------
# Toxics, measured on sockets
# --------------------------------------------------------------------------------------------


def test_latency_applies_to_open_connections_and_clears(tp: EmbeddedToxiproxy, echo: TcpServer) -> None:
    address = make_proxy(tp, echo.address)
    with connect(address) as sock:
        base = median_rtt(sock)
        add_toxic(tp, {"type": "latency", "attributes": {"latency": 100}})
        slow = median_rtt(sock)
        add_toxic(tp, {"type": "latency", "stream": "upstream", "attributes": {"latency": 50}})
        both = median_rtt(sock)
        api(tp, "DELETE", "/proxies/echo/toxics/latency_downstream")
        api(tp, "DELETE", "/proxies/echo/toxics/latency_upstream")
        after = median_rtt(sock)
    print(f"rtt base {base:.1f} ms, latency 100: {slow:.1f} ms, +50 upstream: {both:.1f} ms, "
          f"cleared: {after:.1f} ms")
    assert 98 <= slow <= base + 100 + 60
    assert 148 <= both <= base + 150 + 60
    assert after < 60


def test_toxic_update_applies_to_open_connections(tp: EmbeddedToxiproxy, echo: TcpServer) -> None:
    address = make_proxy(tp, echo.address)
    add_toxic(tp, {"type": "latency", "attributes": {"latency": 50}})
    with connect(address) as sock:
        first = median_rtt(sock, 3)
        status, _, _ = api(tp, "PATCH", "/proxies/echo/toxics/latency_downstream",
                           {"attributes": {"latency": 250}})
        assert status == 200
        second = median_rtt(sock, 3)
    assert 48 <= first < 200 and second >= 248, (first, second)


def test_latency_jitter_stays_in_its_band(tp: EmbeddedToxiproxy, echo: TcpServer) -> None:
    address = make_proxy(tp, echo.address)
    add_toxic(tp, {"type": "latency", "attributes": {"latency": 60, "jitter": 30}})
    with connect(address) as sock:
        samples = [rtt_ms(sock) for _ in range(12)]
    assert min(samples) >= 29 and max(samples) <= 90 + 100
    assert max(samples) - min(samples) > 5  # it does vary


def test_toxicity_is_rolled_per_connection(tp: EmbeddedToxiproxy, echo: TcpServer) -> None:
    address = make_proxy(tp, echo.address)
    add_toxic(tp, {"type": "latency", "toxicity": 0.0, "attributes": {"latency": 300}})
    with connect(address) as sock:
        assert median_rtt(sock, 3) < 200
    api(tp, "PATCH", "/proxies/echo/toxics/latency_downstream", {"toxicity": 0.5})
    slow = 0
    for _ in range(16):
        with connect(address) as sock:
            slow += rtt_ms(sock) >= 290
    assert 2 <= slow <= 14, slow  # binomial(16, 0.5): outside this band has p < 0.005


def test_bandwidth_limits_the_rate(tp: EmbeddedToxiproxy, echo: TcpServer) -> None:
    address = make_proxy(tp, echo.address)
    payload = b"x" * 60_000
    with connect(address) as sock:
        fast = rtt_ms(sock, payload)
        add_toxic(tp, {"type": "bandwidth", "attributes": {"rate": 100}})  # 100 KB/s
        limited = rtt_ms(sock, payload)
    print(f"60 kB echo: {fast:.0f} ms free, {limited:.0f} ms at 100 KB/s")
    assert fast < 300
    assert 500 <= limited <= 2000  # 0.6 s at 100 KB/s


def test_slow_close_delays_the_fin(tp: EmbeddedToxiproxy) -> None:
    bye = TcpServer(bye_handler)
    try:
        address = make_proxy(tp, bye.address)
        with connect(address) as sock:
            assert recv_all(sock) == b"bye"
        add_toxic(tp, {"type": "slow_close", "attributes": {"delay": 400}})
        with connect(address) as sock:
            sock.settimeout(5)
            assert sock.recv(10) == b"bye"
            started = time.monotonic()
            assert sock.recv(10) == b""
            waited = time.monotonic() - started
        assert 0.35 <= waited <= 2.0
    finally:
        bye.close()


def test_timeout_zero_holds_the_connection_and_removal_closes_it(tp: EmbeddedToxiproxy, echo: TcpServer) -> None:
    address = make_proxy(tp, echo.address)
    with connect(address) as sock:
        assert rtt_ms(sock) < 1000
        add_toxic(tp, {"type": "timeout", "attributes": {"timeout": 0}})
        sock.sendall(b"ping")
        sock.settimeout(1.0)
        with pytest.raises(TimeoutError):  # held: no data, no close
            sock.recv(10)
        status, _, _ = api(tp, "DELETE", "/proxies/echo/toxics/timeout_downstream")
        assert status == 204
        sock.settimeout(3.0)
        assert sock.recv(10) == b""  # as Toxiproxy: removing a timeout toxic closes its connections
    with connect(address) as sock:
        assert rtt_ms(sock) < 1000  # new connections pass again


def test_timeout_closes_after_its_delay(tp: EmbeddedToxiproxy, echo: TcpServer) -> None:
    address = make_proxy(tp, echo.address)
    add_toxic(tp, {"type": "timeout", "attributes": {"timeout": 300}})
    with connect(address) as sock:
        started = time.monotonic()
        sock.sendall(b"dropped")
        assert recv_all(sock) == b""  # the data was dropped, then the connection closed
        assert 0.25 <= time.monotonic() - started <= 2.0


def test_reset_peer_sends_rst(tp: EmbeddedToxiproxy, echo: TcpServer) -> None:
    address = make_proxy(tp, echo.address)
    add_toxic(tp, {"type": "reset_peer", "attributes": {"timeout": 0}})
    with connect(address) as sock:
        sock.sendall(b"ping")
        sock.settimeout(5)
        with pytest.raises(ConnectionResetError):
            sock.recv(10)


def test_limit_data_closes_after_n_bytes(tp: EmbeddedToxiproxy, echo: TcpServer) -> None:
    address = make_proxy(tp, echo.address)
    add_toxic(tp, {"type": "limit_data", "attributes": {"bytes": 10}})
    with connect(address) as sock:
        sock.sendall(b"0123456789abcdefghijklmno")
        assert recv_all(sock) == b"0123456789"


def test_slicer_cuts_and_spaces_the_data(tp: EmbeddedToxiproxy, echo: TcpServer) -> None:
    address = make_proxy(tp, echo.address)
    add_toxic(tp, {"type": "slicer",
                   "attributes": {"average_size": 10, "size_variation": 0, "delay": 30_000}})
    payload = bytes(range(65, 65 + 50))
    with connect(address) as sock:
        sock.settimeout(5)
        started = time.monotonic()
        sock.sendall(payload)
        pieces = []
        while sum(map(len, pieces)) < len(payload):
            pieces.append(sock.recv(65536))
        elapsed = time.monotonic() - started
    assert b"".join(pieces) == payload
    assert len(pieces) >= 3, pieces  # 5-6 slices 30 ms apart; a loaded machine may merge a few
    assert all(len(p) <= 20 for p in pieces[:-1]) or len(pieces) >= 4
    assert elapsed >= 0.1


def test_disabling_closes_open_connections(tp: EmbeddedToxiproxy, echo: TcpServer) -> None:
    address = make_proxy(tp, echo.address)
    with connect(address) as sock:
        assert rtt_ms(sock) < 1000
        api(tp, "PATCH", "/proxies/echo", {"enabled": False})
        sock.settimeout(3)
        with contextlib.suppress(ConnectionResetError):
            assert sock.recv(10) == b""
    with pytest.raises(ConnectionRefusedError):
        connect(address)
    api(tp, "PATCH", "/proxies/echo", {"enabled": True})
    with connect(address) as sock:
        assert rtt_ms(sock) < 1000


def test_unreachable_upstream_closes_the_client(tp: EmbeddedToxiproxy) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{probe.getsockname()[1]}"  # bound, never listening
    address = make_proxy(tp, dead)
    with connect(address) as sock:
        sock.settimeout(5)
        with contextlib.suppress(ConnectionResetError):
            assert sock.recv(10) == b""


def test_stop_closes_everything(echo: TcpServer) -> None:
    server = EmbeddedToxiproxy().start()
    address = make_proxy(server, echo.address)
    sock = connect(address)
    try:
        assert rtt_ms(sock) < 1000
        server.stop()
        sock.settimeout(3)
        with contextlib.suppress(ConnectionResetError):
            assert sock.recv(10) == b""
        for port in (address[1], server.port):
            with pytest.raises(ConnectionRefusedError):
                connect(("127.0.0.1", port))
        server.stop()  # idempotent
    finally:
        sock.close()


# --------------------------------------------------------------------------------------------
# The unmodified toxiproxy-python client (0.1.1)
# --------------------------------------------------------------------------------------------


@pytest.fixture
def pyclient(tp: EmbeddedToxiproxy, monkeypatch: pytest.MonkeyPatch) -> Any:
    toxiproxy = pytest.importorskip("toxiproxy")
    from toxiproxy.api import APIConsumer

    # the client keeps the server address as class attributes: point them at this test's server
    monkeypatch.setattr(APIConsumer, "host", tp.host)
    monkeypatch.setattr(APIConsumer, "port", tp.port)
    return toxiproxy.Toxiproxy()


def test_toxiproxy_python_client_drives_the_embedded_server(pyclient: Any, echo: TcpServer) -> None:
    from toxiproxy.exceptions import NotFound, ProxyExists

    assert pyclient.running()
    assert b"version" in pyclient.version()
    proxy = pyclient.create(upstream=echo.address, name="echo")
    assert proxy.enabled is True and proxy.listen.startswith("127.0.0.1:")
    with pytest.raises(ProxyExists):
        pyclient.create(upstream=echo.address, name="echo")
    assert set(pyclient.proxies()) == {"echo"}
    address = hostport(proxy.listen)

    with connect(address) as sock:
        base = median_rtt(sock, 3)
        proxy.add_toxic(type="latency", attributes={"latency": 150})
        assert set(proxy.toxics()) == {"latency_downstream"}
        toxic = proxy.get_toxic("latency_downstream")
        assert toxic.attributes == {"latency": 150, "jitter": 0} and toxic.toxicity == 1.0
        assert median_rtt(sock, 3) >= 148
        assert proxy.destroy_toxic("latency_downstream")
        assert median_rtt(sock, 3) < base + 60
    with pytest.raises(NotFound):
        proxy.destroy_toxic("latency_downstream")

    with proxy.down(), pytest.raises(ConnectionRefusedError):
        connect(address)
    with connect(address) as sock:
        assert rtt_ms(sock) < 1000

    proxy.add_toxic(type="timeout", stream="upstream", attributes={"timeout": 0})
    assert pyclient.reset()
    assert proxy.toxics() == {}
    populated = pyclient.populate([{"name": "second", "upstream": echo.address, "listen": "127.0.0.1:0"}])
    assert [p.name for p in populated] == ["second"]
    pyclient.destroy_all()
    assert pyclient.proxies() == {}


# --------------------------------------------------------------------------------------------
# trainguard's client
# --------------------------------------------------------------------------------------------


def test_trainguard_client(tp: EmbeddedToxiproxy, echo: TcpServer) -> None:
    client = ToxiproxyClient(tp.url, timeout=5)
    assert client.embedded
    proxy = client.create_proxy("echo", echo.address)
    assert client.proxy_address(proxy) == proxy["listen"]
    toxic = client.add_toxic("echo", "latency", {"latency": 80}, stream="upstream")
    assert toxic["name"] == "latency_upstream"
    updated = client.update_toxic("echo", "latency_upstream", {"jitter": 10}, toxicity=0.5)
    assert updated["attributes"] == {"latency": 80, "jitter": 10} and updated["toxicity"] == 0.5
    assert client.toxics("echo") == [updated]
    client.remove_toxic("echo", "latency_upstream")
    with pytest.raises(ToxiproxyError, match=r"404: toxic not found") as info:
        client.remove_toxic("echo", "latency_upstream")
    assert info.value.status == 404
    with pytest.raises(ToxiproxyError, match="400: invalid toxic type"):
        client.add_toxic("echo", "gremlins")
    # a 500 (toxiproxy-python raises KeyError on it) is an error with the server's message
    with pytest.raises(ToxiproxyError, match=r"500: listen tcp .*") as info:
        client.create_proxy("twin", echo.address, listen=proxy["listen"])
    assert info.value.status == 500
    assert client.set_enabled("echo", False)["enabled"] is False
    client.reset()
    assert client.get_proxy("echo")["enabled"] is True
    client.delete_proxy("echo")
    assert client.proxies() == {}


def test_trainguard_client_errors_are_clear() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(ToxiproxyError, match="cannot reach Toxiproxy"):
        ToxiproxyClient(f"http://127.0.0.1:{port}", timeout=2).proxies()
    with pytest.raises(ToxiproxyError, match="not an http"):
        ToxiproxyClient("ftp://example")
    # a server that accepts and never answers: the timeout fires
    silent = TcpServer(lambda conn: time.sleep(3))
    try:
        started = time.monotonic()
        with pytest.raises(ToxiproxyError, match=r"no answer within 0\.5 s"):
            ToxiproxyClient(f"http://{silent.address}", timeout=0.5).version()
        assert time.monotonic() - started < 2.5
    finally:
        silent.close()


def test_open_toxiproxy_embedded_or_from_env(monkeypatch: pytest.MonkeyPatch, tp: EmbeddedToxiproxy) -> None:
    monkeypatch.delenv("TOXIPROXY_URL", raising=False)
    with open_toxiproxy() as client:
        assert client.started_here and client.embedded
        port = client.port
    with pytest.raises(ConnectionRefusedError):
        connect(("127.0.0.1", port))  # stopped on exit
    monkeypatch.setenv("TOXIPROXY_URL", tp.url)
    with open_toxiproxy() as client:
        assert not client.started_here and client.url == tp.url
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        dead = probe.getsockname()[1]
    monkeypatch.setenv("TOXIPROXY_URL", f"http://127.0.0.1:{dead}")
    with pytest.raises(ToxiproxyError, match=r"TOXIPROXY_URL=.* does not answer"), open_toxiproxy():
        pass


# --------------------------------------------------------------------------------------------
# trainguard toxiproxy-server
# --------------------------------------------------------------------------------------------


def test_cli_defaults_match_toxiproxy() -> None:
    from trainguard.cli import build_parser

    args = build_parser().parse_args(["toxiproxy-server"])
    assert (args.host, args.port) == ("127.0.0.1", 8474)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_cli_server_starts_serves_and_stops(sig: int, echo: TcpServer, tmp_path: Any) -> None:
    config = tmp_path / "proxies.json"
    config.write_text(json.dumps([{"name": "echo", "upstream": echo.address}]))
    proc = subprocess.Popen(
        [sys.executable, "-m", "trainguard.cli", "toxiproxy-server", "--port", "0",
         "--config", str(config)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        preexec_fn=restore_default_signals,  # Ctrl-C's own state, whatever pytest has
    )
    try:
        assert proc.stdout is not None
        url = None
        deadline = time.monotonic() + 60
        lines = []
        while url is None and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if match := re.search(r"listening on (http://\S+)", line):
                url = match.group(1)
        assert url, "".join(lines)
        client = ToxiproxyClient(url, timeout=5)
        proxy = client.get_proxy("echo")
        address = hostport(proxy["listen"])
        sock = connect(address)
        assert rtt_ms(sock) < 1000
        proc.send_signal(sig)
        out, _ = proc.communicate(timeout=20)
        sock.close()
        assert proc.returncode == 0, out
        assert "stopped" in out
        api_port = hostport(url.split("//")[1])[1]
        for port in (api_port, address[1]):
            with pytest.raises(ConnectionRefusedError):
                connect(("127.0.0.1", port))
            with socket.socket() as rebind:  # the ports are free again
                rebind.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                rebind.bind(("127.0.0.1", port))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_cli_server_bad_config_is_a_usage_error(tmp_path: Any) -> None:
    config = tmp_path / "proxies.json"
    config.write_text('{"name": "not a list"}')
    proc = subprocess.run(
        [sys.executable, "-m", "trainguard.cli", "toxiproxy-server", "--port", "0", "--config", str(config)],
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 2
    assert "proxies.json: expected a JSON list of proxies" in proc.stderr and "Traceback" not in proc.stderr


def test_cli_server_port_in_use_is_a_clear_error(tp: EmbeddedToxiproxy) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "trainguard.cli", "toxiproxy-server", "--port", str(tp.port)],
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 1
    assert "cannot listen on 127.0.0.1" in proc.stderr and "--port" in proc.stderr
