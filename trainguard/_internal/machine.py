"""This machine: its identity (the directory of its baselines, the facts stored with them) and
the accelerators this process can see, without importing torch when it can be avoided."""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import os
import platform
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TypedDict

__all__ = ["GpuInventory", "MachineInfo", "gpu_inventory", "machine_id", "machine_info"]


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
    if count is None and "torch" not in sys.modules and _no_gpu_driver():
        count, how = 0, "no GPU driver (no /proc/driver/nvidia/gpus, /dev/nvidia0 or /dev/kfd)"
    if count is None:
        try:
            import torch
        except ImportError:
            return GpuInventory(0, "neither nvidia-ml-py nor torch is installed")
        count, how = torch.cuda.device_count(), "torch.cuda.device_count()"
    if limit is not None and count > limit:
        count, how = limit, f"{how}, limited by CUDA_VISIBLE_DEVICES={visible!r}"
    return GpuInventory(count, how)


def _no_gpu_driver() -> bool:
    """On Linux: no NVIDIA driver and no ROCm device, so torch would count no GPU either (and
    importing it to ask takes seconds of one core)."""
    if not sys.platform.startswith("linux"):
        return False
    nvidia = Path("/proc/driver/nvidia/gpus")
    return not (nvidia.is_dir() and any(nvidia.iterdir())) and not Path("/dev/nvidia0").exists() \
        and not Path("/dev/kfd").exists()


def machine_id() -> str:
    """``<system>-<python implementation>-<major.minor>-<cpu arch>``, e.g.
    ``Linux-CPython-3.11-x86_64``: the directory of this machine's baselines (pytest-benchmark's
    scheme, with the CPU architecture for the bitness)."""
    major, minor, _ = platform.python_version_tuple()
    parts = (platform.system() or "unknown", platform.python_implementation(), f"{major}.{minor}",
             platform.machine() or "unknown")
    return "-".join(re.sub(r"[^A-Za-z0-9_.]+", "_", p) for p in parts)


def _cpu_model() -> str | None:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or None


class MachineInfo(TypedDict):
    """What :func:`machine_info` knows about this machine (JSON: a baseline's ``machine_info``,
    a profile report's ``machine``)."""

    id: str
    node: str
    system: str
    release: str
    machine: str
    cpu: str | None
    cpu_count: int | None
    python: str
    python_implementation: str
    torch: str | None


def machine_info() -> MachineInfo:
    """What is known about this machine, stored in each baseline (informational)."""
    info: MachineInfo = {
        "id": machine_id(),
        "node": platform.node(),
        "system": platform.system(),
        "release": platform.release(),
        "machine": platform.machine(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "python_implementation": platform.python_implementation(),
        "torch": None,
    }
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
        info["torch"] = importlib.metadata.version("torch")
    return info
