"""ci/gpu.sh's reports: ``facts`` prints what the machine is (versions, the GPU, whether NVML
sees a CUDA process's pid) as JSON; ``summary OUT SECONDS`` turns the phases' JUnit files into
gpu-summary.md and gpu-summary.json under OUT. Standard library and torch only."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

CHILD = "import torch, time; torch.ones(2**28, device='cuda'); print('ready', flush=True); time.sleep(20)"


def _nvml_sees_pid() -> dict[str, Any]:
    """Start a CUDA process and ask NVML for the device's compute processes: trainguard's
    per-process GPU memory needs this pid among them."""
    try:
        import pynvml
    except ImportError:
        return {"nvml": "nvidia-ml-py is not installed"}
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        ready = child.stdout.readline().strip() == "ready"
        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        procs = [(p.pid, p.usedGpuMemory) for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)]
        used = pynvml.nvmlDeviceGetMemoryInfo(handle).used
        util = pynvml.nvmlDeviceGetUtilizationRates(handle).gpu
        return {"child_ready": ready, "child_pid": child.pid, "nvml_processes": procs,
                "nvml_sees_child": any(pid == child.pid for pid, _ in procs),
                "device_used_mb": round(used / 2**20), "utilization_pct": util}
    except Exception as exc:  # a fact to report, not a failure of the script
        return {"nvml_error": f"{type(exc).__name__}: {exc}"}
    finally:
        child.kill()
        child.wait(timeout=10)


def facts() -> dict[str, Any]:
    out: dict[str, Any] = {"python": platform.python_version(), "platform": platform.platform(),
                           "commit": os.environ.get("TRAINGUARD_COMMIT", "")}
    try:
        import torch
    except ImportError:
        return out | {"torch": None}
    out["torch"] = torch.__version__
    out["cuda"] = torch.version.cuda
    out["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    if torch.cuda.is_available():
        out["gpu_memory_mb"] = round(torch.cuda.get_device_properties(0).total_memory / 2**20)
        out["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        out["cudnn"] = torch.backends.cudnn.version()
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
        out["nvidia_smi"] = smi.stdout.strip() or smi.stderr.strip()
        out |= _nvml_sees_pid()
    for name in ("pydantic", "pytest", "xdist", "pynvml", "trainguard"):
        try:
            module = __import__(name)
            out[name] = getattr(module, "__version__", "?")
        except ImportError:
            out[name] = None
    return out


def _cases(out: Path) -> list[dict[str, Any]]:
    cases = []
    for junit in sorted(out.glob("junit-*.xml")):
        phase = junit.stem.removeprefix("junit-")
        for case in ET.parse(junit).getroot().iter("testcase"):
            result, message = "passed", ""
            for tag in ("failure", "error", "skipped"):
                node = case.find(tag)
                if node is not None:
                    result = {"failure": "failed"}.get(tag, tag)
                    message = (node.get("message") or node.text or "").strip().splitlines()[0][:300]
            cases.append({"phase": phase, "test": f"{case.get('classname')}::{case.get('name')}",
                          "result": result, "seconds": round(float(case.get("time") or 0), 1),
                          "message": message})
    return cases


def summary(out: Path, seconds: int) -> int:
    facts_file = out / "facts.json"
    machine = json.loads(facts_file.read_text()) if facts_file.is_file() and facts_file.stat().st_size else {}
    cases = _cases(out)
    counts: dict[str, int] = {}
    for c in cases:
        counts[c["result"]] = counts.get(c["result"], 0) + 1
    data = {"when": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "seconds": seconds, "machine": machine,
            "counts": counts, "tests": cases}
    (out / "gpu-summary.json").write_text(json.dumps(data, indent=2))
    lines = [f"# trainguard GPU tests: {', '.join(f'{n} {k}' for k, n in sorted(counts.items())) or 'none ran'}"
             f" in {seconds} s", ""]
    lines += [f"- {k}: {v}" for k, v in machine.items()]
    lines += ["", "| phase | test | result | s | message |", "|---|---|---|---|---|"]
    lines += [f"| {c['phase']} | {c['test']} | {c['result']} | {c['seconds']} | {c['message']} |" for c in cases]
    (out / "gpu-summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 1 if counts.get("failed") or counts.get("error") or not cases else 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["facts"]:
        print(json.dumps(facts(), indent=2))
    elif sys.argv[1:2] == ["summary"] and len(sys.argv) == 4:
        sys.exit(summary(Path(sys.argv[2]), int(sys.argv[3])))
    else:
        sys.exit("usage: gpu_summary.py facts | summary OUT SECONDS")
