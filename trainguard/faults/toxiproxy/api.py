"""The HTTP API of the embedded Toxiproxy: :class:`ToxiproxyServer` (Toxiproxy's ``api.go``).

The same endpoints, status codes, error bodies (``{"error": ..., "status": ...}``) and JSON shapes
as Toxiproxy v2, over a small HTTP/1.1 server on asyncio streams; the proxies themselves are
:class:`~trainguard.faults.toxiproxy.proxy.Proxy`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import urllib.parse
from collections.abc import Awaitable, Callable
from typing import Any

from trainguard._version import __version__
from trainguard.faults.toxiproxy.addresses import (
    DEFAULT_HOST,
    DEFAULT_PORT,
    bind_listener,
    format_hostport,
)
from trainguard.faults.toxiproxy.proxy import Proxy
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
    ToxicSpec,
    bad_request_body,
    missing_field,
    parse_attributes,
)

__all__ = ["API_VERSION", "ToxiproxyServer"]

#: the Toxiproxy release whose HTTP API this server implements (answered by ``GET /version``)
API_VERSION = "2.6.0"

_MAX_BODY = 1 << 20
_IDLE_TIMEOUT_S = 60.0  # Toxiproxy's API IdleTimeout
_READ_TIMEOUT_S = 15.0  # ... and ReadTimeout

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
        self.proxies: dict[str, Proxy] = {}
        self._server: asyncio.Server | None = None
        self._lock: asyncio.Lock | None = None
        self._clients: set[asyncio.Task[Any]] = set()

    async def start(self) -> None:
        """Bind the API listener (``port`` 0 picks a free port, stored in ``port``)."""
        self._lock = asyncio.Lock()
        sock = await bind_listener(self.host, self.port)
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

    def _get(self, name: str) -> Proxy:
        proxy = self.proxies.get(name)
        if proxy is None:
            raise ApiError(*PROXY_NOT_FOUND)
        return proxy

    # -- endpoints (the names of api.go's handlers) -------------------------------------------

    async def version(self, body: bytes) -> _Response:
        """``GET /version``."""
        return 200, {"version": API_VERSION, "trainguard": __version__}

    async def reset(self, body: bytes) -> _Response:
        """``POST /reset``: enable every proxy and remove every toxic."""
        for proxy in self.proxies.values():
            await proxy.start()
            proxy.reset_toxics()
        return 204, None

    async def proxy_index(self, body: bytes) -> _Response:
        """``GET /proxies``."""
        return 200, {name: proxy.to_json() for name, proxy in self.proxies.items()}

    async def proxy_create(self, body: bytes) -> _Response:
        """``POST /proxies``."""
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
        proxy = Proxy(name, listen, upstream, self.rng)
        if enabled:
            await proxy.start()
        self.proxies[name] = proxy
        return 201, proxy.to_json()

    async def populate(self, body: bytes) -> _Response:
        """``POST /populate``: create or replace the proxies of a JSON array."""
        try:
            items = _body_object(body, "array")
            wanted: list[tuple[Proxy, bool]] = []
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
                wanted.append((Proxy(name, listen, upstream, self.rng),
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
        """``GET /proxies/{name}``."""
        return 200, self._get(name).to_json()

    async def proxy_update(self, name: str, body: bytes) -> _Response:
        """``POST``/``PATCH /proxies/{name}``."""
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
        """``DELETE /proxies/{name}``."""
        proxy = self._get(name)
        await proxy.stop()
        del self.proxies[name]
        return 204, None

    async def toxic_index(self, name: str, body: bytes) -> _Response:
        """``GET /proxies/{name}/toxics``."""
        return 200, self._get(name).toxics_json()

    async def toxic_create(self, name: str, body: bytes) -> _Response:
        """``POST /proxies/{name}/toxics``."""
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
        """``GET /proxies/{name}/toxics/{toxic}``."""
        spec = self._get(name).find_toxic(toxic)
        if spec is None:
            raise ApiError(*TOXIC_NOT_FOUND)
        return 200, spec.to_json()

    async def toxic_update(self, name: str, toxic: str, body: bytes) -> _Response:
        """``POST``/``PATCH /proxies/{name}/toxics/{toxic}``."""
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
        """``DELETE /proxies/{name}/toxics/{toxic}``."""
        proxy = self._get(name)
        spec = proxy.find_toxic(toxic)
        if spec is None:
            raise ApiError(*TOXIC_NOT_FOUND)
        proxy.remove_toxic(spec)
        return 204, None
