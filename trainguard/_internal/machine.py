"""What accelerators this process can see, without importing torch when it can be avoided."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
from dataclasses import dataclass

__all__ = ["GpuInventory", "gpu_inventory"]


@dataclass(frozen=True)
class GpuInventory:
    """How many CUDA devices are usable and how that was found out (for skip reasons)."""

    count: int
    how: str


def gpu_inventory() -> GpuInventory:
    """Count usable CUDA devices.

    ``CUDA_VISIBLE_DEVICES`` limits what a process may use; NVML (``pynvml`` from
    nvidia-ml-py) counts the devices without initializing CUDA; torch is asked only when NVML
    is not installed (or torch is already imported anyway).
    """
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    limit: int | None = None
    if visible is not None:
        # CUDA stops at the first invalid entry: "0,-1,1" exposes only device 0
        limit = 0
        for entry in visible.split(","):
            entry = entry.strip()
            if not entry or entry == "-1":
                break
            limit += 1
        if limit == 0:
            return GpuInventory(0, f"CUDA_VISIBLE_DEVICES={visible!r} hides every device")
    count: int | None = None
    how = ""
    if "torch" not in sys.modules and importlib.util.find_spec("pynvml") is not None:
        import pynvml

        try:
            pynvml.nvmlInit()
            try:
                count, how = pynvml.nvmlDeviceGetCount(), "NVML"
            finally:
                with contextlib.suppress(Exception):
                    pynvml.nvmlShutdown()
        except pynvml.NVMLError as exc:
            count, how = 0, f"NVML unavailable ({exc})"
    if count is None:
        try:
            import torch
        except ImportError:
            return GpuInventory(0, "neither nvidia-ml-py nor torch is installed")
        count, how = torch.cuda.device_count(), "torch.cuda.device_count()"
    if limit is not None and count > limit:
        count, how = limit, f"{how}, limited by CUDA_VISIBLE_DEVICES={visible!r}"
    return GpuInventory(count, how)
