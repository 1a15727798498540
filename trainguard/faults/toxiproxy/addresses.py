"""Addresses of the embedded Toxiproxy: the defaults, ``host:port`` text, resolving and binding.

Toxiproxy writes addresses as Go does (``"host:port"``, ``"[::1]:port"`` for IPv6) and binds one
socket per listener (:func:`bind_listener`), so port 0 gives a single port. Names are resolved
with a deadline (:func:`resolve`), and a listener can be held to loopback addresses
(``loopback_only``): the API has no authentication, so by default nobody may use it to expose a
loopback-only service to the network.
"""

from __future__ import annotations

import asyncio
import ipaddress
import re
import socket
from typing import Any

__all__ = [
    "DEFAULT_HOST",
    "DEFAULT_PORT",
    "RESOLVE_TIMEOUT_S",
    "AddressError",
    "RemoteListenRefused",
    "bind_listener",
    "format_hostport",
    "is_loopback",
    "listen_address",
    "resolve",
    "sockname",
    "split_hostport",
]

#: where the API and a proxy without a host in its ``listen`` bind (Toxiproxy binds every interface)
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8474  # Toxiproxy's default
#: how long a name may take to resolve (a proxy's ``listen`` or ``upstream``)
RESOLVE_TIMEOUT_S = 3.0

_PORT = re.compile(r"[0-9]{1,5}")


class AddressError(ValueError):
    """An address that is malformed or cannot be resolved; the message says which and why."""


class RemoteListenRefused(AddressError):
    """A listener asked on a non-loopback address of a server that only allows loopback."""


def split_hostport(address: str) -> tuple[str, int]:
    """``"host:port"`` (``"[::1]:port"`` for IPv6) -> ``(host, port)``; ValueError when malformed."""
    host, sep, port_text = address.rpartition(":")
    if not sep or not _PORT.fullmatch(port_text):
        raise AddressError(f"{_cut(address)} is not host:port")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    port = int(port_text)
    if port > 65535:
        raise AddressError(f"{_cut(address)}: port {port} is out of range (0-65535)")
    return host, port


def format_hostport(host: str, port: int) -> str:
    """``(host, port)`` -> ``"host:port"`` (``"[host]:port"`` for an IPv6 host)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def is_loopback(host: str) -> bool:
    """Whether ``host``, an IP address as ``getaddrinfo`` gives it, is a loopback address."""
    try:
        ip = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback


async def resolve(host: str, port: int, *, passive: bool = False,
                  timeout: float = RESOLVE_TIMEOUT_S) -> tuple[int, Any]:
    """The ``(family, sockaddr)`` that ``host:port`` names (IPv4 first, as Go's net.Listen and
    Dial try it); :class:`AddressError` when it cannot be resolved within ``timeout`` seconds."""
    loop = asyncio.get_running_loop()
    flags = socket.AI_PASSIVE if passive else 0
    try:
        infos = await asyncio.wait_for(
            loop.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=flags), timeout)
    except asyncio.TimeoutError:
        raise AddressError(f"host {_cut(host)} could not be resolved within {timeout:g} s") from None
    except (OSError, ValueError) as exc:  # gaierror, a NUL byte, an IDNA label too long
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise AddressError(f"host {_cut(host)} cannot be resolved: {reason}") from None
    if not infos:
        raise AddressError(f"host {_cut(host)} has no address")
    family, _, _, _, address = sorted(infos, key=lambda info: info[0] != socket.AF_INET)[0]
    return family, address


async def listen_address(host: str, port: int, *, loopback_only: bool = False) -> tuple[int, Any]:
    """The ``(family, sockaddr)`` a listener on ``host:port`` binds (the first address of
    ``host``, IPv4 first, as Go's net.Listen); :class:`RemoteListenRefused` when ``loopback_only``
    and it is not a loopback address, :class:`AddressError` when ``host`` does not resolve."""
    family, address = await resolve(host, port, passive=True)
    if loopback_only and not is_loopback(str(address[0])):
        raise RemoteListenRefused(
            f"{format_hostport(host, port)} is not a loopback address ({address[0]}): this server "
            "only listens on loopback (127.0.0.1, ::1) since its API has no authentication. "
            "Listen on 127.0.0.1:PORT, or start the server with --allow-remote-listen "
            "(EmbeddedToxiproxy(allow_remote_listen=True)) to serve clients on other hosts"
        )
    return family, address


async def bind_listener(host: str, port: int, *, loopback_only: bool = False) -> socket.socket:
    """A listening socket on :func:`listen_address`: one socket, so port 0 gives one port even
    for a name with several addresses. OSError when it cannot be bound."""
    family, address = await listen_address(host, port, loopback_only=loopback_only)
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


def sockname(sock: socket.socket) -> str:
    """The ``host:port`` a bound socket listens on."""
    name = sock.getsockname()
    return format_hostport(str(name[0]), int(name[1]))


def _cut(value: str, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(value)} characters)"
