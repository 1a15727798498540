"""HTTP/1.1 requests and responses of the embedded Toxiproxy's API, read within limits.

Whatever a client sends, :func:`read_request` either returns a :class:`Request`, returns None
(the client closed between requests), or raises :class:`HttpError` with the 4xx to answer; it
never holds more than :data:`MAX_HEADER_BYTES` of request line and headers or :data:`MAX_BODY`
of body in memory: a longer line, too many headers, or a body (declared or chunked) over the
limit is refused as soon as the limit is crossed, without reading the rest. Every answer is
strict JSON (:func:`encode_response`: no NaN or Infinity), errors as Toxiproxy writes them,
``{"error": message, "status": status}``.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from trainguard.faults.toxiproxy.toxics import ErrorBody

__all__ = [
    "IDLE_TIMEOUT_S",
    "MAX_BODY",
    "MAX_HEADERS",
    "MAX_HEADER_BYTES",
    "READ_TIMEOUT_S",
    "HttpError",
    "Request",
    "encode_response",
    "error_body",
    "loads_strict",
    "read_request",
]

MAX_BODY = 1 << 20  # bytes of request body
MAX_HEADER_BYTES = 64 * 1024  # request line, headers and chunked trailers together
MAX_HEADERS = 100
IDLE_TIMEOUT_S = 60.0  # Toxiproxy's API IdleTimeout: waiting for the next request
READ_TIMEOUT_S = 15.0  # ... and ReadTimeout: the rest of a request once it started

REASONS = {
    100: "Continue", 200: "OK", 201: "Created", 204: "No Content", 400: "Bad Request",
    403: "Forbidden", 404: "Not Found", 405: "Method Not Allowed", 408: "Request Timeout",
    409: "Conflict", 413: "Payload Too Large", 431: "Request Header Fields Too Large",
    500: "Internal Server Error",
}

_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
_VERSION = re.compile(r"HTTP/1\.[0-9]")
_CHUNK_SIZE = re.compile(rb"[0-9A-Fa-f]{1,16}")
_DIGITS = re.compile(r"[0-9]+")


class HttpError(Exception):
    """A request that cannot be served: answered ``status`` with the JSON error body, then the
    connection is closed."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class _Truncated(Exception):
    """The client closed in the middle of a request."""


@dataclass
class Request:
    """One request as read: the body is complete and within :data:`MAX_BODY`."""

    method: str
    target: str
    version: str
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""

    @property
    def keep_alive(self) -> bool:
        """Whether the connection stays open after the answer (HTTP/1.1 unless ``close``)."""
        conn = self.headers.get("connection", "").lower()
        return "close" not in conn if self.version != "HTTP/1.0" else "keep-alive" in conn


class _Budget:
    """What is left of a byte limit for the lines of one request (headers, or chunk framing)."""

    def __init__(self, limit: int = MAX_HEADER_BYTES, status: int = 431,
                 what: str = "request line and headers") -> None:
        self.left = limit
        self.limit = limit
        self.status = status
        self.what = what

    def take(self, line: bytes) -> None:
        self.left -= len(line)
        if self.left < 0:
            raise self.refusal()

    def refusal(self) -> HttpError:
        return HttpError(self.status, f"{self.what} over {self.limit} bytes; send less")


async def _line(reader: asyncio.StreamReader, budget: _Budget) -> bytes:
    try:
        line = await reader.readuntil(b"\n")
    except asyncio.IncompleteReadError as exc:
        if exc.partial:
            raise _Truncated from None
        return b""
    except asyncio.LimitOverrunError:  # a line longer than the reader's limit: never buffered
        raise budget.refusal() from None
    budget.take(line)
    return line


async def read_request(reader: asyncio.StreamReader,
                       send_continue: Callable[[], None] | None = None) -> Request | None:
    """The next request on the connection, None at a clean end (EOF between requests).

    Raises :class:`HttpError` for a malformed, oversized, truncated or too slow request.
    ``send_continue`` is called before the body is read when the client sent
    ``Expect: 100-continue`` and the body is acceptable.
    """
    budget = _Budget()
    try:
        while True:  # RFC 9112 2.2: empty lines before a request line are ignored
            first = await asyncio.wait_for(_line(reader, budget), IDLE_TIMEOUT_S)
            if not first:
                return None
            if first.strip(b"\r\n"):
                break
    except asyncio.TimeoutError:
        return None  # idle keep-alive connection: closed without an answer, as Go's IdleTimeout
    except _Truncated:
        raise HttpError(400, "the request line was cut off (the connection closed)") from None
    try:
        return await asyncio.wait_for(_read_rest(reader, first, budget, send_continue),
                                      READ_TIMEOUT_S)
    except asyncio.TimeoutError:
        raise HttpError(408, f"the request was not complete within {READ_TIMEOUT_S:g} s") from None
    except _Truncated:
        raise HttpError(400, "the request was cut off (the connection closed before its end)"
                        ) from None


async def _read_rest(reader: asyncio.StreamReader, first: bytes, budget: _Budget,
                     send_continue: Callable[[], None] | None) -> Request:
    line = first.decode("latin-1").rstrip("\r\n")
    parts = line.split(" ")
    if len(parts) != 3 or not _TOKEN.fullmatch(parts[0]) or not _VERSION.fullmatch(parts[2]):
        raise HttpError(400, f"malformed request line {_cut(line)}; "
                             "expected e.g. GET /proxies HTTP/1.1")
    method, target, version = parts
    if not target or any(c in target for c in "\x00\t\r"):
        raise HttpError(400, f"malformed request target {_cut(target)}")
    headers: dict[str, str] = {}
    count = 0
    while True:
        raw = await _line(reader, budget)
        if not raw:
            raise _Truncated
        if raw in (b"\r\n", b"\n"):
            break
        count += 1
        if count > MAX_HEADERS:
            raise HttpError(431, f"more than {MAX_HEADERS} header fields")
        _header(raw, headers)
    request = Request(method, target, version, headers)
    request.body = await _body(reader, headers, budget, send_continue)
    return request


