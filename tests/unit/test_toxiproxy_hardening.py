"""The embedded Toxiproxy under bad input (issue 13): loopback-only proxies by default, every
malformed request answered with a 4xx and Toxiproxy's ``{"error", "status"}`` body within fixed
limits (the server keeps serving), and ``trainguard toxiproxy-server`` usage errors (exit 2).

Each reproducer from the issue is sent on a raw loopback socket; the generated requests are in
test_toxiproxy_fuzz.py.
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trainguard.cli.main import main as cli_main
from trainguard.faults.toxiproxy import (
    TOXIC_ATTRIBUTES,
    EmbeddedToxiproxy,
    ToxiproxyClient,
    ToxiproxyError,
    httpio,
)

# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------


@pytest.fixture
def tp() -> Iterator[EmbeddedToxiproxy]:
    with EmbeddedToxiproxy(seed=1) as server:
        yield server


@pytest.fixture
def upstream() -> Iterator[str]:
    """A listening loopback socket (never accepted: these tests only create proxies)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(1)
        yield f"127.0.0.1:{sock.getsockname()[1]}"


def exchange(port: int, data: bytes, *, timeout: float = 10.0) -> bytes:
    """Send ``data``, close our side, and read everything the server answers."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(data)
        sock.shutdown(socket.SHUT_WR)
        return read_to_eof(sock)


def read_to_eof(sock: socket.socket) -> bytes:
    out = b""
    with contextlib.suppress(ConnectionResetError):
        while chunk := sock.recv(65536):
            out += chunk
    return out


def strict_json(data: bytes) -> Any:
    def refuse(name: str) -> Any:
        raise AssertionError(f"{name} in a response: not JSON")

    return json.loads(data, parse_constant=refuse)


def parse_all(raw: bytes) -> list[tuple[int, dict[str, str], Any]]:
    """Every response in ``raw``, in order: (status, headers, strict-JSON body or None); an
    AssertionError for anything that is not a well-formed HTTP/1.1 response."""
    responses = []
    while raw:
        head, sep, rest = raw.partition(b"\r\n\r\n")
        assert sep, f"an incomplete response: {raw[:200]!r}"
        lines = head.decode("latin-1").split("\r\n")
        match = re.fullmatch(r"HTTP/1\.1 (\d{3}) [A-Za-z -]+", lines[0])
        assert match, lines[0]
        headers = {}
        for line in lines[1:]:
            name, colon, value = line.partition(":")
            assert colon and name.strip() == name, line
            headers[name.lower()] = value.strip()
        status = int(match.group(1))
        length = 0 if status in (100, 204) else int(headers["content-length"])
        body, raw = rest[:length], rest[length:]
        assert len(body) == length, (length, body[:200])
        if status >= 400 or body:
            assert headers["content-type"] == "application/json", headers
        responses.append((status, headers, strict_json(body) if body else None))
    return responses


def parse_one(raw: bytes) -> tuple[int, dict[str, str], Any]:
    """The only response in ``raw``."""
    responses = parse_all(raw)
    assert len(responses) == 1, responses
    return responses[0]


def request(method: str, path: str, body: Any = None, *, raw_body: bytes | None = None) -> bytes:
    data = raw_body if raw_body is not None else (b"" if body is None else json.dumps(body).encode())
    return (f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(data)}\r\n\r\n"
            .encode() + data)


def assert_error(raw: bytes, status: int, *words: str, populate: bool = False) -> str:
    got, headers, body = parse_one(raw)
    assert got == status, raw[:300]
    assert headers["content-type"] == "application/json"
    keys = {"error", "status", "proxies"} if populate else {"error", "status"}  # as Toxiproxy's
    assert set(body) == keys and body["status"] == status, body
    for word in words:
        assert word in body["error"], body
    return str(body["error"])


def assert_serving(tp: EmbeddedToxiproxy) -> None:
    status, _, body = parse_one(exchange(tp.port, b"GET /version HTTP/1.1\r\n\r\n"))
    assert status == 200 and body["version"]


def non_loopback_address() -> str | None:
    """An address of this machine that is not loopback (the route to a documentation address),
    or None on a machine with no such interface."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))  # UDP: nothing is sent
        except OSError:
            return None
        address = str(probe.getsockname()[0])
    return None if address.startswith("127.") or address == "0.0.0.0" else address


