"""The proxies of the embedded Toxiproxy: listeners, proxied connections and their toxic chains.

A :class:`Proxy` listens on its ``listen`` address and joins each client connection to a new
connection to its ``upstream`` by two links (one per direction), each running the data through
the toxic stages of :mod:`trainguard.faults.toxiproxy.toxics`. Toxics added, updated or removed
apply to connections already open, as in Toxiproxy.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import socket
import struct
from typing import Any, Literal

from trainguard.faults.toxiproxy.addresses import (
    DEFAULT_HOST,
    AddressError,
    bind_listener,
    sockname,
    split_hostport,
)
from trainguard.faults.toxiproxy.toxics import (
    DIRECTIONS,
    ApiError,
    Chunk,
    Stage,
    ToxicJson,
    ToxicSpec,
    make_stage,
)

__all__ = ["Direction", "Proxy"]

_READ_SIZE = 256 * 1024
_STREAM_LIMIT = 256 * 1024  # StreamReader pauses the socket above twice this
_QUEUE_CHUNKS = 1024  # chunks a link reads ahead of its toxics (Toxiproxy's latency buffer)
_UPSTREAM_CONNECT_TIMEOUT_S = 10.0
_log = logging.getLogger(__name__)

#: which way data flows through a link: client -> upstream, or upstream -> client
Direction = Literal["upstream", "downstream"]


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
        proxy: Proxy,
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


class Proxy:
    """One named proxy: its listener, its toxic chains and the connections it holds open."""

    def __init__(self, name: str, listen: str, upstream: str, rng: random.Random, *,
                 loopback_only: bool = True) -> None:
        self.name = name
        self.listen = listen
        self.upstream = upstream
        self.enabled = False
        self.rng = rng
        #: refuse to listen on a non-loopback address (the server's ``allow_remote_listen``)
        self.loopback_only = loopback_only
        self.chains: dict[Direction, list[ToxicSpec]] = {"upstream": [], "downstream": []}
        self.connections: set[_Connection] = set()
        self._server: asyncio.Server | None = None
        self._handlers: set[asyncio.Task[Any]] = set()

    def to_json(self) -> dict[str, Any]:
        """The proxy as Toxiproxy's API shows it."""
        return {
            "name": self.name,
            "listen": self.listen,
            "upstream": self.upstream,
            "enabled": self.enabled,
            "toxics": self.toxics_json(),
        }

    def toxics_json(self) -> list[ToxicJson]:
        """Every toxic of the proxy, upstream chain first, as the API shows them."""
        return [spec.to_json() for d in DIRECTIONS for spec in self.chains[d]]  # type: ignore[index]

    def find_toxic(self, name: str) -> ToxicSpec | None:
        """The toxic called ``name`` in either chain, or None."""
        for chain in self.chains.values():
            for spec in chain:
                if spec.name == name:
                    return spec
        return None

    # -- lifecycle ----------------------------------------------------------------------------

    async def start(self) -> None:
        """Listen (no-op when enabled); an :class:`ApiError`: 400 when ``listen`` is malformed,
        does not resolve or is not loopback while only loopback is allowed, 500 (as Toxiproxy)
        when it cannot be bound."""
        if self.enabled:
            return
        try:
            host, port = split_hostport(self.listen)
            sock = await bind_listener(host or DEFAULT_HOST, port, loopback_only=self.loopback_only)
            try:
                self._server = await asyncio.start_server(self._accept, sock=sock,
                                                          limit=_STREAM_LIMIT)
            except BaseException:
                sock.close()
                raise
        except AddressError as exc:
            raise ApiError(f"bad listen address: {exc}", 400, field="listen") from None
        except OSError as exc:
            raise ApiError(f"listen tcp {self.listen}: {exc.strerror or exc}", 500) from None
        self.listen = sockname(sock)
        self.enabled = True

    async def stop(self) -> None:
        """Stop listening and drop every open connection (no-op when disabled)."""
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
        except Exception:  # a bug here drops this connection only, never logged by asyncio
            _log.debug("proxy %s: connection failed", self.name, exc_info=True)
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
            upstream = await asyncio.wait_for(  # no host: this machine, as Go's net.Dial
                asyncio.open_connection(host or DEFAULT_HOST, port, limit=_STREAM_LIMIT),
                _UPSTREAM_CONNECT_TIMEOUT_S,
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
        """Append ``spec`` to its chain, on open connections too."""
        self.chains[spec.direction].append(spec)
        for conn in list(self.connections):
            conn.links[spec.direction].add(spec)

    def update_toxic(self, spec: ToxicSpec) -> None:
        """Replace the toxic of ``spec``'s name, on open connections too."""
        chain = self.chains[spec.direction]
        chain[:] = [spec if s.name == spec.name else s for s in chain]
        for conn in list(self.connections):
            conn.links[spec.direction].replace(spec)

    def remove_toxic(self, spec: ToxicSpec) -> None:
        """Remove ``spec`` from its chain, on open connections too."""
        self.chains[spec.direction] = [s for s in self.chains[spec.direction] if s is not spec]
        for conn in list(self.connections):
            conn.links[spec.direction].remove(spec.name)

    def reset_toxics(self) -> None:
        """Remove every toxic."""
        for chain in list(self.chains.values()):
            for spec in list(chain):
                self.remove_toxic(spec)

