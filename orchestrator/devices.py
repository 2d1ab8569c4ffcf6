"""Device specs for the service: `auto` (the real GPUs, through NVML or torch), `cpu:N` virtual slots, or a
list `0,1,3`. Parsing is `runtime.preflight.parse_devices` (one definition for jobs, preflight and service)."""

from __future__ import annotations

from orchestrator.errors import BadInput


def parse(spec: str) -> list[str]:
    """Device names for a spec. `cpu:2` -> ["cpu:0", "cpu:1"]; `0,2` -> ["0", "2"]; `auto` -> visible GPUs.
    A bad spec, or `auto` on a host without GPUs, is BadInput (exit 2) that suggests `cpu:N`."""
    from runtime.preflight import DeviceSpecError, parse_devices

    try:
        return parse_devices(spec)
    except DeviceSpecError as exc:
        raise BadInput(f"bad --devices: {exc}") from None


def is_cpu_slot(name: str) -> bool:
    """Whether a device name is a virtual CPU slot (jobs on it see no GPU)."""
    return name.startswith("cpu:")


def cuda_visible(devices: list[str]) -> str:
    """CUDA_VISIBLE_DEVICES for a job's devices: GPU indices, or empty for cpu slots."""
    return ",".join(d for d in devices if not is_cpu_slot(d))