# --------------------------------------------------------------------------------------------
# Loopback by default
# --------------------------------------------------------------------------------------------


def test_non_loopback_listen_is_refused_unless_allowed(tp: EmbeddedToxiproxy, upstream: str) -> None:
    wanted = ["0.0.0.0:0", "[::]:0"]
    lan = non_loopback_address()
    if lan:
        wanted.append(f"{lan}:0")
    for i, listen in enumerate(wanted):
        body = {"name": f"p{i}", "upstream": upstream, "listen": listen}
        message = assert_error(exchange(tp.port, request("POST", "/proxies", body)), 400,
                               "not a loopback address", "--allow-remote-listen")
        assert listen.split(":")[0].strip("[]") in message
        # /populate and an update are held to the same rule; nothing was created or changed
        assert_error(exchange(tp.port, request("POST", "/populate", [body])), 400,
                     "--allow-remote-listen", populate=True)
    status, _, proxy = parse_one(exchange(tp.port, request("POST", "/proxies", {
        "name": "local", "upstream": upstream, "listen": "localhost:0"})))
    assert status == 201 and proxy["listen"].startswith("127.0.0.1:")
    assert_error(exchange(tp.port, request("PATCH", "/proxies/local", {"listen": "0.0.0.0:0"})),
                 400, "--allow-remote-listen")
    status, _, proxies = parse_one(exchange(tp.port, b"GET /proxies HTTP/1.1\r\n\r\n"))
    assert list(proxies) == ["local"] and proxies["local"]["listen"] == proxy["listen"]
    assert proxies["local"]["enabled"] is True


def test_allow_remote_listen_binds_every_interface(upstream: str) -> None:
    with EmbeddedToxiproxy(allow_remote_listen=True) as server:
        client = ToxiproxyClient(server.url, timeout=10)
        proxy = client.create_proxy("wide", upstream, listen="0.0.0.0:0")
        host, _, port = proxy["listen"].rpartition(":")
        assert host == "0.0.0.0" and int(port) > 0
        with socket.create_connection(("127.0.0.1", int(port)), timeout=5):
            pass  # bound on every interface, loopback included


# --------------------------------------------------------------------------------------------
# Malformed requests: a 4xx with the JSON error body, and the server keeps serving
# --------------------------------------------------------------------------------------------

_HUGE = "9" * 400


@pytest.mark.parametrize(("name", "data", "status", "words"), [
    ("content-length -1", b"POST /proxies HTTP/1.1\r\nContent-Length: -1\r\n\r\n", 400,
     ["Content-Length", "-1"]),
    ("content-length abc", b"POST /proxies HTTP/1.1\r\nContent-Length: abc\r\n\r\n", 400,
     ["Content-Length", "abc"]),
    ("content-length 400 digits", f"POST /proxies HTTP/1.1\r\nContent-Length: {_HUGE}\r\n\r\n"
     .encode(), 413, ["limit"]),
    ("bad chunk size", b"POST /proxies HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", 400,
     ["chunk size"]),
    ("chunk longer than its size", b"POST /proxies HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n"
     b"2\r\nabcdef\r\n0\r\n\r\n", 400, ["chunk"]),
    ("unknown transfer-encoding", b"POST /proxies HTTP/1.1\r\nTransfer-Encoding: gzip\r\n\r\n", 400,
     ["Transfer-Encoding"]),
    ("100 KB header line", b"GET /version HTTP/1.1\r\nX-Big: " + b"a" * 100_000 + b"\r\n\r\n", 431,
     ["headers"]),
    ("101 headers", b"GET /version HTTP/1.1\r\n" + b"X-A: b\r\n" * 101 + b"\r\n", 431, ["header"]),
    ("header without colon", b"GET /version HTTP/1.1\r\nnonsense\r\n\r\n", 400, ["header"]),
    ("bad request line", b"GET /version\r\n\r\n", 400, ["request line"]),
    ("HTTP/2 request line", b"GET /version HTTP/2.0\r\n\r\n", 400, ["request line"]),
    ("truncated body", b"POST /proxies HTTP/1.1\r\nContent-Length: 10\r\n\r\n{\"na", 400, ["cut off"]),
    ("body over 1 MiB", b"POST /proxies HTTP/1.1\r\nContent-Length: 1048577\r\n\r\n", 413, ["limit"]),
    ("relative target", b"GET version HTTP/1.1\r\n\r\n", 400, ["target"]),
    ("unknown route", b"GET /nope HTTP/1.1\r\n\r\n", 404, ["not found"]),
    ("wrong method", b"PUT /version HTTP/1.1\r\n\r\n", 405, ["GET"]),
])
def test_malformed_http_gets_a_4xx_json_error(tp: EmbeddedToxiproxy, name: str, data: bytes,
                                                status: int, words: list[str]) -> None:
    assert_error(exchange(tp.port, data), status, *words)
    assert_serving(tp)


