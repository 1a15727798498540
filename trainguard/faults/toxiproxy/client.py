"""trainguard's own client of the Toxiproxy HTTP API.

It talks to a real Toxiproxy when ``TOXIPROXY_URL`` is set (a staging cluster has one) and to
an :class:`~trainguard.faults.toxiproxy.server.EmbeddedToxiproxy` otherwise (:func:`open_toxiproxy`).
Unlike the PyPI client ``toxiproxy-python`` (0.1.1) it keeps the server's address per instance
(two servers, random ports and pytest-xdist workers coexist), has a timeout on every request,
updates toxics in place, and turns every error answer -- 500 included -- into a
:class:`ToxiproxyError` saying what was asked, what the server answered and what to do.
Plain :mod:`http.client`; no dependency.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import urllib.parse
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from trainguard.errors import TrainguardError
from trainguard.faults.toxiproxy.addresses import format_hostport, split_hostport
from trainguard.faults.toxiproxy.server import EmbeddedToxiproxy

__all__ = ["TOXIPROXY_URL_ENV", "ToxiproxyClient", "ToxiproxyError", "open_toxiproxy"]

#: the environment variable naming a real Toxiproxy's API (the name Toxiproxy's own CLI reads)
TOXIPROXY_URL_ENV = "TOXIPROXY_URL"


class ToxiproxyError(TrainguardError):
    """A Toxiproxy request failed: unreachable server, timeout, or an error answer."""

    def __init__(self, message: str, *, status: int | None = None, body: Any = None) -> None:
        super().__init__(message)
        self.status = status
        self.body = body


class ToxiproxyClient:
    """A client of one Toxiproxy API at ``url`` (e.g. ``http://127.0.0.1:8474``).

    Every method raises :class:`ToxiproxyError` on failure. ``embedded`` says whether the server
    is trainguard's embedded one (its ``/version`` says so) rather than a real Toxiproxy.
    """

    def __init__(self, url: str, *, timeout: float = 10.0, started_here: bool = False) -> None:
        parsed = urllib.parse.urlsplit(url if "://" in url else f"http://{url}")
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise ToxiproxyError(
                f"Toxiproxy URL {url!r} is not an http(s) URL; expected e.g. http://127.0.0.1:8474"
            )
        self.url = f"{parsed.scheme}://{parsed.netloc}"
        self.scheme = parsed.scheme
        self.host = parsed.hostname
        self.port = parsed.port or (443 if parsed.scheme == "https" else 80)
        self.timeout = timeout
        #: True when trainguard started this server for the run (the embedded one)
        self.started_here = started_here

    # -- transport ----------------------------------------------------------------------------

    def request(self, method: str, path: str, body: Any = None, *,
                timeout: float | None = None) -> tuple[int, Any]:
        """Send one request; returns ``(status, decoded JSON or None)`` for 2xx answers."""
        conn_type = (http.client.HTTPSConnection if self.scheme == "https"
                     else http.client.HTTPConnection)
        conn = conn_type(self.host, self.port, timeout=timeout or self.timeout)
        data = None if body is None else json.dumps(body).encode()
        headers = {"User-Agent": "trainguard-toxiproxy-client", "Accept": "application/json"}
        if data is not None:
            headers["Content-Type"] = "application/json"
        what = f"{method} {self.url}{path}"
        try:
            conn.request(method, path, body=data, headers=headers)
            response = conn.getresponse()
            raw = response.read()
            status = response.status
        except TimeoutError:
            raise ToxiproxyError(
                f"{what}: no answer within {timeout or self.timeout:g} s; is the Toxiproxy "
                "server overloaded or stopped?"
            ) from None
        except (OSError, http.client.HTTPException) as exc:
            raise ToxiproxyError(
                f"{what}: cannot reach Toxiproxy ({exc}); start it (toxiproxy-server, or "
                f"`trainguard toxiproxy-server`) or fix {TOXIPROXY_URL_ENV}"
            ) from None
        finally:
            conn.close()
        decoded: Any = None
        if raw.strip():
            try:
                decoded = json.loads(raw)
            except ValueError:
                decoded = raw.decode("utf-8", "replace").strip()
        if status >= 400:
            message = decoded.get("error") if isinstance(decoded, dict) else decoded
            raise ToxiproxyError(f"{what}: Toxiproxy answered {status}: {message}",
                                 status=status, body=decoded)
        return status, decoded

    def _update(self, path: str, body: Any) -> Any:
        # PATCH since Toxiproxy 2.6; older servers only accept POST (405 for PATCH)
        try:
            return self.request("PATCH", path, body)[1]
        except ToxiproxyError as exc:
            if exc.status != 405:
                raise
        return self.request("POST", path, body)[1]

    @staticmethod
    def _quote(name: str) -> str:
        return urllib.parse.quote(name, safe="")

    # -- server -------------------------------------------------------------------------------

    def version(self) -> dict[str, Any]:
        """``{"version": ...}`` (older servers answer plain text: wrapped the same way)."""
        answer = self.request("GET", "/version")[1]
        return answer if isinstance(answer, dict) else {"version": answer}

    @property
    def embedded(self) -> bool:
        """Whether the server is trainguard's embedded Toxiproxy (not a real one)."""
        return "trainguard" in self.version()

    def reset(self) -> None:
        """Enable every proxy and remove every toxic."""
        self.request("POST", "/reset")

    def populate(self, proxies: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        """Create or replace proxies in bulk."""
        answer = self.request("POST", "/populate", list(proxies))[1]
        return list(answer.get("proxies") or [])

    # -- proxies ------------------------------------------------------------------------------

    def proxies(self) -> dict[str, dict[str, Any]]:
        return dict(self.request("GET", "/proxies")[1])

    def create_proxy(self, name: str, upstream: str, *, listen: str = "127.0.0.1:0",
                     enabled: bool = True) -> dict[str, Any]:
        """Create a proxy; its ``listen`` in the answer is the address actually bound."""
        body = {"name": name, "upstream": upstream, "listen": listen, "enabled": enabled}
        return dict(self.request("POST", "/proxies", body)[1])

    def get_proxy(self, name: str) -> dict[str, Any]:
        return dict(self.request("GET", f"/proxies/{self._quote(name)}")[1])

    def update_proxy(self, name: str, **fields: Any) -> dict[str, Any]:
        """Change ``listen``, ``upstream`` and/or ``enabled``."""
        return dict(self._update(f"/proxies/{self._quote(name)}", fields))

    def set_enabled(self, name: str, enabled: bool) -> dict[str, Any]:
        """Enable or disable a proxy (disabling closes its listener and open connections)."""
        return self.update_proxy(name, enabled=enabled)

    def delete_proxy(self, name: str) -> None:
        self.request("DELETE", f"/proxies/{self._quote(name)}")

    def proxy_address(self, proxy: Mapping[str, Any]) -> str:
        """Where a client connects to ``proxy``: its listen address, a wildcard host replaced by
        the API's host (a Toxiproxy on another machine listening on 0.0.0.0)."""
        host, port = split_hostport(str(proxy["listen"]))
        if host in ("", "0.0.0.0", "::"):
            host = self.host
        return format_hostport(host, port)

    # -- toxics -------------------------------------------------------------------------------

    def toxics(self, proxy: str) -> list[dict[str, Any]]:
        return list(self.request("GET", f"/proxies/{self._quote(proxy)}/toxics")[1])

    def add_toxic(self, proxy: str, toxic_type: str, attributes: Mapping[str, Any] | None = None,
                  *, stream: str = "downstream", toxicity: float = 1.0,
                  name: str | None = None) -> dict[str, Any]:
        """Add a toxic (named ``<type>_<stream>`` unless ``name`` is given)."""
        body: dict[str, Any] = {"type": toxic_type, "stream": stream, "toxicity": toxicity,
                                "attributes": dict(attributes or {})}
        if name:
            body["name"] = name
        return dict(self.request("POST", f"/proxies/{self._quote(proxy)}/toxics", body)[1])

    def get_toxic(self, proxy: str, name: str) -> dict[str, Any]:
        return dict(self.request(
            "GET", f"/proxies/{self._quote(proxy)}/toxics/{self._quote(name)}")[1])

    def update_toxic(self, proxy: str, name: str, attributes: Mapping[str, Any] | None = None,
                     *, toxicity: float | None = None) -> dict[str, Any]:
        """Change some attributes and/or the toxicity of a toxic, in place (open connections too)."""
        body: dict[str, Any] = {"attributes": dict(attributes or {})}
        if toxicity is not None:
            body["toxicity"] = toxicity
        return dict(self._update(
            f"/proxies/{self._quote(proxy)}/toxics/{self._quote(name)}", body))

    def remove_toxic(self, proxy: str, name: str) -> None:
        self.request("DELETE", f"/proxies/{self._quote(proxy)}/toxics/{self._quote(name)}")

    def __repr__(self) -> str:
        return f"ToxiproxyClient({self.url!r})"


@contextlib.contextmanager
def open_toxiproxy(url: str | None = None, *, timeout: float = 10.0,
                   allow_remote_listen: bool = False) -> Iterator[ToxiproxyClient]:
    """A client of the real Toxiproxy at ``url`` (default: ``$TOXIPROXY_URL``) or, when neither
    is set, of an embedded one started on a free loopback port and stopped on exit; that one
    lets proxies listen on non-loopback addresses only with ``allow_remote_listen``.

    The client's ``started_here`` says which: True for the embedded server started here.
    """
    url = url or os.environ.get(TOXIPROXY_URL_ENV) or None
    if url:
        client = ToxiproxyClient(url, timeout=timeout)
        try:
            client.version()
        except ToxiproxyError as exc:
            raise ToxiproxyError(
                f"{TOXIPROXY_URL_ENV}={url} does not answer as a Toxiproxy server: {exc}. Start "
                f"Toxiproxy there, or unset {TOXIPROXY_URL_ENV} to use trainguard's embedded one"
            ) from None
        yield client
        return
    embedded = EmbeddedToxiproxy(allow_remote_listen=allow_remote_listen)
    embedded.start()
    try:
        yield ToxiproxyClient(embedded.url, timeout=timeout, started_here=True)
    finally:
        embedded.stop()
