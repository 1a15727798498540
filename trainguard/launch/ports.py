"""Rendezvous ports: a fresh one per attempt, never handed to two launchers at once.

The kernel's ephemeral port (bind to 0) is unique at the moment of the bind, but it is free
again once we close the probe socket. Under pytest-xdist two workers could then pick the same
port. A reservation file per port (created with O_EXCL, holding our pid) closes that window
across processes; a reservation whose pid is gone is stale and taken over.
"""

from __future__ import annotations

import contextlib
import os
import socket
import tempfile
from pathlib import Path

from trainguard._internal.pids import pid_alive

__all__ = ["PortReservation", "reserve_port"]

_DIR = Path(tempfile.gettempdir()) / "trainguard-ports"


class PortReservation:
    """A TCP port reserved for one launch attempt; release() (or ``with``) frees it."""

    def __init__(self, port: int, marker: Path) -> None:
        self.port = port
        self._marker = marker

    def release(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._marker.unlink()

    def __enter__(self) -> PortReservation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"PortReservation(port={self.port})"


def _probe_free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _take(marker: Path) -> bool:
    try:
        fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        try:
            text = marker.read_text().strip()
            if not text:
                return False  # its creator is between the O_EXCL create and writing its pid
            owner = int(text)
        except (OSError, ValueError):
            return False
        if owner and pid_alive(owner):
            return False
        # Stale: its owner died without releasing. Two processes may both see that; renaming
        # is atomic, so only one of them removes the stale file, and O_EXCL then decides.
        aside = marker.with_name(f"{marker.name}.stale.{os.getpid()}")
        try:
            os.rename(marker, aside)
        except FileNotFoundError:
            return False  # someone else took it over first
        with contextlib.suppress(FileNotFoundError):
            aside.unlink()
        return _take(marker)
    with os.fdopen(fd, "w") as handle:
        handle.write(str(os.getpid()))
    return True


def reserve_port(host: str = "127.0.0.1", *, attempts: int = 50) -> PortReservation:
    """Reserve a free TCP port on ``host`` for a rendezvous store.

    The markers live in the temp directory; when it cannot take one (full, read-only), the port
    is only probed free, as torchrun does: a launch never fails on the marker alone."""
    for _ in range(attempts):
        port = _probe_free_port(host)
        marker = _DIR / str(port)
        try:
            _DIR.mkdir(parents=True, exist_ok=True)
            taken = _take(marker)
        except OSError:
            with contextlib.suppress(OSError):
                marker.unlink()  # an empty marker a full disk left behind
            return PortReservation(port, marker)
        if taken:
            return PortReservation(port, marker)
    raise RuntimeError(f"could not reserve a free port on {host} after {attempts} attempts")
