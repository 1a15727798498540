"""The life of a FUSE layer for whoever owns one: mounted where it can be (else why not),
unmounted once its owner is done, the unmount's problem kept.

:class:`FuseMount` is what the owners call: the ``storage``, ``kill_during_save`` and
``disk_full`` faults through :class:`FuseFault` (mounted in ``setup`` over the checkpoint
directory, unmounted in ``teardown``), and the crash-points check (mounted, then unmounted in
its ``finally``). :class:`~trainguard.faults.fusefs.FuseLayer` does the mount itself: the
daemon, the wait, fusermount3, the reaping and Ctrl-C/SIGTERM while it mounts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trainguard.config.fault_params import FaultParams
from trainguard.faults.base import Fault, FaultContext
from trainguard.faults.fusefs import FuseLayer

__all__ = ["FuseFault", "FuseMount"]


class FuseMount:
    """One FUSE layer's life: :meth:`mount` (None, or why not), :meth:`unmount` (idempotent).

    ``layer`` is the layer from the start of its mount on: a signal during the mount still
    reaches :meth:`unmount`; it is None when nothing was mounted. ``problems``: where the
    unmount's problems go (pass the owner's own list to keep them in its order).
    """

    def __init__(self, problems: list[str] | None = None) -> None:
        self.layer: FuseLayer | None = None
        self.problems: list[str] = [] if problems is None else problems

    def mount(self, backing: Path, point: Path, *, policy: str, state_dir: Path,
              unavailable: str | None = None) -> str | None:
        """Mount a ``policy`` layer of ``backing`` at ``point``: None once it is live, else why
        not: ``unavailable`` when given (the owner's :func:`~trainguard.faults.fusefs.
        fuse_unavailable`, nothing is tried) or the daemon's failure to mount."""
        if unavailable is not None:
            return unavailable
        layer = FuseLayer(backing, point, policy=policy, state_dir=state_dir)
        self.layer = layer  # before the mount: a signal during it still reaches unmount()
        try:
            layer.mount()
        except RuntimeError as exc:
            self.layer = None
            return str(exc)
        return None

    def unmount(self) -> str | None:
        """Unmount the layer and stop its daemon, if one was mounted; the problem, if any (also
        added to ``problems``). The layer stays readable (its events) afterwards."""
        if self.layer is None:
            return None
        problem = self.layer.unmount()
        if problem:
            self.problems.append(problem)
        return problem


class FuseFault(Fault):
    """A fault whose job reaches its checkpoint directory through a FUSE layer:
    :meth:`mount_over_checkpoints` in ``setup``; ``teardown`` clears the fault, then unmounts.
    ``problems`` holds the unmount's problem, with the fault's own."""

    def __init__(self, params: FaultParams | None = None, **kwargs: Any) -> None:
        super().__init__(params, **kwargs)
        self.problems: list[str] = []
        self.fuse = FuseMount(self.problems)

    @property
    def layer(self) -> FuseLayer | None:
        """The mounted layer (None: nothing mounted)."""
        return self.fuse.layer

    def mount_over_checkpoints(self, ctx: FaultContext, name: str, *, policy: str,
                               unavailable: str | None) -> str | None:
        """Mount a layer of ``ctx.checkpoint_dir`` at ``ctx.work_dir / name`` and point
        ``ctx.checkpoint_dir`` at it (the job writes through the layer): None, or why not
        (``unavailable``, or the mount's failure), ``ctx`` untouched."""
        why = self.fuse.mount(ctx.checkpoint_dir, ctx.work_dir / name, policy=policy,
                              state_dir=ctx.work_dir, unavailable=unavailable)
        if why is None:
            assert self.fuse.layer is not None  # mounted
            ctx.checkpoint_dir = self.fuse.layer.point
        return why

    def teardown(self) -> None:
        try:
            self.clear()
        finally:
            self.fuse.unmount()
