"""Device specs for the service: `auto` (the real GPUs NVML sees, within the service's own
CUDA_VISIBLE_DEVICES), `cpu:N` virtual slots, or a list `0,1,3` / `GPU-...,MIG-...`. Parsing and identity are
`runtime.devices` (one definition for jobs, preflight and service)."""

from __future__ import annotations

from orchestrator.core.errors import BadInput


def parse(spec: str) -> list[str]:
    """Device names for a spec. `cpu:2` -> ["cpu:0", "cpu:1"]; `0,2` -> ["0", "2"]; `auto` -> visible GPUs,
    named as the inherited CUDA_VISIBLE_DEVICES names them (UUIDs stay UUIDs). A bad spec, `auto` on a host
    without GPUs, or a CUDA_VISIBLE_DEVICES that NVML cannot match is BadInput (exit 2), one line."""
    from runtime.devices import DeviceSpecError, parse_devices

    try:
        return parse_devices(spec)
    except DeviceSpecError as exc:
        # The runtime's message starts "bad devices 'x': ..."; say which flag once, not "bad --devices: bad devices".
        text = str(exc)
        raise BadInput("bad --devices " + text[len("bad devices "):] if text.startswith("bad devices ")
                       else f"bad --devices: {text}") from None


def is_cpu_slot(name: str) -> bool:
    """Whether a device name is a virtual CPU slot (jobs on it see no GPU)."""
    return name.startswith("cpu:")


def cuda_visible(devices: list[str]) -> str:
    """CUDA_VISIBLE_DEVICES for a job's devices, as the service was given them (indices or UUIDs); empty for
    cpu slots."""
    return ",".join(d for d in devices if not is_cpu_slot(d))