def test_bad_json_values_get_a_400_and_are_never_echoed_as_invalid_json(
        tp: EmbeddedToxiproxy, upstream: str) -> None:
    status, _, _ = parse_one(exchange(tp.port, request("POST", "/proxies", {
        "name": "p", "upstream": upstream})))
    assert status == 201
    toxic = '{"type": "latency", "name": "t", "toxicity": %s, "attributes": {"latency": %s}}'
    cases = [  # (toxicity, latency) as JSON text, and what the error names
        (_HUGE, "1", "toxicity"), ("NaN", "1", "NaN"), ("Infinity", "1", "Infinity"),
        ("-Infinity", "1", "Infinity"), ("1e400", "1", "toxicity"), ("1e39", "1", "toxicity"),
        ("0.5", _HUGE, "latency"), ("0.5", "9223372036854775808", "latency"),
        ("0.5", "NaN", "NaN"), ("0.5", "1.5", "latency"), ("0.5", '"1"', "latency"),
        ("true", "1", "toxicity"), ("0.5", "9" * 5000, "digits"),
    ]
    for toxicity, latency, word in cases:
        raw = exchange(tp.port, request("POST", "/proxies/p/toxics",
                                        raw_body=(toxic % (toxicity, latency)).encode()))
        message = assert_error(raw, 400, word)
        assert len(message) < 400, message  # a 5000-digit value is not echoed whole
    deep = b"[" * 100_000 + b"]" * 100_000
    assert_error(exchange(tp.port, request("POST", "/populate", raw_body=deep)), 400, "nested",
                 populate=True)
    # nothing was added; valid values at the edges of Go's types are accepted as Toxiproxy does
    status, _, toxics = parse_one(exchange(tp.port, b"GET /proxies/p/toxics HTTP/1.1\r\n\r\n"))
    assert status == 200 and toxics == []
    status, _, answer = parse_one(exchange(tp.port, request(
        "POST", "/proxies/p/toxics", raw_body=(toxic % ("1", "9223372036854775807")).encode())))
    assert status == 200 and answer["attributes"]["latency"] == 9223372036854775807
    status, _, answer = parse_one(exchange(tp.port, request(
        "PATCH", "/proxies/p/toxics/t", raw_body=b'{"toxicity": NaN}')))
    assert status == 400 and answer["status"] == 400
    status, _, answer = parse_one(exchange(tp.port, request(
        "PATCH", "/proxies/p/toxics/t", {"toxicity": 0.25})))
    assert status == 200 and answer["toxicity"] == 0.25
    assert_serving(tp)


def test_upstream_and_listen_are_checked_at_create(tp: EmbeddedToxiproxy, upstream: str) -> None:
    for bad, words in [("nope.invalid:6379", ["nope.invalid", "cannot be resolved"]),
                       ("127.0.0.1:0", ["port 0"]), ("127.0.0.1", ["host:port"]),
                       ("127.0.0.1:99999", ["out of range"]), ("a\u0000b:1", ["resolved"])]:
        assert_error(exchange(tp.port, request("POST", "/proxies", {
            "name": "p", "upstream": bad})), 400, "upstream", *words)
    for bad in ["nope.invalid:0", "127.0.0.1:65536", "x"]:
        assert_error(exchange(tp.port, request("POST", "/proxies", {
            "name": "p", "upstream": upstream, "listen": bad})), 400, "listen")
    # valid ones as Toxiproxy: a name that resolves, a host-less upstream (this machine)
    for i, good in enumerate(["localhost:6379", ":6379", upstream]):
        status, _, proxy = parse_one(exchange(tp.port, request("POST", "/proxies", {
            "name": f"ok{i}", "upstream": good})))
        assert status == 201 and proxy["upstream"] == good
    assert_error(exchange(tp.port, request("PATCH", "/proxies/ok0", {"upstream": "nope.invalid:1"})),
                 400, "nope.invalid")
    # duplicate names in /populate are a client error (Toxiproxy answers 500)
    status, _, body = parse_one(exchange(tp.port, request("POST", "/populate", [
        {"name": "d", "upstream": upstream}, {"name": "d", "upstream": upstream}])))
    assert status == 400 and "duplicate" in body["error"] and body["proxies"] is None


