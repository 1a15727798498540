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
(``":8080"``) binds 127.0.0.1 too (Toxiproxy would bind every interface), and a proxy asked to
listen on any other than a loopback address is refused (400) unless the server was started with
``allow_remote_listen=True`` (``--allow-remote-listen``): the API has no authentication.

The parts: :mod:`~trainguard.faults.toxiproxy.addresses` (defaults, ``host:port``),
:mod:`~trainguard.faults.toxiproxy.proxy` (listeners, connections, toxic chains),
:mod:`~trainguard.faults.toxiproxy.api` (the HTTP API) and this module (the thread that runs it).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Awaitable, Callable
from typing import Any

from trainguard.faults.toxiproxy.addresses import (
    DEFAULT_HOST,
    format_hostport,
)
from trainguard.faults.toxiproxy.api import ToxiproxyServer

__all__ = [
    "EmbeddedToxiproxy",
]


class EmbeddedToxiproxy:
    """A :class:`ToxiproxyServer` in a background thread with its own event loop.

    >>> with EmbeddedToxiproxy() as server:      # a free port on 127.0.0.1
    ...     client = ToxiproxyClient(server.url)  # or toxiproxy-python, curl, ...

    ``stop()`` (called by ``__exit__``) closes the API, every proxy and every proxied connection
    and joins the thread; it is idempotent. Proxies may listen on loopback addresses only,
    unless ``allow_remote_listen`` (to let clients on other hosts reach them).
    """

    def __init__(self, host: str = DEFAULT_HOST, port: int = 0, *, seed: int | None = None,
                 allow_remote_listen: bool = False) -> None:
        self.server = ToxiproxyServer(host, port, seed=seed,
                                      allow_remote_listen=allow_remote_listen)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None

    @property
    def host(self) -> str:
        """The host the API is bound on."""
        return self.server.host

    @property
    def port(self) -> int:
        """The API's port (the bound one once started)."""
        return self.server.port

    @property
    def url(self) -> str:
        """The API's base URL, e.g. ``http://127.0.0.1:8474``."""
        return f"http://{format_hostport(self.host, self.port)}"

    def start(self, timeout: float = 10.0) -> EmbeddedToxiproxy:
        """Bind and serve; raises OSError when the address cannot be bound, and
        :class:`~trainguard.faults.toxiproxy.addresses.AddressError` (a ValueError) when the host
        does not resolve."""
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
        """Stop the server and join its thread (idempotent)."""
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
