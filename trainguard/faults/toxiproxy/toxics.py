"""Toxics of the Toxiproxy-compatible proxy: their attributes and what each does to a stream.

A proxied connection has two links, ``upstream`` (client -> upstream server) and ``downstream``
(upstream server -> client). Each link reads chunks from its source and sends every chunk through
the stages of its direction's toxics, in the order the toxics were added, then writes what comes
out to its destination. A stage is one toxic on one link: it rolls its ``toxicity`` when it
starts (so a toxicity of 0.5 affects about half of the connections, as in Toxiproxy) and is
interrupted when its toxic is updated (it then restarts with the new attributes and a new roll)
or removed. Semantics follow Toxiproxy's ``toxics/*.go``:

=============  =====================================================================================
latency        each chunk leaves ``latency`` ms (+/- ``jitter`` ms) after it was read
bandwidth      at most ``rate`` KB/s (1 KB = 1000 bytes); ``rate: 0`` lets nothing through
slow_close     the end of the stream (FIN) is passed on ``delay`` ms late
timeout        data is dropped; the connection is closed after ``timeout`` ms, never when 0.
               Removing the toxic closes the connections it was on (as Toxiproxy does)
reset_peer     on the first data (or end of stream), wait ``timeout`` ms, then reset the
               connection: both sockets closed with ``SO_LINGER`` 0, so both peers get a TCP RST
slicer         chunks are cut into pieces of ``average_size`` +/- ``size_variation`` bytes,
               ``delay`` microseconds apart
limit_data     the connection is closed once ``bytes`` bytes went through this link
noop           nothing (Toxiproxy registers it too)
=============  =====================================================================================
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, TypedDict

__all__ = [
    "DIRECTIONS",
    "TOXIC_ATTRIBUTES",
    "ApiError",
    "Chunk",
    "ErrorBody",
    "Stage",
    "ToxicJson",
    "ToxicSpec",
    "brief",
    "make_stage",
    "parse_attributes",
    "parse_toxicity",
]

#: every toxic type and its integer attributes, in Toxiproxy's JSON order
TOXIC_ATTRIBUTES: Mapping[str, tuple[str, ...]] = {
    "noop": (),
    "latency": ("latency", "jitter"),
    "bandwidth": ("rate",),
    "slow_close": ("delay",),
    "timeout": ("timeout",),
    "reset_peer": ("timeout",),
    "slicer": ("average_size", "size_variation", "delay"),
    "limit_data": ("bytes",),
}

DIRECTIONS = ("upstream", "downstream")


class ErrorBody(TypedDict):
    """Toxiproxy's error body, as the API answers it."""

    error: str
    status: int


class ToxicJson(TypedDict):
    """A toxic as the API shows it (``GET /proxies/{name}/toxics``)."""

    attributes: dict[str, int]
    name: str
    type: str
    stream: str
    toxicity: float