def test_a_64_mib_chunked_body_is_refused_without_being_buffered(tmp_path: Path) -> None:
    """RSS of a standalone server (peak, VmHWM) before and after 64 MiB of chunked body in
    1 MiB chunks, and a single chunk declaring 64 MiB: 413 both times, at most a few MB more."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "trainguard.cli", "toxiproxy-server", "--port", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        match = re.search(r"listening on http://127\.0\.0\.1:(\d+)", line)
        assert match, line
        port = int(match.group(1))

        def peak_kb() -> int:
            status = Path(f"/proc/{proc.pid}/status").read_text()
            return int(re.search(r"VmHWM:\s+(\d+) kB", status).group(1))  # type: ignore[union-attr]

        assert_serving_port(port)
        before = peak_kb()
        chunk = b"x" * (1 << 20)
        with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
            sock.sendall(b"POST /populate HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n")
            sent = 0
            with contextlib.suppress(OSError):  # the server may stop reading once it answered
                for _ in range(64):
                    sock.sendall(b"100000\r\n" + chunk + b"\r\n")
                    sent += 1
                sock.sendall(b"0\r\n\r\n")
            raw = read_to_eof(sock)
        assert_error(raw, 413, "limit")
        assert_error(exchange(port, b"POST /populate HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n"
                              b"4000000\r\n" + chunk), 413, "limit")
        assert_serving_port(port)
        after = peak_kb()
        print(f"toxiproxy-server peak RSS {before / 1024:.1f} MB -> {after / 1024:.1f} MB "
              f"after 64 MiB chunked ({sent} MiB sent before the 413)")
        assert after - before < 16 * 1024, (before, after)
    finally:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(20)
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def assert_serving_port(port: int) -> None:
    status, _, body = parse_one(exchange(port, b"GET /version HTTP/1.1\r\n\r\n"))
    assert status == 200 and body["version"]


def test_keep_alive_survives_errors_the_server_can_answer_in_place(tp: EmbeddedToxiproxy) -> None:
    """An API error (404, 400 body) keeps the connection; a framing error closes it."""
    with socket.create_connection(("127.0.0.1", tp.port), timeout=10) as sock:
        sock.sendall(b"GET /nope HTTP/1.1\r\n\r\n" + request("POST", "/proxies", raw_body=b"{")
                     + b"GET /version HTTP/1.1\r\n\r\n" + b"BROKEN\r\n\r\n")
        sock.shutdown(socket.SHUT_WR)
        raw = read_to_eof(sock)
    responses = parse_all(raw)
    assert [status for status, _, _ in responses] == [404, 400, 200, 400], raw
    assert "connection" not in responses[1][1] and responses[3][1]["connection"] == "close"


def test_a_request_not_finished_in_time_gets_a_408(tp: EmbeddedToxiproxy,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A client that starts a request and stalls (slowloris) is answered 408 once the read
    deadline passes (15 s, Toxiproxy's ReadTimeout; shortened here) and the server goes on."""
    monkeypatch.setattr(httpio, "READ_TIMEOUT_S", 0.5)
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", tp.port), timeout=10) as sock:
        sock.sendall(b"POST /proxies HTTP/1.1\r\nContent-Length: 100\r\n\r\n{")
        raw = read_to_eof(sock)  # without closing our side
    assert_error(raw, 408, "not complete within 0.5 s")
    assert time.monotonic() - started < 8
    assert_serving(tp)


def test_head_gets_headers_only(tp: EmbeddedToxiproxy) -> None:
    raw = exchange(tp.port, b"HEAD /version HTTP/1.1\r\n\r\nGET /version HTTP/1.1\r\n\r\n")
    head, _, rest = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 405 ") and b"Allow: GET" in head
    assert parse_one(rest)[0] == 200  # no body after the HEAD answer's headers


