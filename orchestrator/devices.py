"""Device specs: `auto` (the real GPUs, through NVML or torch), `cpu:N` virtual slots, or a list `0,1,3`."""

from __future__ import annotations

import re

from orchestrator.errors import BadInput


def parse(spec: str) -> list[str]:
    """Device names for a spec. `cpu:2` -> ["cpu:0", "cpu:1"]; `0,2` -> ["0", "2"]; `auto` -> visible GPUs."""
    text = (spec or "").strip()
    if text == "auto":
        gpus = detect_gpus()
        if not gpus:
            raise BadInput("no GPU found (NVML and torch.cuda see none); use --devices cpu:N for N virtual slots")
        return gpus
    match = re.fullmatch(r"cpu:(\d+)", text)
    if match:
        count = int(match.group(1))
        if not 1 <= count <= 1024:
            raise BadInput(f"bad --devices {spec!r}: cpu:N needs 1 <= N <= 1024")
        return [f"cpu:{i}" for i in range(count)]
    if re.fullmatch(r"\d+(,\d+)*", text):
        names = text.split(",")
        if len(set(names)) != len(names):
            raise BadInput(f"bad --devices {spec!r}: a device is listed twice")
        return names
    raise BadInput(f"bad --devices {spec!r}: expected auto, cpu:N or a list of GPU indices like 0,1,3")


def detect_gpus() -> list[str]:
    """Indices of the GPUs on this host, by PCI bus order: NVML first, torch.cuda as a fallback."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            return [str(i) for i in range(pynvml.nvmlDeviceGetCount())]
        finally:
            pynvml.nvmlShutdown()
    except Exception:
        pass
    try:
        import torch

        return [str(i) for i in range(torch.cuda.device_count())]
    except Exception:
        return []


def is_cpu_slot(name: str) -> bool:
    """Whether a device name is a virtual CPU slot (jobs on it see no GPU)."""
    return name.startswith("cpu:")


def cuda_visible(devices: list[str]) -> str:
    """CUDA_VISIBLE_DEVICES for a job's devices: GPU indices, or empty for cpu slots."""
    return ",".join(d for d in devices if not is_cpu_slot(d))
