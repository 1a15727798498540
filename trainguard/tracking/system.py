"""What tracking records about the machine: system metrics, the environment, the git state.

The writer thread samples :func:`system_metrics` into every launch run while its processes are
alive; :func:`environment_snapshot` and :func:`git_tags` describe a session run. None of these
imports torch or mlflow.
"""

from __future__ import annotations

import contextlib
import platform
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from trainguard._internal.gitstate import git_state
from trainguard._version import __version__

__all__ = ["environment_snapshot", "git_tags", "system_metrics"]


_PSUTIL_PRIMED = False


def system_metrics() -> dict[str, float]:
    """CPU and RSS of this process tree (trainguard + its ranks), and GPUs when pynvml works."""
    global _PSUTIL_PRIMED
    out: dict[str, float] = {}
    try:
        import psutil

        out["system/cpu_percent"] = psutil.cpu_percent(None)
        if not _PSUTIL_PRIMED:  # the first cpu_percent(None) call has no interval to measure
            _PSUTIL_PRIMED = True
            del out["system/cpu_percent"]
        me = psutil.Process()
        rss = me.memory_info().rss
        for child in me.children(recursive=True):
            with contextlib.suppress(psutil.Error):
                rss += child.memory_info().rss
        out["system/rss_mb"] = rss / 2**20
        out["system/memory_percent"] = psutil.virtual_memory().percent
    except Exception:
        pass
    out.update(_gpu_metrics())
    return out


#: pynvml once initialised (None: not tried yet; False: unavailable here, never retried)
_NVML: Any = None


def _nvml() -> Any:
    """pynvml, initialised once per process (NVML stays initialised: it is reference counted
    and cheap to keep; initialising it per sample is not), or None without it or a driver."""
    global _NVML
    if _NVML is None:
        try:
            import pynvml  # type: ignore[import-not-found,unused-ignore]

            pynvml.nvmlInit()
            _NVML = pynvml
        except Exception:
            _NVML = False
    return _NVML or None


def _gpu_metrics() -> dict[str, float]:
    """Per GPU: utilization %, memory used (MB), power (W), temperature (C), via pynvml."""
    nvml = _nvml()
    if nvml is None:
        return {}
    out: dict[str, float] = {}
    try:
        count = nvml.nvmlDeviceGetCount()
    except Exception:
        return out
    for i in range(count):
        try:
            h = nvml.nvmlDeviceGetHandleByIndex(i)
        except Exception:
            continue
        with contextlib.suppress(Exception):
            out[f"system/gpu{i}/utilization_percent"] = float(nvml.nvmlDeviceGetUtilizationRates(h).gpu)
        with contextlib.suppress(Exception):
            out[f"system/gpu{i}/memory_mb"] = nvml.nvmlDeviceGetMemoryInfo(h).used / 2**20
        with contextlib.suppress(Exception):
            out[f"system/gpu{i}/power_w"] = nvml.nvmlDeviceGetPowerUsage(h) / 1000.0
        with contextlib.suppress(Exception):
            out[f"system/gpu{i}/temperature_c"] = float(nvml.nvmlDeviceGetTemperature(h, 0))
    return out


def git_tags(directory: Path) -> dict[str, str]:
    """``git.commit`` and ``git.dirty`` of the repository holding ``directory`` (empty when it is
    not in one or git is missing); dirty as everywhere else (:func:`trainguard._internal.gitstate.git_state`)."""
    state = git_state(directory)
    if state.commit is None:
        return {}
    tags = {"git.commit": state.commit, "mlflow.source.git.commit": state.commit}
    if state.dirty is not None:
        tags["git.dirty"] = "true" if state.dirty else "false"
    return tags


def environment_snapshot() -> dict[str, Any]:
    """Python, torch, CUDA, NCCL, GPU models and installed packages. torch is not imported for
    this: its version comes from package metadata and the CUDA version it was built with from
    its ``version.py`` (or from torch itself when already imported); NCCL from torch when
    imported, else the ``nvidia-nccl-*`` wheel torch depends on; GPU models from pynvml (or
    ``nvidia-smi``) when present."""
    import importlib.metadata as md

    dists = {d.metadata["Name"]: d.version for d in md.distributions() if d.metadata["Name"]}
    packages = sorted({f"{name}=={version}" for name, version in dists.items()}, key=str.lower)
    snap: dict[str, Any] = {
        "python": sys.version.split()[0],
        "python_executable": sys.executable,
        "platform": platform.platform(),
        "trainguard": __version__,
        "torch": None,
        "cuda": None,
        "nccl": None,
        "gpus": [],
        "packages": packages,
    }
    with contextlib.suppress(md.PackageNotFoundError):
        snap["torch"] = md.version("torch")
    torch = sys.modules.get("torch")
    if torch is not None:
        snap["cuda"] = getattr(torch.version, "cuda", None)
        with contextlib.suppress(Exception):
            snap["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    elif snap["torch"] is not None:
        snap["cuda"] = _torch_built_with_cuda()
    if snap["nccl"] is None:
        snap["nccl"] = next((v for n, v in sorted(dists.items()) if n.lower().startswith("nvidia-nccl")), None)
    nvml = _nvml()
    if nvml is not None:
        with contextlib.suppress(Exception):
            snap["gpus"] = [
                _text(nvml.nvmlDeviceGetName(nvml.nvmlDeviceGetHandleByIndex(i)))
                for i in range(nvml.nvmlDeviceGetCount())
            ]
        with contextlib.suppress(Exception):
            snap["cuda_driver"] = nvml.nvmlSystemGetCudaDriverVersion()
        with contextlib.suppress(Exception):
            snap["nvidia_driver"] = _text(nvml.nvmlSystemGetDriverVersion())
    elif shutil.which("nvidia-smi"):
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=10, check=True).stdout
            snap["gpus"] = [line.strip() for line in out.splitlines() if line.strip()]
    return snap


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _torch_built_with_cuda() -> str | None:
    """The CUDA version torch was built with, read from ``torch/version.py`` (no torch import)."""
    import importlib.util
    import re

    with contextlib.suppress(Exception):
        spec = importlib.util.find_spec("torch")
        if spec is not None and spec.submodule_search_locations:
            text = (Path(next(iter(spec.submodule_search_locations))) / "version.py").read_text()
            found = re.search(r"^cuda\s*(?::[^=]*)?=\s*['\"]([^'\"]+)['\"]", text, re.MULTILINE)
            return found.group(1) if found else None
    return None