def test_toxics_at_the_limits_of_their_attributes_keep_the_proxy_working(
        tp: EmbeddedToxiproxy, caplog: pytest.LogCaptureFixture) -> None:
    """Every toxic with every attribute at int64's ends (accepted, as Toxiproxy does) added,
    updated and removed on an open connection: nothing raised in the proxy, which still echoes."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(64)
        client = ToxiproxyClient(tp.url, timeout=10)
        host, port = client.proxy_address(client.create_proxy(
            "edge", f"127.0.0.1:{server.getsockname()[1]}")).rsplit(":", 1)
        with caplog.at_level(logging.DEBUG):
            for value in (2**63 - 1, -(2**63)):
                for toxic, names in TOXIC_ATTRIBUTES.items():
                    with socket.create_connection((host, int(port)), timeout=5) as sock:
                        accepted, _ = server.accept()
                        with accepted:
                            attributes = dict.fromkeys(names, value)
                            client.add_toxic("edge", toxic, attributes, stream="upstream", name="x")
                            client.add_toxic("edge", toxic, attributes, name="y")
                            with contextlib.suppress(OSError):
                                sock.sendall(b"d" * 20_000)
                                accepted.sendall(b"u" * 20_000)
                            client.update_toxic("edge", "x", attributes, toxicity=0.5)
                            client.remove_toxic("edge", "x")
                            client.remove_toxic("edge", "y")
            with socket.create_connection((host, int(port)), timeout=5) as sock:
                accepted, _ = server.accept()
                with accepted:
                    sock.sendall(b"ping")
                    assert accepted.recv(4) == b"ping"
        logged = [r for r in caplog.records if r.levelno >= logging.WARNING
                  or r.name.startswith("trainguard.faults.toxiproxy")]
        assert not logged, [f"{r.name}: {r.getMessage()}" for r in logged]


# --------------------------------------------------------------------------------------------
# trainguard toxiproxy-server: usage errors
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("argv", "words"), [
    (["--port", "99999"], ["--port", "0 to 65535", "99999"]),
    (["--port", "-1"], ["--port", "0 to 65535"]),
    (["--port", "8474x"], ["--port", "0 to 65535"]),
    (["--port", "9" * 400], ["--port", "0 to 65535"]),
    (["--host", "nope.invalid"], ["--host", "nope.invalid", "does not resolve"]),
    (["--host", ""], ["--host"]),
])
def test_cli_bad_port_or_host_is_a_usage_error(argv: list[str], words: list[str],
                                                capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        cli_main(["toxiproxy-server", *argv])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    for word in words:
        assert word in err, err
    assert "Traceback" not in err and len(err) < 2000


def test_cli_host_that_is_not_this_machines_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["toxiproxy-server", "--host", "192.0.2.1", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert "--host" in err and "192.0.2.1" in err and "Traceback" not in err


@pytest.mark.parametrize(("config", "words"), [
    ("[1]", ["entry 1", "JSON object"]),
    ('[{"name": "a"}]', ["entry 1 ('a')", "missing 'upstream'"]),
    ('[{"name": "a", "upstrem": "127.0.0.1:1"}]', ["entry 1 ('a')", "'upstrem'", "did you mean 'upstream'"]),
    ('[{"name": "a", "upstream": 6379}]', ["entry 1 ('a'): upstream", "host:port", "6379"]),
    ('[{"name": "a", "upstream": "127.0.0.1:1", "enabled": NaN}]', ["not valid JSON", "NaN"]),
    ('[{"name": "a", "upstream": "127.0.0.1:1"}, {"name": "b", "upstream": "nope.invalid:1"}]',
     ["entry 2 ('b'): upstream", "nope.invalid"]),
    ('[{"name": "a", "upstream": "127.0.0.1:1", "listen": "0.0.0.0:0"}]',
     ["entry 1 ('a'): listen", "--allow-remote-listen"]),
    ('[{"name": "a", "upstream": "127.0.0.1:1"}, {"name": "a", "upstream": "127.0.0.1:2"}]',
     ["entry 2 ('a'): name", "duplicate"]),
    ('{"name": "not a list"}', ["expected a JSON list of proxies"]),
    ("/dev/zero", ["over 16 MiB"]),
    ("/", ["cannot read it"]),
    ("\xff\xfe", ["not valid JSON"]),
])
def test_cli_config_errors_name_the_file_entry_and_key(tmp_path: Path, config: str, words: list[str],
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    path = Path(config) if config.startswith("/") else tmp_path / "proxies.json"
    if not config.startswith("/"):
        path.write_bytes(config.encode("latin-1"))
    assert cli_main(["toxiproxy-server", "--port", "0", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"{path}: " in err, err
    for word in words:
        assert word in err, err
    assert "http://" not in err and "Traceback" not in err


def test_cli_config_error_exits_2_in_a_real_process(tmp_path: Path) -> None:
    path = tmp_path / "proxies.json"
    path.write_text('[{"name": "a", "upstream": "nope.invalid:1"}]')
    proc = subprocess.run(
        [sys.executable, "-m", "trainguard.cli", "toxiproxy-server", "--port", "0", "--config",
         str(path), "--port", "99999"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--port" in proc.stderr and "Traceback" not in proc.stderr
    proc = subprocess.run(
        [sys.executable, "-m", "trainguard.cli", "toxiproxy-server", "--port", "0", "--config",
         str(path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert f"{path}: entry 1 ('a'): upstream" in proc.stderr and "Traceback" not in proc.stderr
    assert "http://" not in proc.stderr


def test_cli_allow_remote_listen_lets_a_config_listen_everywhere(tmp_path: Path, upstream: str) -> None:
    path = tmp_path / "proxies.json"
    path.write_text(json.dumps([{"name": "wide", "upstream": upstream, "listen": "0.0.0.0:0"}]))
    proc = subprocess.Popen(
        [sys.executable, "-m", "trainguard.cli", "toxiproxy-server", "--port", "0",
         "--allow-remote-listen", "--config", str(path)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 60
        url = None
        while url is None and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            if match := re.search(r"listening on (http://\S+)", line):
                url = match.group(1)
        assert url
        listen = ToxiproxyClient(url, timeout=10).get_proxy("wide")["listen"]
        assert listen.startswith("0.0.0.0:")
    finally:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(20)
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_trainguard_client_surfaces_the_refusal(tp: EmbeddedToxiproxy, upstream: str) -> None:
    client = ToxiproxyClient(tp.url, timeout=10)
    with pytest.raises(ToxiproxyError, match="--allow-remote-listen") as raised:
        client.create_proxy("wide", upstream, listen="0.0.0.0:0")
    assert raised.value.status == 400


# --------------------------------------------------------------------------------------------
# Fuzz: generated malformed requests on raw sockets
# --------------------------------------------------------------------------------------------

_NAMES = st.sampled_from(["p0", "p1", "p2", "t0", "latency_downstream"]) | st.text(max_size=8)
_ADDRESSES = st.sampled_from([
    "127.0.0.1:0", "localhost:0", "[::1]:0", ":0", "0.0.0.0:0", "[::]:0", "10.1.2.3:0",
    "127.0.0.1:99999", "127.0.0.1", "nope.invalid:80", "127.0.0.1:0x10", "", ":", "[::1", "::1:0",
    "127.0.0.1:6379", "localhost:6379", ":6379", "1.2.3.4:5", "127.0.0.1:-1", "127.0.0.1:\u0663",
]) | st.text(alphabet=st.characters(blacklist_characters=".:"), max_size=12)
_NUMBERS = st.one_of(
    st.integers(-(2**70), 2**70), st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0, 1, 0.5, -1, 2**63 - 1, 2**63, -(2**63) - 1, 10**400, 1e39]),
)
_SCALARS = st.one_of(st.none(), st.booleans(), _NUMBERS, st.text(max_size=20))
_JSON = st.recursive(_SCALARS, lambda inner: st.lists(inner, max_size=3)
                     | st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=8)
_PROXY = st.fixed_dictionaries({}, optional={
    "name": _NAMES | _JSON, "upstream": _ADDRESSES | _JSON, "listen": _ADDRESSES | _JSON,
    "enabled": st.booleans() | _JSON,
})
_TOXIC = st.fixed_dictionaries({}, optional={
    "name": _NAMES | _JSON, "type": st.sampled_from(["latency", "bandwidth", "timeout", "slicer",
                                                     "limit_data", "noop", "bogus"]) | _JSON,
    "stream": st.sampled_from(["upstream", "downstream", "UpStream", "sideways"]) | _JSON,
    "toxicity": _NUMBERS | _JSON,
    "attributes": st.dictionaries(st.sampled_from(["latency", "jitter", "rate", "timeout", "bytes",
                                                   "average_size", "delay", "x"]),
                                  _NUMBERS | _JSON, max_size=4) | _JSON,
})


def _dumps(value: Any) -> bytes:
    try:
        return json.dumps(value).encode()  # NaN and Infinity written as Python does
    except ValueError:  # a 10**400 float, say
        return b'{"toxicity": 1e400}'


_BODIES = st.one_of(
    _PROXY.map(_dumps), _TOXIC.map(_dumps), st.lists(_PROXY, max_size=3).map(_dumps),
    _JSON.map(_dumps), st.binary(max_size=64),
    st.integers(1, 5000).map(lambda n: b"[" * n + b"]" * n),
    st.sampled_from([b"", b"{", b'{"toxicity": NaN}', b'{"name": "a\\ud800"}', b"\xff\xfe{}",
                     b'{"toxicity": ' + b"9" * 5000 + b"}"]),
)
_PATHS = st.one_of(
    st.sampled_from(["/version", "/reset", "/proxies", "/populate", "/proxies/p0",
                     "/proxies/p0/toxics", "/proxies/p0/toxics/t0", "/proxies/p1/toxics/latency_downstream",
                     "/proxies/%2e%2e", "/proxies/%ff%00", "/proxies//toxics", "*", "version",
                     "http://[::1/version", "http://x/proxies?x=1#f", "/proxies?" + "a" * 3000]),
    st.text(alphabet=st.characters(min_codepoint=33, max_codepoint=255), max_size=30).map(lambda p: "/" + p),
)
_METHODS = st.sampled_from(["GET", "POST", "PATCH", "DELETE", "PUT", "OPTIONS", "G\x00T", "",
                            "get", "POST POST"]) | st.text(
    alphabet="ABCDEFGHIJKLMNOPQRSTUVWXYZ", max_size=10).filter(lambda m: m != "HEAD")  # no body
_VERSIONS = st.sampled_from(["HTTP/1.1", "HTTP/1.1", "HTTP/1.0", "HTTP/2.0", "HTTP/1.x", "http/1.1", ""])
_HEADERS = st.lists(st.one_of(
    st.sampled_from(["Connection: close", "Connection: keep-alive", "Expect: 100-continue",
                     "User-Agent: Mozilla/5.0", "Content-Type: application/json", "Content-Length: -1",
                     "Content-Length: abc", "Content-Length: 99999999999999999999", "Transfer-Encoding: gzip",
                     "Transfer-Encoding: chunked, chunked", " folded", "NoColon", ": empty-name",
                     "X-Big: " + "b" * 70_000]),
    st.tuples(st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126), min_size=1, max_size=10),
              st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=255), max_size=20))
    .map(lambda kv: f"{kv[0]}: {kv[1]}"),
), max_size=4)


_ROUTES = st.sampled_from(["/proxies", "/populate", "/proxies/{p}", "/proxies/{p}/toxics",
                           "/proxies/{p}/toxics/{t}", "/reset", "/version"])
_SANE_HEADERS = st.lists(st.sampled_from(["Connection: close", "Connection: keep-alive",
                                          "Expect: 100-continue", "Content-Type: application/json",
                                          "Accept: */*", "User-Agent: Mozilla/5.0"]), max_size=2)


@st.composite
def _requests(draw: st.DrawFn) -> bytes:
    """One to three requests: most of them well framed with a JSON body meant for the route (so
    the endpoints' own checks are reached), the others with anything in any part."""
    out = b""
    for _ in range(draw(st.integers(1, 3))):
        sane = draw(st.integers(0, 9)) < 7
        eol = b"\r\n" if sane else draw(st.sampled_from([b"\r\n"] * 5 + [b"\n"]))
        if sane:
            route = draw(_ROUTES).format(p=draw(st.sampled_from(["p0", "p1", "p2"])),
                                         t=draw(st.sampled_from(["t0", "latency_downstream"])))
            line = f"{draw(st.sampled_from(['GET', 'POST', 'PATCH', 'DELETE']))} {route} HTTP/1.1"
            headers = draw(_SANE_HEADERS)
            body = draw((_TOXIC if "toxics" in route else
                         st.lists(_PROXY, max_size=3) if route == "/populate" else _PROXY).map(_dumps))
            framing = draw(st.sampled_from(["length", "length", "chunked"]))
        else:
            line = f"{draw(_METHODS)} {draw(_PATHS)} {draw(_VERSIONS)}"
            if draw(st.integers(0, 9)) == 0:
                line = draw(st.text(max_size=30))
            headers = draw(_HEADERS)
            body = draw(_BODIES)
            framing = draw(st.sampled_from(["length", "length", "chunked", "none", "short", "long",
                                            "bad-chunk", "cut-chunk"]))
        if framing in ("length", "short", "long"):
            delta = {"length": 0, "short": -1, "long": draw(st.integers(1, 50))}[framing]
            headers.append(f"Content-Length: {max(len(body) + delta, 0)}")
        elif framing == "chunked":
            headers.append("Transfer-Encoding: chunked")
            cuts = sorted(draw(st.lists(st.integers(0, len(body)), max_size=3)))
            pieces = [body[a:b] for a, b in zip([0, *cuts], [*cuts, len(body)]) if b > a]
            body = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"
        elif framing in ("bad-chunk", "cut-chunk"):
            headers.append("Transfer-Encoding: chunked")
            body = (b"zz;x\r\n" + body) if framing == "bad-chunk" else b"%x\r\n%s" % (len(body) + 5, body)
        out += line.encode("utf-8", "surrogatepass") + eol
        out += b"".join(h.encode("utf-8", "surrogatepass") + eol for h in headers) + eol + body
    return out


def _check_exchange(port: int, data: bytes) -> list[int]:
    raw = exchange(port, data, timeout=30)
    if not data.strip(b"\r\n"):
        assert raw == b""
        return []
    responses = parse_all(raw)
    final = [r for r in responses if r[0] != 100]
    assert final, f"no response to {data[:300]!r}"
    for status, _headers, body in final:
        if status >= 400:
            assert isinstance(body, dict) and body.get("status") == status, body
            assert set(body) in ({"error", "status"}, {"error", "status", "proxies"}), body
            assert isinstance(body["error"], str) and len(body["error"]) < 1000, body
            assert not body["error"].startswith("internal error"), body
            # 500 only for a listen port already taken, as Toxiproxy
            assert status < 500 or body["error"].startswith("listen tcp"), body
        else:
            assert 200 <= status < 300, status
    return [status for status, _, _ in final]


def _fuzz(tp: EmbeddedToxiproxy, caplog: pytest.LogCaptureFixture, examples: int,
          upstream: str) -> None:
    client = ToxiproxyClient(tp.url, timeout=10)
    for name in ("p0", "p1"):  # so that the toxic routes reach their checks
        client.create_proxy(name, upstream)
    client.add_toxic("p0", "latency", {"latency": 1}, name="t0")
    tried = 0
    statuses: collections.Counter[int] = collections.Counter()

    @settings(max_examples=examples, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                     HealthCheck.filter_too_much])
    @given(data=_requests())
    def one(data: bytes) -> None:
        nonlocal tried
        tried += 1
        statuses.update(_check_exchange(tp.port, data))

    with caplog.at_level(logging.DEBUG):
        started = time.monotonic()
        one()
        elapsed = time.monotonic() - started
    print(f"toxiproxy API fuzz: {tried} generated examples in {elapsed:.1f} s; responses by "
          f"status: {dict(sorted(statuses.items()))}")
    logged = [r for r in caplog.records if r.levelno >= logging.WARNING
              or r.name.startswith("trainguard.faults.toxiproxy")]
    assert not logged, [f"{r.name}: {r.getMessage()}" for r in logged]
    assert_serving(tp)


def test_fuzz_http_api(tp: EmbeddedToxiproxy, caplog: pytest.LogCaptureFixture,
                       upstream: str) -> None:
    """A few hundred generated requests: every one answered with a well-formed 2xx or 4xx (the
    JSON error body), nothing logged by asyncio or the server, and still serving after."""
    _fuzz(tp, caplog, 500, upstream)


@pytest.mark.slow
def test_fuzz_http_api_long(tp: EmbeddedToxiproxy, caplog: pytest.LogCaptureFixture,
                            upstream: str) -> None:
    _fuzz(tp, caplog, 3000, upstream)