class ApiError(Exception):
    """An error answered by the API as ``{"error": message, "status": status}``; ``field`` names
    the request's key it is about and ``index`` the item of a ``/populate`` list (from 1), when
    known."""

    def __init__(self, message: str, status: int, *, field: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.field = field
        self.index: int | None = None

    def body(self) -> ErrorBody:
        return {"error": self.message, "status": self.status}


# Toxiproxy's error values (api.go), reused so messages match the real server's
def bad_request_body(detail: str, *, field: str | None = None) -> ApiError:
    return ApiError(f"bad request body: {detail}", 400, field=field)


def missing_field(detail: str) -> ApiError:
    return ApiError(f"missing required field: {detail}", 400)


PROXY_NOT_FOUND = ("proxy not found", 404)
PROXY_EXISTS = ("proxy already exists", 409)
INVALID_STREAM = ("stream was invalid, can be either upstream or downstream", 400)
INVALID_TOXIC_TYPE = ("invalid toxic type", 400)
TOXIC_EXISTS = ("toxic already exists", 409)
TOXIC_NOT_FOUND = ("toxic not found", 404)


#: Toxiproxy's attributes are Go int64s and its toxicity a float32: values outside are refused
_INT64 = (-(1 << 63), (1 << 63) - 1)
_FLOAT32_MAX = 3.4028234663852886e38


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def brief(value: Any, limit: int = 60) -> str:
    """``repr(value)`` cut to ``limit`` characters, for messages that echo what a client sent."""
    if _is_int(value) and value.bit_length() > 200:
        return f"a {len(str(abs(value)))}-digit integer"
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def parse_toxicity(value: Any) -> float:
    """A toxic's ``toxicity`` from a request: a finite number (a float32 in Toxiproxy); values
    above 1 always apply and below 0 never, as in Toxiproxy. 400 ``bad request body`` otherwise."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if ok and _is_int(value):
        ok = abs(value) <= _FLOAT32_MAX
    if ok:
        number = float(value)
        ok = number == number and abs(number) <= _FLOAT32_MAX  # not NaN, not infinite
    if not ok:
        raise bad_request_body("toxicity must be a finite number (the share of connections affected, "
                               f"0 to 1), got {brief(value)}",
                               field="toxicity")
    return number


def parse_attributes(
    toxic_type: str, raw: Any, base: Mapping[str, int] | None = None
) -> dict[str, int]:
    """The attributes of a ``toxic_type`` toxic from a request's ``attributes`` object.

    Missing attributes keep ``base`` (an update) or 0 (a new toxic); unknown keys are ignored,
    as Go's JSON decoding does; a non-integer value is a 400 ``bad request body``.
    """
    names = TOXIC_ATTRIBUTES[toxic_type]
    attrs = {name: int((base or {}).get(name, 0)) for name in names}
    if raw is None:
        return attrs
    if not isinstance(raw, dict):
        raise bad_request_body(
            f"attributes must be a JSON object, got {type(raw).__name__} {brief(raw)}",
            field="attributes",
        )
    for name in names:
        if name in raw:
            value = raw[name]
            if not _is_int(value) or not _INT64[0] <= value <= _INT64[1]:
                raise bad_request_body(
                    f"attribute {name!r} of a {toxic_type} toxic must be an integer from "
                    f"{_INT64[0]} to {_INT64[1]}, got {brief(value)}",
                    field=f"attributes.{name}",
                )
            attrs[name] = value
    return attrs


@dataclass
class ToxicSpec:
    """One toxic of a proxy, as the API shows it."""

    name: str
    type: str
    stream: str  # as the client spelled it (Toxiproxy keeps it); ``direction`` is normalised
    direction: Literal["upstream", "downstream"]
    toxicity: float
    attributes: dict[str, int] = field(default_factory=dict)

    def to_json(self) -> ToxicJson:
        return {
            "attributes": dict(self.attributes),
            "name": self.name,
            "type": self.type,
            "stream": self.stream,
            "toxicity": self.toxicity,
        }


@dataclass
class Chunk:
    """Bytes read from a link's source at ``ts`` (loop time); ``data=None`` is the end of stream."""

    data: bytes | None
    ts: float


class LinkControl(Protocol):
    """What a stage may do to the connection its link belongs to."""

    def close_connection(self) -> None:
        """Close both sockets of the connection (FIN), after what was already written."""

    def reset_connection(self) -> None:
        """Close both sockets with SO_LINGER 0: both peers get a TCP RST."""


class Stage:
    """One toxic running on one link (see the module docstring)."""

    def __init__(self, spec: ToxicSpec, link: LinkControl, rng: random.Random) -> None:
        self.spec = spec
        self.link = link
        self.rng = rng
        self.active = rng.random() < spec.toxicity
        self.interrupted = False
        self._waiter: asyncio.Future[bool] | None = None

    @property
    def attrs(self) -> dict[str, int]:
        return self.spec.attributes

    def start(self) -> None:
        """Called once the stage is in its link's chain (timers start here)."""

    def inherit(self, previous: Stage) -> None:
        """Take the per-connection state of the stage this one replaces (a toxic update)."""

    def interrupt(self) -> None:
        """Stop toxifying: a pending wait ends now and later chunks pass through untouched."""
        self.interrupted = True
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(False)

    def cleanup(self) -> None:
        """The toxic was removed (after :meth:`interrupt`)."""

    async def sleep(self, seconds: float) -> bool:
        """Wait ``seconds``; False when interrupted first."""
        if self.interrupted:
            return False
        if seconds <= 0:
            return True
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[bool] = loop.create_future()
        handle = loop.call_later(seconds, _resolve, waiter, True)
        self._waiter = waiter
        try:
            return await waiter
        finally:
            handle.cancel()
            self._waiter = None

    async def sleep_until(self, deadline: float) -> bool:
        """Wait until loop time ``deadline`` to within a few tens of microseconds; False when
        interrupted first.

        epoll's timeout has millisecond resolution, rounded up, so a loop timer fires up to 1 ms
        late; the timer is set ``_SPIN_S`` early and the rest is waited by yielding to the loop.
        """
        if not await self.sleep(deadline - _now() - _SPIN_S):
            return False
        while _now() < deadline:
            if self.interrupted:
                return False
            await asyncio.sleep(0)
        return True

    async def process(self, chunk: Chunk) -> AsyncIterator[Chunk]:
        """The chunks to pass on for ``chunk`` (may wait, split, drop or end the connection)."""
        if not self.active or self.interrupted:
            yield chunk
            return
        async for out in self.toxify(chunk):
            yield out

    async def toxify(self, chunk: Chunk) -> AsyncIterator[Chunk]:
        yield chunk


_SPIN_S = 0.0015


def _resolve(waiter: asyncio.Future[bool], value: bool) -> None:
    if not waiter.done():
        waiter.set_result(value)


def _now() -> float:
    return asyncio.get_running_loop().time()


class Latency(Stage):
    async def toxify(self, chunk: Chunk) -> AsyncIterator[Chunk]:
        if chunk.data is None:
            yield chunk
            return
        delay = self.attrs["latency"]
        jitter = self.attrs["jitter"]
        if jitter > 0:
            delay += self.rng.randrange(2 * jitter) - jitter
        # relative to when the chunk was read, so queued chunks do not add up their delays
        await self.sleep_until(chunk.ts + delay / 1000.0)
        # a later latency toxic counts from now: chained latencies add up, as in Toxiproxy
        yield Chunk(chunk.data, _now())


class Bandwidth(Stage):
    def __init__(self, spec: ToxicSpec, link: LinkControl, rng: random.Random) -> None:
        super().__init__(spec, link, rng)
        self.debt = 0.0  # seconds of sending time owed, carried between chunks

    async def toxify(self, chunk: Chunk) -> AsyncIterator[Chunk]:
        data = chunk.data
        if data is None:
            yield chunk
            return
        rate = self.attrs["rate"]
        if rate <= 0:
            # Toxiproxy sends nothing at rate 0 until the toxic is updated or removed
            while await self.sleep(3600.0):
                pass
            yield chunk
            return
        self.debt += len(data) / (rate * 1000.0)
        piece = rate * 100  # what may go in 100 ms
        while len(data) > piece:
            if not await self.sleep(0.1):
                yield Chunk(data, chunk.ts)
                return
            yield Chunk(data[:piece], chunk.ts)
            data = data[piece:]
            self.debt -= 0.1
        started = _now()
        await self.sleep(self.debt)
        self.debt -= _now() - started  # timers overshoot: the next chunk makes up for it
        yield Chunk(data, chunk.ts)


class SlowClose(Stage):
    async def toxify(self, chunk: Chunk) -> AsyncIterator[Chunk]:
        if chunk.data is None:
            await self.sleep(self.attrs["delay"] / 1000.0)
        yield chunk


class Timeout(Stage):
    def __init__(self, spec: ToxicSpec, link: LinkControl, rng: random.Random) -> None:
        super().__init__(spec, link, rng)
        self._timer: asyncio.TimerHandle | None = None

    def start(self) -> None:
        timeout = self.attrs["timeout"]
        if self.active and timeout > 0:
            loop = asyncio.get_running_loop()
            self._timer = loop.call_later(timeout / 1000.0, self.link.close_connection)

    def interrupt(self) -> None:
        super().interrupt()
        if self._timer is not None:
            self._timer.cancel()

    def cleanup(self) -> None:
        # Toxiproxy's TimeoutToxic.Cleanup closes the stub: removing it ends the connection
        self.link.close_connection()

    async def toxify(self, chunk: Chunk) -> AsyncIterator[Chunk]:
        if chunk.data is None:
            yield chunk
        # data is dropped on the floor
        return


class ResetPeer(Stage):
    async def toxify(self, chunk: Chunk) -> AsyncIterator[Chunk]:
        # once triggered, Toxiproxy's reset is not interruptible
        await asyncio.sleep(max(self.attrs["timeout"], 0) / 1000.0)
        self.link.reset_connection()
        return
        yield chunk  # pragma: no cover - makes this an async generator


class Slicer(Stage):
    def _cuts(self, start: int, end: int) -> list[int]:
        average = max(self.attrs["average_size"], 1)
        variation = min(max(self.attrs["size_variation"], 0), average - 1)
        if (end - start) - average <= variation:
            return [start, end]
        mid = start + (end - start) // 2
        if variation > 0:
            mid += self.rng.randrange(2 * variation) - variation
        return self._cuts(start, mid) + self._cuts(mid, end)

    async def toxify(self, chunk: Chunk) -> AsyncIterator[Chunk]:
        data = chunk.data
        if data is None:
            yield chunk
            return
        cuts = self._cuts(0, len(data))
        delay = self.attrs["delay"] / 1_000_000.0
        for i in range(1, len(cuts), 2):
            yield Chunk(data[cuts[i - 1]:cuts[i]], chunk.ts)
            if not await self.sleep(delay):
                if cuts[i] < len(data):
                    yield Chunk(data[cuts[i]:], chunk.ts)
                return


class LimitData(Stage):
    def __init__(self, spec: ToxicSpec, link: LinkControl, rng: random.Random) -> None:
        super().__init__(spec, link, rng)
        self.transmitted = 0

    def inherit(self, previous: Stage) -> None:
        if isinstance(previous, LimitData):
            self.transmitted = previous.transmitted

    async def toxify(self, chunk: Chunk) -> AsyncIterator[Chunk]:
        if chunk.data is None:
            yield chunk
            return
        remaining = max(self.attrs["bytes"] - self.transmitted, 0)
        data = chunk.data[:remaining]
        if data:
            self.transmitted += len(data)
            yield Chunk(data, chunk.ts)
        if self.attrs["bytes"] - self.transmitted <= 0:
            self.link.close_connection()


_STAGES: Mapping[str, Callable[[ToxicSpec, LinkControl, random.Random], Stage]] = {
    "noop": Stage,
    "latency": Latency,
    "bandwidth": Bandwidth,
    "slow_close": SlowClose,
    "timeout": Timeout,
    "reset_peer": ResetPeer,
    "slicer": Slicer,
    "limit_data": LimitData,
}


def make_stage(spec: ToxicSpec, link: LinkControl, rng: random.Random) -> Stage:
    """A new stage of ``spec`` on ``link`` (rolls its toxicity)."""
    return _STAGES[spec.type](spec, link, rng)