def _header(raw: bytes, headers: dict[str, str]) -> None:
    text = raw.decode("latin-1").rstrip("\r\n")
    name, sep, value = text.partition(":")
    if not sep or not _TOKEN.fullmatch(name):
        raise HttpError(400, f"malformed header line {_cut(text)}; expected Name: value")
    key, value = name.lower(), value.strip(" \t")
    if key in ("content-length", "transfer-encoding") and key in headers \
            and headers[key] != value:
        raise HttpError(400, f"two different {name} headers")
    headers[key] = value


async def _body(reader: asyncio.StreamReader, headers: dict[str, str], budget: _Budget,
                send_continue: Callable[[], None] | None) -> bytes:
    encoding = headers.get("transfer-encoding")
    length_text = headers.get("content-length")
    if encoding is not None:  # RFC 9112 6.3: Transfer-Encoding wins over Content-Length
        if encoding.lower() != "chunked":
            raise HttpError(400, f"unsupported Transfer-Encoding {_cut(encoding)}; send the "
                                 "body with Content-Length or Transfer-Encoding: chunked")
        if send_continue is not None and headers.get("expect", "").lower() == "100-continue":
            send_continue()
        return await _chunked(reader, budget)
    if length_text is None:
        return b""
    if not _DIGITS.fullmatch(length_text):
        raise HttpError(400, f"Content-Length {_cut(length_text)} is not a number of bytes")
    if len(length_text) > 12 or int(length_text) > MAX_BODY:
        raise HttpError(413, f"the body ({_cut(length_text)} bytes) is over the limit of "
                             f"{MAX_BODY} bytes")
    length = int(length_text)
    if send_continue is not None and headers.get("expect", "").lower() == "100-continue":
        send_continue()
    try:
        return await reader.readexactly(length)
    except asyncio.IncompleteReadError:
        raise _Truncated from None


async def _chunked(reader: asyncio.StreamReader, budget: _Budget) -> bytes:
    framing = _Budget(MAX_BODY + MAX_HEADER_BYTES, 413, "the chunked body with its framing")
    body = bytearray()
    while True:
        line = await _line(reader, framing)
        if not line:
            raise _Truncated
        size_text = line.split(b";", 1)[0].strip()
        if not _CHUNK_SIZE.fullmatch(size_text):
            raise HttpError(400, f"bad chunk size {_cut(size_text.decode('latin-1'))}; "
                                 "expected hexadecimal digits")
        size = int(size_text, 16)
        if size == 0:
            break
        if len(body) + size > MAX_BODY:  # refused before reading it
            raise HttpError(413, f"the chunked body is over the limit of {MAX_BODY} bytes")
        try:
            body += await reader.readexactly(size)
        except asyncio.IncompleteReadError:
            raise _Truncated from None
        end = await _line(reader, framing)
        if not end:
            raise _Truncated
        if end not in (b"\r\n", b"\n"):
            raise HttpError(400, "a chunk is longer than its size says")
    while True:  # trailer fields, ignored
        trailer = await _line(reader, budget)
        if trailer in (b"\r\n", b"\n"):
            return bytes(body)
        if not trailer:
            raise _Truncated


def loads_strict(body: bytes) -> Any:
    """The JSON value of ``body``; ValueError for invalid JSON or UTF-8, NaN/Infinity, a number
    of more than 4300 digits and nesting deeper than Python's recursion limit."""

    def refuse(name: str) -> Any:
        raise ValueError(f"{name} is not a JSON number")

    try:
        return json.loads(body.decode("utf-8"), parse_constant=refuse)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None


def error_body(status: int, message: str) -> ErrorBody:
    """Toxiproxy's error body."""
    return {"error": message, "status": status}


def encode_response(status: int, payload: Any, *, keep: bool,
                    headers: dict[str, str] | None = None, head: bool = False) -> bytes:
    """The bytes of one answer: ``payload`` as strict JSON (``None``: no body); a payload that
    is not strict JSON (NaN, Infinity) becomes a 500 error body instead. ``head``: the answer to
    a HEAD request, its headers without the body."""
    lines = [f"HTTP/1.1 {status} {REASONS.get(status, 'Unknown')}"]
    data = b""
    if status != 204 and payload is not None:
        try:
            data = json.dumps(payload, allow_nan=False).encode()
        except (ValueError, TypeError) as exc:
            status, data = 500, json.dumps(error_body(500, f"cannot encode the answer: {exc}")).encode()
            lines[0] = f"HTTP/1.1 500 {REASONS[500]}"
        if status >= 400:
            data += b"\n"
        lines.append("Content-Type: application/json")
    if status != 204:
        lines.append(f"Content-Length: {len(data)}")
    for name, value in (headers or {}).items():
        lines.append(f"{name}: {value}")
    if not keep:
        lines.append("Connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + (b"" if head else data)


def _cut(text: str, limit: int = 80) -> str:
    shown = repr(text)
    return shown if len(shown) <= limit else f"{shown[:limit]}... ({len(text)} characters)"
