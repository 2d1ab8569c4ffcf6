"""Device names and identity: cpu slots, GPU indices and UUIDs, and which CUDA device a name is.

A device name is what the service was given and what a job's CUDA_VISIBLE_DEVICES carries: a virtual cpu
slot "cpu:0", a physical GPU index "3" (PCI bus order: NVML's numbering, and CUDA's under
CUDA_DEVICE_ORDER=PCI_BUS_ID, which jobs get), or a UUID "GPU-..." / "MIG-..." (a unique prefix is enough,
as for CUDA itself). UUIDs stay UUIDs all the way to the job.

NVML and CUDA may count and order devices differently (a GPU that fell off the bus, MIG, another
CUDA_DEVICE_ORDER), so a name is matched to a CUDA device by UUID (NVML's against
``torch.cuda.get_device_properties(i).uuid``), never by assuming equal indices; a name CUDA does not see
fails loudly instead of landing on another GPU.
"""

from __future__ import annotations

import os
import re

from runtime.errors import PreflightError
from runtime.nvml import Nvml
from runtime.protocol import VISIBLE_DEVICES

_UUID = re.compile(r"(GPU|MIG)-[0-9A-Za-z/-]+")


class DeviceSpecError(PreflightError, ValueError):
    """A --devices value that names no devices (bad syntax, `auto` on a host without GPUs, or GPUs that NVML
    and CUDA_VISIBLE_DEVICES disagree about)."""


def is_cpu(device: str) -> bool:
    """Whether `device` is a virtual CPU slot."""
    return device.startswith("cpu:")


def is_gpu_name(text: str) -> bool:
    """Whether `text` is a GPU name: a physical index or a GPU-/MIG- UUID."""
    return text.isdigit() or bool(_UUID.fullmatch(text))


def normalize_uuid(uuid: str) -> str:
    """A UUID without its GPU-/MIG- prefix, lower case: how NVML's and torch's spellings compare."""
    text = str(uuid).strip().lower()
    for prefix in ("gpu-", "mig-"):
        if text.startswith(prefix):
            return text[len(prefix):]
    return text


def _entries(value: str) -> list[str]:
    return [e.strip() for e in value.split(",") if e.strip()]


def parse_devices(spec: str, *, env: dict[str, str] | None = None, nvml: Nvml | None = None) -> list[str]:
    """"cpu:N" -> ["cpu:0", ..., "cpu:N-1"]; "0,1,3" or "GPU-ab12,GPU-cd34" -> those names; "auto" -> this
    host's GPUs, limited to the service's own CUDA_VISIBLE_DEVICES when it inherited one (its entries, as
    given, become the names). `env` and `nvml` default to this process's environment and a new NVML session."""
    text = (spec or "").strip()
    if text == "auto":
        if nvml is not None and nvml.available:  # the caller's open session: use it, leave it open
            return _auto(os.environ if env is None else env, nvml)
        with nvml or Nvml() as nv:
            return _auto(os.environ if env is None else env, nv)
    if m := re.fullmatch(r"cpu:(\d+)", text):
        if not 1 <= int(m.group(1)) <= 1024:
            raise DeviceSpecError(f"bad devices {spec!r}: cpu:N needs 1 <= N <= 1024")
        return [f"cpu:{i}" for i in range(int(m.group(1)))]
    names = text.split(",")
    if text and all(is_gpu_name(n) for n in names) and len(set(names)) == len(names):
        return names
    raise DeviceSpecError(f"bad devices {spec!r}: expected auto, cpu:N, GPU indices like 0,1,3 or GPU-/MIG- UUIDs")


def _auto(env, nv: Nvml) -> list[str]:
    inherited = env.get(VISIBLE_DEVICES)
    if inherited is not None and not _entries(inherited):
        raise DeviceSpecError(f"{VISIBLE_DEVICES} is empty, so this service may use no GPU; use --devices cpu:N")
    wanted = _entries(inherited) if inherited is not None else None
    known = nv.inventory() if nv.available else None
    if known:
        if wanted is None:
            return [name for name, uuid in known if name.isdigit()]
        for entry in wanted:
            hits = [n for n, uuid in known if entry == n or (not entry.isdigit() and uuid.startswith(entry))]
            if len(hits) != 1:
                seen = ", ".join(f"{n}={u}" for n, u in known if n.isdigit())
                raise DeviceSpecError(f"{VISIBLE_DEVICES} entry {entry!r} matches {len(hits)} of the GPUs NVML "
                                      f"sees ({seen}); fix {VISIBLE_DEVICES} or pass --devices")
        return wanted
    import torch  # no NVML (no driver library or no nvidia-ml-py): ask CUDA

    n = torch.cuda.device_count()
    if not n:
        raise DeviceSpecError("no GPU found (NVML and torch.cuda see none); use --devices cpu:N for N CPU slots")
    if wanted is None:
        return [str(i) for i in range(n)]
    if len(wanted) != n:
        raise DeviceSpecError(f"{VISIBLE_DEVICES}={inherited} names {len(wanted)} GPUs but CUDA sees {n}")
    return wanted


def cuda_index(name: str, nv: Nvml) -> int:
    """The torch.cuda index of device `name` in this process, matched by UUID when NVML is there (else by
    position in CUDA_VISIBLE_DEVICES, else the index itself). Raises DeviceSpecError, one line, when CUDA does
    not see that device: a missing GPU must not silently become another one."""
    import torch

    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if nv.available:
        try:
            want = nv.uuid(name)
        except Exception as exc:
            raise DeviceSpecError(f"GPU {name}: NVML does not know it ({exc})") from None
        have = [normalize_uuid(str(torch.cuda.get_device_properties(i).uuid)) for i in range(n)]
        if normalize_uuid(want) in have:
            return have.index(normalize_uuid(want))
        raise DeviceSpecError(f"GPU {name} ({want}) is not among the {n} CUDA devices this process sees "
                              f"({VISIBLE_DEVICES}={os.environ.get(VISIBLE_DEVICES, '<unset>')})")
    visible = os.environ.get(VISIBLE_DEVICES)
    if visible is not None:
        order = _entries(visible)
        if name not in order:
            raise DeviceSpecError(f"GPU {name} is outside {VISIBLE_DEVICES}={visible}")
        idx = order.index(name)
    elif name.isdigit():
        idx = int(name)
    else:
        raise DeviceSpecError(f"GPU {name}: no NVML to resolve a UUID and no {VISIBLE_DEVICES} to find it in")
    if idx >= n:
        raise DeviceSpecError(f"GPU {name} not visible ({n} CUDA devices)")
    return idx


def job_device(local_rank: int) -> str:
    """The torch device of a job's rank `local_rank`: "cpu" on a cpu slot (CUDA_VISIBLE_DEVICES="") or on a
    host without CUDA when no GPU was assigned; else "cuda:<local_rank>". A rank without its own GPU is an
    error (one line), never wrapped onto another rank's GPU."""
    visible = os.environ.get(VISIBLE_DEVICES)
    if visible is not None and not visible.strip():
        return "cpu"
    import torch

    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if visible is None and n == 0:
        return "cpu"  # run by hand on a host without GPUs
    if local_rank >= n or (visible is not None and len(_entries(visible)) != n):
        raise DeviceSpecError(f"rank {local_rank} has no GPU of its own: CUDA sees {n} device(s) with "
                              f"{VISIBLE_DEVICES}={visible if visible is not None else '<unset>'}")
    return f"cuda:{local_rank}"
