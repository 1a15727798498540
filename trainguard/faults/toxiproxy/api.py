"""The HTTP API of the embedded Toxiproxy: :class:`ToxiproxyServer` (Toxiproxy's ``api.go``).

The same endpoints, status codes, error bodies (``{"error": ..., "status": ...}``) and JSON shapes
as Toxiproxy v2, over a small HTTP/1.1 server on asyncio streams; the proxies themselves are
:class:`~trainguard.faults.toxiproxy.proxy.Proxy`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import urllib.parse
from collections.abc import Awaitable, Callable
from typing import Any

from trainguard._version import __version__
from trainguard.faults.toxiproxy.addresses import (
    DEFAULT_HOST,
    DEFAULT_PORT,
    AddressError,
    bind_listener,
    format_hostport,
    listen_address,
    resolve,
    split_hostport,
)
from trainguard.faults.toxiproxy.httpio import (
    MAX_HEADER_BYTES,
    HttpError,
    Request,
    encode_response,
    error_body,
    loads_strict,
    read_request,
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
    brief,
    missing_field,
    parse_attributes,
    parse_toxicity,
)

__all__ = ["API_VERSION", "ToxiproxyServer"]

#: the Toxiproxy release whose HTTP API this server implements (answered by ``GET /version``)
API_VERSION = "2.6.0"

_WRITE_TIMEOUT_S = 30.0  # Toxiproxy's API WriteTimeout
_LINGER_S = 5.0  # after an error answer, how long the rest of a request is read and dropped

_Response = tuple[int, Any]  # (status, JSON body | None)
_log = logging.getLogger(__name__)


def _body_object(body: bytes, what: str = "object") -> Any:
    if not body.strip():
        raise bad_request_body("EOF")
    try:
        data = loads_strict(body)
    except ValueError as exc:  # UnicodeDecodeError included
        raise bad_request_body(str(exc)[:200]) from None
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
        raise bad_request_body(f"field {key!r} must be {names}, got {brief(value)}", field=key)
    return value


class ToxiproxyServer:
    """A Toxiproxy-compatible server on the running asyncio loop (``await start()``/``stop()``).

    Proxies listen on loopback addresses only unless ``allow_remote_listen`` (a ``listen`` such
    as ``0.0.0.0:0`` or a LAN address is refused with a 400): the API has no authentication, so
    by default it cannot be used to expose a loopback-only service to the network.
    """

    def __init__(self, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT, *,
                 seed: int | None = None, allow_remote_listen: bool = False) -> None:
        self.host = host
        self.port = port
        self.allow_remote_listen = allow_remote_listen
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
            self._server = await asyncio.start_server(self._client, sock=sock,
                                                      limit=MAX_HEADER_BYTES)
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
        answered = False
        try:
            await self._serve_connection(reader, writer)
            answered = True
        except (asyncio.CancelledError, ConnectionError, OSError, asyncio.TimeoutError):
            pass  # the server is stopping, the client went away or never read its answer
        except Exception:  # never left to asyncio ("Unhandled exception in client_connected_cb")
            _log.debug("Toxiproxy API connection failed", exc_info=True)
        finally:
            if task is not None:
                self._clients.discard(task)
            if answered:  # let the last answer leave; a client that never reads it is dropped
                writer.close()
                asyncio.get_running_loop().call_later(_WRITE_TIMEOUT_S, writer.transport.abort)
            else:
                writer.transport.abort()

    async def _serve_connection(self, reader: asyncio.StreamReader,
                                writer: asyncio.StreamWriter) -> None:
        def send_continue() -> None:
            writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")

        while True:
            try:
                request = await read_request(reader, send_continue)
            except HttpError as exc:
                await self._send(writer, exc.status, error_body(exc.status, exc.message), keep=False)
                await self._linger(reader, writer)
                return
            if request is None:
                return
            try:
                status, payload, headers = await self._answer(request)
            except Exception as exc:  # a bug of this server: answered, never a dropped connection
                _log.debug("Toxiproxy API request failed", exc_info=True)
                status, headers = 500, {}
                payload = error_body(500, f"internal error: {type(exc).__name__}: {brief(str(exc), 200)}")
            await self._send(writer, status, payload, keep=request.keep_alive, headers=headers,
                             head=request.method == "HEAD")
            if not request.keep_alive:
                return

    async def _answer(self, request: Request) -> tuple[int, Any, dict[str, str]]:
        if request.headers.get("user-agent", "").startswith("Mozilla/"):
            # as Toxiproxy: a web page must not drive the API from a browser
            return 403, error_body(403, "User agent not allowed"), {}
        target = request.target
        if not target.startswith("/") and not target.lower().startswith(("http://", "https://")):
            return 400, error_body(400, f"malformed request target {brief(target)}; expected a "
                                        "path such as /proxies"), {}
        try:
            path = urllib.parse.urlsplit(target).path
        except ValueError as exc:
            return 400, error_body(400, f"malformed request target {brief(target)}: {exc}"), {}
        route = self._route([urllib.parse.unquote(s) for s in path.split("/")[1:]])
        if route is None:
            return 404, error_body(404, "404 page not found"), {}
        handlers, args = route
        handler = handlers.get(request.method.upper())
        if handler is None:
            allowed = ", ".join(handlers)
            return 405, error_body(405, f"method {brief(request.method)} not allowed here; "
                                        f"use {allowed}"), {"Allow": allowed}
        status, payload = await self._call(handler, args, request.body)
        return status, payload, {}

    async def _send(self, writer: asyncio.StreamWriter, status: int, payload: Any, *,
                    keep: bool, headers: dict[str, str] | None = None, head: bool = False) -> None:
        writer.write(encode_response(status, payload, keep=keep, headers=headers, head=head))
        await asyncio.wait_for(writer.drain(), _WRITE_TIMEOUT_S)

    @staticmethod
    async def _linger(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """After an error answer to a request not read to its end: stop writing and drop what
        the client still sends for a while, so closing does not reset the connection (a TCP RST
        would discard the answer before the client reads it). Nothing read is kept."""
        if writer.can_write_eof():
            writer.write_eof()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + _LINGER_S
        while (left := deadline - loop.time()) > 0:
            if not await asyncio.wait_for(reader.read(1 << 16), left):
                return

    # -- routing ------------------------------------------------------------------------------

    async def dispatch(self, method: str, target: str, body: bytes) -> _Response:
        """Answer one API request: ``(status, JSON-able body)`` (for tests and tools)."""
        status, payload, _ = await self._answer(Request(method, target, "HTTP/1.1", body=body))
        return status, payload

    async def _call(self, handler: Callable[..., Awaitable[_Response]], args: tuple[str, ...],
                    body: bytes) -> _Response:
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

    async def _check_listen(self, listen: str) -> None:
        """400 unless ``listen`` is a ``host:port`` that resolves, and a loopback address when
        this server does not allow others (checked again when the proxy binds)."""
        try:
            host, port = split_hostport(listen)
            await listen_address(host or DEFAULT_HOST, port,
                                 loopback_only=not self.allow_remote_listen)
        except AddressError as exc:
            raise ApiError(f"bad listen address: {exc}", 400, field="listen") from None

    @staticmethod
    async def _check_upstream(upstream: str) -> None:
        """400 unless ``upstream`` is a ``host:port`` that resolves now (within a few seconds):
        a typo is refused at once instead of closing every connection later."""
        try:
            host, port = split_hostport(upstream)
            if port == 0:
                raise AddressError(f"{brief(upstream)}: port 0 cannot be connected to")
            await resolve(host or DEFAULT_HOST, port)
        except AddressError as exc:
            raise ApiError(f"bad upstream address: {exc}; expected host:port of the service, "
                           "e.g. 127.0.0.1:6379", 400, field="upstream") from None

    def _new_proxy(self, name: str, listen: str, upstream: str) -> Proxy:
        return Proxy(name, listen, upstream, self.rng, loopback_only=not self.allow_remote_listen)

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
        await self._check_listen(listen)
        await self._check_upstream(upstream)
        proxy = self._new_proxy(name, listen, upstream)
        if enabled:
            await proxy.start()
        self.proxies[name] = proxy
        return 201, proxy.to_json()

    async def populate(self, body: bytes) -> _Response:
        """``POST /populate``: create or replace the proxies of a JSON array."""
        try:
            result = await self.populate_proxies(_body_object(body, "array"))
        except ApiError as exc:
            return exc.status, {**exc.body(), "proxies": None}
        return 201, {"proxies": [p.to_json() for p in result]}

    async def populate_proxies(self, items: list[Any]) -> list[Proxy]:
        """Create or replace the proxies described by ``items`` (``/populate``'s body, also the
        standalone server's ``--config``); every item is checked before anything changes. An
        :class:`ApiError` names the item (``index``, from 1) and its ``field``."""
        wanted: list[tuple[Proxy, bool]] = []
        seen: set[str] = set()
        for i, item in enumerate(items, start=1):
            try:
                wanted.append(await self._populate_item(item, i, seen))
            except ApiError as exc:
                exc.index = i
                raise
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
        return result

    async def _populate_item(self, item: Any, i: int, seen: set[str]) -> tuple[Proxy, bool]:
        if not isinstance(item, dict):
            raise bad_request_body(f"proxy {i} must be a JSON object, got {brief(item)}")
        name = _field(item, "name", str, "")
        upstream = _field(item, "upstream", str, "")
        if not name:
            raise missing_field(f"name at proxy {i}")
        if not upstream:
            raise missing_field(f"upstream at proxy {i}")
        if name in seen:
            raise ApiError(f"duplicate proxy name {brief(name)}", 400, field="name")
        seen.add(name)
        listen = _field(item, "listen", str, "") or format_hostport(DEFAULT_HOST, 0)
        enabled = _field(item, "enabled", bool, True)
        await self._check_listen(listen)
        await self._check_upstream(upstream)
        return self._new_proxy(name, listen, upstream), enabled

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
        if listen != proxy.listen:
            await self._check_listen(listen)
        if upstream != proxy.upstream:
            await self._check_upstream(upstream)
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
        toxicity = parse_toxicity(data.get("toxicity", 1.0) if data.get("toxicity") is not None
                                  else 1.0)
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
            toxicity=parse_toxicity(data["toxicity"] if data.get("toxicity") is not None
                                    else spec.toxicity),
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
