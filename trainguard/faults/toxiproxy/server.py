"""An embedded TCP proxy server that speaks Toxiproxy's HTTP API (v2).

No Toxiproxy binary can be installed everywhere trainguard runs (PyPI ships only clients), so
this is a faithful re-implementation on asyncio streams: the same endpoints, status codes,
error bodies (``{"error": ..., "status": ...}``) and JSON shapes as Toxiproxy's ``api.go``, and
the toxics of :mod:`trainguard.faults.toxiproxy.toxics`, which apply to connections already
open when a toxic is added, updated or removed.

* :class:`ToxiproxyServer` is the server on a running asyncio loop;
* :class:`EmbeddedToxiproxy` runs one in a background thread with its own loop (a context
  manager that binds a free port by default and always stops in ``finally``) -- for library use;
* ``trainguard toxiproxy-server [--host 127.0.0.1] [--port 8474]`` runs one standalone.

Everything binds 127.0.0.1 unless told otherwise; a proxy whose ``listen`` has no host
(``":8080"``) binds 127.0.0.1 too (Toxiproxy would bind every interface).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import socket
import struct
import threading
import urllib.parse
from collections.abc import Awaitable, Callable
from typing import Any, Literal

from trainguard._version import __version__
from trainguard.faults.toxiproxy.toxics import (
    DIRECTIONS,
    INVALID_STREAM,
    INVALID_TOXIC_TYPE,
    PROXY_EXISTS,
    PROXY_NOT_FOUND,
    TOXIC_ATTRIBUTES,
    TOXIC_EXISTS,
    TOXIC_NOT_FOUND,
    ApiError,
    Chunk,
    Stage,
    ToxicSpec,
    bad_request_body,
    make_stage,
    missing_field,
    parse_attributes,
)

__all__ = [
    "API_VERSION",
    "DEFAULT_HOST",
    "DEFAULT_PORT",
    "EmbeddedToxiproxy",
    "ToxiproxyServer",
    "format_hostport",
    "split_hostport",
]

#: the Toxiproxy release whose HTTP API this server implements (answered by ``GET /version``)
API_VERSION = "2.6.0"
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8474  # Toxiproxy's default

_READ_SIZE = 256 * 1024
_STREAM_LIMIT = 256 * 1024  # StreamReader pauses the socket above twice this
_QUEUE_CHUNKS = 1024  # chunks a link reads ahead of its toxics (Toxiproxy's latency buffer)
_UPSTREAM_CONNECT_TIMEOUT_S = 10.0
_MAX_BODY = 1 << 20
_IDLE_TIMEOUT_S = 60.0  # Toxiproxy's API IdleTimeout
_READ_TIMEOUT_S = 15.0  # ... and ReadTimeout

Direction = Literal["upstream", "downstream"]


def split_hostport(address: str) -> tuple[str, int]:
    """``"host:port"`` (``"[::1]:port"`` for IPv6) -> ``(host, port)``; ValueError when malformed."""
    host, sep, port_text = address.rpartition(":")
    if not sep or not port_text.isdigit():
        raise ValueError(f"{address!r} is not host:port")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    port = int(port_text)
    if port > 65535:
        raise ValueError(f"{address!r}: port {port} is out of range")
    return host, port


def format_hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


async def _bind(host: str, port: int) -> socket.socket:
    """A listening socket on the first address of ``host`` (IPv4 first), like Go's net.Listen:
    one socket, so port 0 gives one port even for a name with several addresses."""
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, _, _, _, address = sorted(infos, key=lambda info: info[0] != socket.AF_INET)[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(128)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


def _sockname(sock: socket.socket) -> str:
    name = sock.getsockname()
    return format_hostport(str(name[0]), int(name[1]))


# ------------------------------------------------------------------------------------------
# Proxied connections
# ------------------------------------------------------------------------------------------


class _Link:
    """One direction of a connection: source -> toxic stages -> destination."""

    def __init__(
        self,
        conn: _Connection,
        direction: Direction,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        chain: list[ToxicSpec],
        rng: random.Random,
    ) -> None:
        self.conn = conn
        self.direction = direction
        self.reader = reader
        self.writer = writer
        self.rng = rng
        self.queue: asyncio.Queue[Chunk] = asyncio.Queue(_QUEUE_CHUNKS)
        # replaced, never mutated: a chunk already in the chain keeps the list it started with
        self.stages: list[Stage] = [make_stage(spec, conn, rng) for spec in chain]
        self.tasks: list[asyncio.Task[None]] = []
        self.finished = False

    def start(self) -> None:
        for stage in self.stages:
            stage.start()
        self.tasks = [
            asyncio.ensure_future(self._read()),
            asyncio.ensure_future(self._pump()),
        ]

    # -- toxic changes on an open connection --------------------------------------------------

    def add(self, spec: ToxicSpec) -> None:
        stage = make_stage(spec, self.conn, self.rng)
        self.stages = [*self.stages, stage]
        stage.start()

    def replace(self, spec: ToxicSpec) -> None:
        for i, old in enumerate(self.stages):
            if old.spec.name == spec.name:
                new = make_stage(spec, self.conn, self.rng)
                new.inherit(old)
                old.interrupt()
                self.stages = [*self.stages[:i], new, *self.stages[i + 1:]]
                new.start()
                return

    def remove(self, name: str) -> None:
        for old in self.stages:
            if old.spec.name == name:
                old.interrupt()
                self.stages = [s for s in self.stages if s is not old]
                old.cleanup()
                return

    # -- data ---------------------------------------------------------------------------------

    async def _read(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                data = await self.reader.read(_READ_SIZE)
                if not data:
                    break
                await self.queue.put(Chunk(data, loop.time()))
        except (ConnectionError, OSError):
            pass  # a reset source ends the stream like Toxiproxy's io.Copy error does
        await self.queue.put(Chunk(None, loop.time()))

    async def _pump(self) -> None:
        while True:
            chunk = await self.queue.get()
            await self._through(chunk, self.stages, 0)
            if chunk.data is None:
                return

    async def _through(self, chunk: Chunk, stages: list[Stage], index: int) -> None:
        if index == len(stages):
            await self._write(chunk)
            return
        async for out in stages[index].process(chunk):
            await self._through(out, stages, index + 1)

    async def _write(self, chunk: Chunk) -> None:
        if self.conn.closed:
            return
        try:
            if chunk.data is None:
                if self.writer.can_write_eof():
                    self.writer.write_eof()
                self.finished = True
                self.conn.link_finished()
                return
            self.writer.write(chunk.data)
            await self.writer.drain()
        except (ConnectionError, OSError, RuntimeError):
            self.conn.close_connection()


class _Connection:
    """A client connection and its upstream connection, joined by two links."""

    def __init__(
        self,
        proxy: _Proxy,
        client: tuple[asyncio.StreamReader, asyncio.StreamWriter],
        upstream: tuple[asyncio.StreamReader, asyncio.StreamWriter],
    ) -> None:
        self.proxy = proxy
        self.client_writer = client[1]
        self.upstream_writer = upstream[1]
        self.closed = False
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.links: dict[Direction, _Link] = {
            "upstream": _Link(self, "upstream", client[0], upstream[1],
                              proxy.chains["upstream"], proxy.rng),
            "downstream": _Link(self, "downstream", upstream[0], client[1],
                                proxy.chains["downstream"], proxy.rng),
        }

    def start(self) -> None:
        for link in self.links.values():
            link.start()

    def link_finished(self) -> None:
        if all(link.finished for link in self.links.values()):
            self.close_connection()

    def _shut(self) -> None:
        self.closed = True
        current = asyncio.current_task()
        for link in self.links.values():
            for task in link.tasks:
                if task is not current:
                    task.cancel()
            for stage in link.stages:
                stage.interrupt()
        if not self.done.done():
            self.done.set_result(None)

    def close_connection(self) -> None:
        """Close both sockets after what was written so far (FIN to both peers)."""
        if self.closed:
            return
        self._shut()
        for writer in (self.client_writer, self.upstream_writer):
            writer.close()
            # a peer that never reads would keep a closing transport (and its buffer) forever
            asyncio.get_running_loop().call_later(5.0, writer.transport.abort)

    def reset_connection(self) -> None:
        """Close both sockets with SO_LINGER 0: the kernel sends each peer a TCP RST."""
        if self.closed:
            return
        self._shut()
        for writer in (self.client_writer, self.upstream_writer):
            sock = writer.get_extra_info("socket")
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            writer.transport.abort()

    def abort(self) -> None:
        """Drop the connection now (the proxy was disabled or deleted)."""
        if self.closed:
            return
        self._shut()
        for writer in (self.client_writer, self.upstream_writer):
            writer.transport.abort()

    async def run(self) -> None:
        self.start()
        try:
            await self.done
        finally:
            self.abort()  # no-op after a close; cancellation (server stop) lands here
            for link in self.links.values():
                for task in link.tasks:
                    task.cancel()
            tasks = [task for link in self.links.values() for task in link.tasks]
            await asyncio.gather(*tasks, return_exceptions=True)


# ------------------------------------------------------------------------------------------
# Proxies
# ------------------------------------------------------------------------------------------


class _Proxy:
    def __init__(self, name: str, listen: str, upstream: str, rng: random.Random) -> None:
        self.name = name
        self.listen = listen
        self.upstream = upstream
        self.enabled = False
        self.rng = rng
        self.chains: dict[Direction, list[ToxicSpec]] = {"upstream": [], "downstream": []}
        self.connections: set[_Connection] = set()
        self._server: asyncio.Server | None = None
        self._handlers: set[asyncio.Task[Any]] = set()

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "listen": self.listen,
            "upstream": self.upstream,
            "enabled": self.enabled,
            "toxics": self.toxics_json(),
        }

    def toxics_json(self) -> list[dict[str, Any]]:
        return [spec.to_json() for d in DIRECTIONS for spec in self.chains[d]]  # type: ignore[index]

    def find_toxic(self, name: str) -> ToxicSpec | None:
        for chain in self.chains.values():
            for spec in chain:
                if spec.name == name:
                    return spec
        return None

    # -- lifecycle ----------------------------------------------------------------------------

    async def start(self) -> None:
        if self.enabled:
            return
        try:
            host, port = split_hostport(self.listen)
        except ValueError as exc:
            raise ApiError(f"listen tcp {self.listen}: address {self.listen}: {exc}", 500) from None
        try:
            sock = await _bind(host or DEFAULT_HOST, port)
            try:
                self._server = await asyncio.start_server(self._accept, sock=sock,
                                                          limit=_STREAM_LIMIT)
            except BaseException:
                sock.close()
                raise
        except OSError as exc:
            raise ApiError(f"listen tcp {self.listen}: {exc.strerror or exc}", 500) from None
        self.listen = _sockname(sock)
        self.enabled = True

    async def stop(self) -> None:
        if not self.enabled:
            return
        self.enabled = False
        server, self._server = self._server, None
        if server is not None:
            server.close()  # stop accepting at once
        for conn in list(self.connections):
            conn.abort()
        handlers = list(self._handlers)
        for task in handlers:  # connections still dialing their upstream included
            task.cancel()
        if handlers:
            await asyncio.wait(handlers, timeout=5.0)
        if server is not None:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(server.wait_closed(), 5.0)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._handlers.add(task)
        try:
            await self._serve(reader, writer)
        except asyncio.CancelledError:
            # stopped on purpose; asyncio's stream callback logs a cancelled handler as an error
            writer.transport.abort()
        finally:
            if task is not None:
                self._handlers.discard(task)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not self.enabled:
            writer.transport.abort()
            return
        try:
            host, port = split_hostport(self.upstream)
            upstream = await asyncio.wait_for(
                asyncio.open_connection(host, port, limit=_STREAM_LIMIT), _UPSTREAM_CONNECT_TIMEOUT_S
            )
        except (OSError, ValueError, asyncio.TimeoutError):
            writer.close()  # as Toxiproxy: the client is closed when the upstream cannot be reached
            return
        except asyncio.CancelledError:
            writer.transport.abort()
            raise
        if not self.enabled:
            writer.transport.abort()
            upstream[1].transport.abort()
            return
        conn = _Connection(self, (reader, writer), upstream)
        self.connections.add(conn)
        try:
            await conn.run()
        finally:
            self.connections.discard(conn)

    # -- toxics -------------------------------------------------------------------------------

    def add_toxic(self, spec: ToxicSpec) -> None:
        self.chains[spec.direction].append(spec)
        for conn in list(self.connections):
            conn.links[spec.direction].add(spec)

    def update_toxic(self, spec: ToxicSpec) -> None:
        chain = self.chains[spec.direction]
        chain[:] = [spec if s.name == spec.name else s for s in chain]
        for conn in list(self.connections):
            conn.links[spec.direction].replace(spec)

    def remove_toxic(self, spec: ToxicSpec) -> None:
        self.chains[spec.direction] = [s for s in self.chains[spec.direction] if s is not spec]
        for conn in list(self.connections):
            conn.links[spec.direction].remove(spec.name)

    def reset_toxics(self) -> None:
        for chain in list(self.chains.values()):
            for spec in list(chain):
                self.remove_toxic(spec)


# ------------------------------------------------------------------------------------------
# The HTTP API
# ------------------------------------------------------------------------------------------

_Response = tuple[int, Any]  # (status, JSON body | None | raw bytes)

_REASONS = {
    200: "OK", 201: "Created", 204: "No Content", 400: "Bad Request", 403: "Forbidden",
    404: "Not Found", 405: "Method Not Allowed", 409: "Conflict", 413: "Payload Too Large",
    500: "Internal Server Error",
}


def _body_object(body: bytes, what: str = "object") -> Any:
    if not body.strip():
        raise bad_request_body("EOF")
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise bad_request_body(str(exc)) from None
    if what == "object" and not isinstance(data, dict):
        raise bad_request_body(f"expected a JSON object, got {type(data).__name__}")
    if what == "array" and not isinstance(data, list):
        raise bad_request_body(f"expected a JSON array of proxies, got {type(data).__name__}")
    return data


def _field(data: dict[str, Any], key: str, kind: type | tuple[type, ...], default: Any) -> Any:
    value = data.get(key, default)
    if value is None:
        return default
    ok = isinstance(value, kind) and not (kind in (int, float, (int, float)) and isinstance(value, bool))
    if not ok:
        names = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise bad_request_body(f"field {key!r} must be {names}, got {value!r}")
    return value


class ToxiproxyServer:
    """A Toxiproxy-compatible server on the running asyncio loop (``await start()``/``stop()``)."""

    def __init__(self, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT, *,
                 seed: int | None = None) -> None:
        self.host = host
        self.port = port
        self.rng = random.Random(seed)
        self.proxies: dict[str, _Proxy] = {}
        self._server: asyncio.Server | None = None
        self._lock: asyncio.Lock | None = None
        self._clients: set[asyncio.Task[Any]] = set()

    async def start(self) -> None:
        self._lock = asyncio.Lock()
        sock = await _bind(self.host, self.port)
        try:
            self._server = await asyncio.start_server(self._client, sock=sock)
        except BaseException:
            sock.close()
            raise
        self.port = int(sock.getsockname()[1])

    async def stop(self) -> None:
        """Close the API listener, every proxy and every connection."""
        if self._server is not None:
            self._server.close()
        for proxy in list(self.proxies.values()):
            await proxy.stop()
        for task in list(self._clients):
            task.cancel()
        if self._clients:
            await asyncio.wait(list(self._clients), timeout=5.0)
        if self._server is not None:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._server.wait_closed(), 5.0)
            self._server = None

    # -- HTTP ---------------------------------------------------------------------------------

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._clients.add(task)
        try:
            while await self._one_request(reader, writer):
                pass
        except (ConnectionError, OSError, asyncio.IncompleteReadError, asyncio.TimeoutError,
                asyncio.LimitOverrunError, ValueError, asyncio.CancelledError):
            pass
        finally:
            if task is not None:
                self._clients.discard(task)
            writer.close()

    async def _one_request(self, reader: asyncio.StreamReader,
                           writer: asyncio.StreamWriter) -> bool:
        line = await asyncio.wait_for(reader.readline(), _IDLE_TIMEOUT_S)
        if not line.strip():
            return False
        parts = line.decode("latin-1").split()
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            await self._respond(writer, 400, b"400 Bad Request\n", keep=False, text=True)
            return False
        method, target, version = parts
        headers: dict[str, str] = {}
        while True:
            raw = await asyncio.wait_for(reader.readline(), _READ_TIMEOUT_S)
            if raw in (b"\r\n", b"\n", b""):
                break
            key, _, value = raw.decode("latin-1").partition(":")
            headers[key.strip().lower()] = value.strip()
            if len(headers) > 100:
                await self._respond(writer, 400, b"400 Bad Request\n", keep=False, text=True)
                return False
        conn_header = headers.get("connection", "").lower()
        keep = ("close" not in conn_header) if version == "HTTP/1.1" else ("keep-alive" in conn_header)
        if headers.get("expect", "").lower() == "100-continue":
            writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        body = b""
        if "chunked" in headers.get("transfer-encoding", "").lower():
            while True:
                size = int((await reader.readline()).split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while (await reader.readline()) not in (b"\r\n", b"\n", b""):
                        pass
                    break
                body += await asyncio.wait_for(reader.readexactly(size), _READ_TIMEOUT_S)
                await reader.readline()
                if len(body) > _MAX_BODY:
                    break
        elif headers.get("content-length"):
            length = int(headers["content-length"])
            if length > _MAX_BODY:
                await self._respond(writer, 413, b"413 Payload Too Large\n", keep=False, text=True)
                return False
            body = await asyncio.wait_for(reader.readexactly(length), _READ_TIMEOUT_S)
        if len(body) > _MAX_BODY:
            await self._respond(writer, 413, b"413 Payload Too Large\n", keep=False, text=True)
            return False
        if headers.get("user-agent", "").startswith("Mozilla/"):
            # as Toxiproxy: a web page must not drive the API from a browser
            await self._respond(writer, 403, b"User agent not allowed\n", keep=keep, text=True)
            return keep
        status, payload = await self.dispatch(method, target, body)
        await self._respond(writer, status, payload, keep=keep)
        return keep

    async def _respond(self, writer: asyncio.StreamWriter, status: int, payload: Any, *,
                       keep: bool, text: bool = False) -> None:
        headers = [f"HTTP/1.1 {status} {_REASONS.get(status, 'Unknown')}"]
        if status == 204:
            data = b""
        else:
            if isinstance(payload, bytes):
                data = payload
            else:
                data = json.dumps(payload).encode() + (b"\n" if status >= 400 else b"")
                text = False
            ctype = "text/plain; charset=utf-8" if text else "application/json"
            headers.append(f"Content-Type: {ctype}")
            headers.append(f"Content-Length: {len(data)}")
        if not keep:
            headers.append("Connection: close")
        writer.write(("\r\n".join(headers) + "\r\n\r\n").encode("latin-1") + data)
        await writer.drain()

    # -- routing ------------------------------------------------------------------------------

    async def dispatch(self, method: str, target: str, body: bytes) -> _Response:
        """Answer one API request: ``(status, JSON-able body or raw bytes)``."""
        path = urllib.parse.urlsplit(target).path
        segments = [urllib.parse.unquote(s) for s in path.split("/")[1:]]
        route = self._route(segments)
        if route is None:
            return 404, b"404 page not found\n"
        handlers, args = route
        handler = handlers.get(method.upper())
        if handler is None:
            return 405, b""
        assert self._lock is not None
        async with self._lock:  # one change at a time, as Toxiproxy's collection locks do
            try:
                return await handler(*args, body)
            except ApiError as exc:
                return exc.status, exc.body()

    def _route(self, s: list[str]) -> tuple[dict[str, Callable[..., Awaitable[_Response]]],
                                             tuple[str, ...]] | None:
        if s == ["reset"]:
            return {"POST": self.reset}, ()
        if s == ["version"]:
            return {"GET": self.version}, ()
        if s == ["populate"]:
            return {"POST": self.populate}, ()
        if s == ["proxies"]:
            return {"GET": self.proxy_index, "POST": self.proxy_create}, ()
        if len(s) == 2 and s[0] == "proxies" and s[1]:
            return {"GET": self.proxy_show, "POST": self.proxy_update,
                    "PATCH": self.proxy_update, "DELETE": self.proxy_delete}, (s[1],)
        if len(s) == 3 and s[0] == "proxies" and s[1] and s[2] == "toxics":
            return {"GET": self.toxic_index, "POST": self.toxic_create}, (s[1],)
        if len(s) == 4 and s[0] == "proxies" and s[1] and s[2] == "toxics" and s[3]:
            return {"GET": self.toxic_show, "POST": self.toxic_update,
                    "PATCH": self.toxic_update, "DELETE": self.toxic_delete}, (s[1], s[3])
        return None

    def _get(self, name: str) -> _Proxy:
        proxy = self.proxies.get(name)
        if proxy is None:
            raise ApiError(*PROXY_NOT_FOUND)
        return proxy

    # -- endpoints (the names of api.go's handlers) -------------------------------------------

    async def version(self, body: bytes) -> _Response:
        return 200, {"version": API_VERSION, "trainguard": __version__}

    async def reset(self, body: bytes) -> _Response:
        for proxy in self.proxies.values():
            await proxy.start()
            proxy.reset_toxics()
        return 204, None

    async def proxy_index(self, body: bytes) -> _Response:
        return 200, {name: proxy.to_json() for name, proxy in self.proxies.items()}

    async def proxy_create(self, body: bytes) -> _Response:
        data = _body_object(body)
        name = _field(data, "name", str, "")
        upstream = _field(data, "upstream", str, "")
        listen = _field(data, "listen", str, "") or format_hostport(DEFAULT_HOST, 0)
        enabled = _field(data, "enabled", bool, True)
        if not name:
            raise missing_field("name")
        if not upstream:
            raise missing_field("upstream")
        if name in self.proxies:
            raise ApiError(*PROXY_EXISTS)
        proxy = _Proxy(name, listen, upstream, self.rng)
        if enabled:
            await proxy.start()
        self.proxies[name] = proxy
        return 201, proxy.to_json()

    async def populate(self, body: bytes) -> _Response:
        try:
            items = _body_object(body, "array")
            wanted: list[tuple[_Proxy, bool]] = []
            seen: set[str] = set()
            for i, item in enumerate(items, start=1):
                if not isinstance(item, dict):
                    raise bad_request_body(f"proxy {i} must be a JSON object, got {item!r}")
                name = _field(item, "name", str, "")
                upstream = _field(item, "upstream", str, "")
                if not name:
                    raise missing_field(f"name at proxy {i}")
                if not upstream:
                    raise missing_field(f"upstream at proxy {i}")
                if name in seen:
                    raise ApiError(f"duplicate proxy name {name!r}", 500)
                seen.add(name)
                listen = _field(item, "listen", str, "") or format_hostport(DEFAULT_HOST, 0)
                wanted.append((_Proxy(name, listen, upstream, self.rng),
                               _field(item, "enabled", bool, True)))
            result = []
            for proxy, enabled in wanted:
                existing = self.proxies.get(proxy.name)
                if existing is not None:
                    if existing.listen == proxy.listen and existing.upstream == proxy.upstream:
                        result.append(existing)
                        continue
                    await existing.stop()
                    del self.proxies[proxy.name]
                if enabled:
                    await proxy.start()
                self.proxies[proxy.name] = proxy
                result.append(proxy)
        except ApiError as exc:
            return exc.status, {**exc.body(), "proxies": None}
        return 201, {"proxies": [p.to_json() for p in result]}

    async def proxy_show(self, name: str, body: bytes) -> _Response:
        return 200, self._get(name).to_json()

    async def proxy_update(self, name: str, body: bytes) -> _Response:
        proxy = self._get(name)
        data = _body_object(body)
        listen = _field(data, "listen", str, proxy.listen) or proxy.listen
        upstream = _field(data, "upstream", str, proxy.upstream) or proxy.upstream
        enabled = _field(data, "enabled", bool, proxy.enabled)
        if listen != proxy.listen or upstream != proxy.upstream:
            await proxy.stop()
            proxy.listen, proxy.upstream = listen, upstream
        if enabled != proxy.enabled:
            if enabled:
                await proxy.start()
            else:
                await proxy.stop()
        return 200, proxy.to_json()

    async def proxy_delete(self, name: str, body: bytes) -> _Response:
        proxy = self._get(name)
        await proxy.stop()
        del self.proxies[name]
        return 204, None

    async def toxic_index(self, name: str, body: bytes) -> _Response:
        return 200, self._get(name).toxics_json()

    async def toxic_create(self, name: str, body: bytes) -> _Response:
        proxy = self._get(name)
        data = _body_object(body)
        stream = _field(data, "stream", str, "downstream")
        toxicity = float(_field(data, "toxicity", (int, float), 1.0))
        toxic_name = _field(data, "name", str, "")
        toxic_type = _field(data, "type", str, "")
        direction = stream.lower()
        if direction not in DIRECTIONS:
            raise ApiError(*INVALID_STREAM)
        if not toxic_name:
            toxic_name = f"{toxic_type}_{stream}"
        if toxic_type not in TOXIC_ATTRIBUTES:
            raise ApiError(*INVALID_TOXIC_TYPE)
        if proxy.find_toxic(toxic_name) is not None:
            raise ApiError(*TOXIC_EXISTS)
        spec = ToxicSpec(
            name=toxic_name, type=toxic_type, stream=stream,
            direction=direction,  # type: ignore[arg-type]
            toxicity=toxicity,
            attributes=parse_attributes(toxic_type, data.get("attributes")),
        )
        proxy.add_toxic(spec)
        return 200, spec.to_json()

    async def toxic_show(self, name: str, toxic: str, body: bytes) -> _Response:
        spec = self._get(name).find_toxic(toxic)
        if spec is None:
            raise ApiError(*TOXIC_NOT_FOUND)
        return 200, spec.to_json()

    async def toxic_update(self, name: str, toxic: str, body: bytes) -> _Response:
        proxy = self._get(name)
        spec = proxy.find_toxic(toxic)
        if spec is None:
            raise ApiError(*TOXIC_NOT_FOUND)
        data = _body_object(body)
        updated = ToxicSpec(
            name=spec.name, type=spec.type, stream=spec.stream, direction=spec.direction,
            toxicity=float(_field(data, "toxicity", (int, float), spec.toxicity)),
            attributes=parse_attributes(spec.type, data.get("attributes"), spec.attributes),
        )
        proxy.update_toxic(updated)
        return 200, updated.to_json()

    async def toxic_delete(self, name: str, toxic: str, body: bytes) -> _Response:
        proxy = self._get(name)
        spec = proxy.find_toxic(toxic)
        if spec is None:
            raise ApiError(*TOXIC_NOT_FOUND)
        proxy.remove_toxic(spec)
        return 204, None


# ------------------------------------------------------------------------------------------
# Running it in a thread
# ------------------------------------------------------------------------------------------


class EmbeddedToxiproxy:
    """A :class:`ToxiproxyServer` in a background thread with its own event loop.

    >>> with EmbeddedToxiproxy() as server:      # a free port on 127.0.0.1
    ...     client = ToxiproxyClient(server.url)  # or toxiproxy-python, curl, ...

    ``stop()`` (called by ``__exit__``) closes the API, every proxy and every proxied connection
    and joins the thread; it is idempotent.
    """

    def __init__(self, host: str = DEFAULT_HOST, port: int = 0, *, seed: int | None = None) -> None:
        self.server = ToxiproxyServer(host, port, seed=seed)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None

    @property
    def host(self) -> str:
        return self.server.host

    @property
    def port(self) -> int:
        return self.server.port

    @property
    def url(self) -> str:
        """The API's base URL, e.g. ``http://127.0.0.1:8474``."""
        return f"http://{format_hostport(self.host, self.port)}"

    def start(self, timeout: float = 10.0) -> EmbeddedToxiproxy:
        """Bind and serve; raises OSError when the address cannot be bound."""
        if self._thread is not None:
            return self
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="trainguard-toxiproxy", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout):
            self.stop()
            raise TimeoutError(f"the embedded Toxiproxy did not start within {timeout:g} s")
        if self._error is not None:
            error = self._error
            self._thread.join(timeout)
            self._thread = None
            raise error
        return self

    def _run(self) -> None:
        loop = self._loop
        assert loop is not None
        asyncio.set_event_loop(loop)
        try:
            try:
                loop.run_until_complete(self.server.start())
            except BaseException as exc:
                self._error = exc
                return
            finally:
                self._ready.set()
            loop.run_forever()
            loop.run_until_complete(self.server.stop())
        finally:
            pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
            for task in pending:
                task.cancel()
            if pending:
                loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            loop.close()

    def call(self, coro_fn: Callable[[], Awaitable[Any]], timeout: float = 10.0) -> Any:
        """Run ``coro_fn()`` on the server's loop and return its result (for tests and tools)."""
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(_await(coro_fn), self._loop).result(timeout)

    def stop(self, timeout: float = 15.0) -> None:
        thread, loop = self._thread, self._loop
        if thread is None or loop is None:
            return
        if thread.is_alive():
            with contextlib.suppress(RuntimeError):  # already closed
                loop.call_soon_threadsafe(loop.stop)
            thread.join(timeout)
        self._thread = None

    def __enter__(self) -> EmbeddedToxiproxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self._thread is not None else "stopped"
        return f"EmbeddedToxiproxy({self.url}, {state})"


async def _await(coro_fn: Callable[[], Awaitable[Any]]) -> Any:
    return await coro_fn()
