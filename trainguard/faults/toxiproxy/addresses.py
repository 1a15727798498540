"""Addresses of the embedded Toxiproxy: the defaults, ``host:port`` text, and binding a listener.

Toxiproxy writes addresses as Go does (``"host:port"``, ``"[::1]:port"`` for IPv6) and binds one
socket per listener (:func:`bind_listener`), so port 0 gives a single port.
"""

from __future__ import annotations

import asyncio
import socket

__all__ = [
    "DEFAULT_HOST",
    "DEFAULT_PORT",
    "bind_listener",
    "format_hostport",
    "sockname",
    "split_hostport",
]

#: where the API and a proxy without a host in its ``listen`` bind (Toxiproxy binds every interface)
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8474  # Toxiproxy's default


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
    """``(host, port)`` -> ``"host:port"`` (``"[host]:port"`` for an IPv6 host)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


async def bind_listener(host: str, port: int) -> socket.socket:
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


def sockname(sock: socket.socket) -> str:
    """The ``host:port`` a bound socket listens on."""
    name = sock.getsockname()
    return format_hostport(str(name[0]), int(name[1]))

