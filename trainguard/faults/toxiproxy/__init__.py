"""A Toxiproxy-compatible TCP proxy (embedded or standalone) and trainguard's client of the API.

See docs/faults-network.md. Use :func:`open_toxiproxy` to get a client of the real Toxiproxy
named by ``TOXIPROXY_URL`` or, without it, of an embedded server started for the occasion.
"""

from __future__ import annotations

from trainguard.faults.toxiproxy.addresses import DEFAULT_HOST, DEFAULT_PORT
from trainguard.faults.toxiproxy.api import API_VERSION, ToxiproxyServer
from trainguard.faults.toxiproxy.client import (
    TOXIPROXY_URL_ENV,
    ToxiproxyClient,
    ToxiproxyError,
    open_toxiproxy,
)
from trainguard.faults.toxiproxy.server import EmbeddedToxiproxy
from trainguard.faults.toxiproxy.toxics import TOXIC_ATTRIBUTES

__all__ = [
    "API_VERSION",
    "DEFAULT_HOST",
    "DEFAULT_PORT",
    "TOXIC_ATTRIBUTES",
    "TOXIPROXY_URL_ENV",
    "EmbeddedToxiproxy",
    "ToxiproxyClient",
    "ToxiproxyError",
    "ToxiproxyServer",
    "open_toxiproxy",
]
