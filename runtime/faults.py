"""Fault injection for drills and tests: make a named check fail on a named device.

The setting is the environment variable ``AUTORESEARCH_FAULTS`` (``runtime.protocol.FAULTS``): a
comma-separated list of ``TARGET:CHECK`` entries. The split is at the *last* colon, so a target may itself
contain one:

    AUTORESEARCH_FAULTS="cpu:1:ecc,0:matmul"     # ECC check fails on cpu slot 1, matmul on GPU 0
    AUTORESEARCH_FAULTS="*:allreduce"            # the all-reduce check fails on every device
    AUTORESEARCH_FAULTS="checkpoint@20:crash"    # the checkpoint writer SIGKILLs its own process
                                                 # after writing step 20's data, before its metadata
    AUTORESEARCH_FAULTS="checkpoint@20:crash-staging"  # ... halfway through the async save's copy of
                                                 # step 20's parameters and optimizer state to host memory

Targets are device names as `runtime.devices.parse_devices` returns them ("cpu:0", "0", "GPU-...", ...), ``host``
for the disk/volume checks, ``*`` for every target, or ``checkpoint@STEP`` for the checkpoint writer. Check names are those in
`runtime.preflight.CHECKS`; an injected fault turns that check's result into ``fail`` with the message
"injected fault (AUTORESEARCH_FAULTS)" without running the real measurement, on that device only. The
service, the CLI and the tests use this to drill quarantine on cpu slots, where no real GPU can fail.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from runtime.protocol import FAULTS

INJECTED = "injected fault (AUTORESEARCH_FAULTS)"


@dataclass(frozen=True)
class Fault:
    """One injected fault: `check` fails on `target` (a device string, ``*``, or ``checkpoint@STEP``)."""

    target: str
    check: str

    def __post_init__(self) -> None:
        if not self.target or not self.check:
            raise ValueError(f"bad fault entry {self.target}:{self.check!r}; expected TARGET:CHECK")


def parse(spec: str | None) -> tuple[Fault, ...]:
    """Parse an ``AUTORESEARCH_FAULTS`` value; empty or None means no faults. Bad entries raise ValueError."""
    if not spec:
        return ()
    faults = []
    for entry in (e.strip() for e in spec.split(",")):
        if not entry:
            continue
        target, sep, check = entry.rpartition(":")
        if not sep:
            raise ValueError(f"bad fault entry {entry!r}; expected TARGET:CHECK, e.g. cpu:1:ecc")
        faults.append(Fault(target.strip(), check.strip()))
    return tuple(faults)


def active(env: dict[str, str] | None = None) -> tuple[Fault, ...]:
    """The faults configured in the environment (read on every call, so tests can change it)."""
    return parse((env if env is not None else os.environ).get(FAULTS))


def injected(target: str, check: str, env: dict[str, str] | None = None) -> bool:
    """True when `check` is set to fail on `target`."""
    return any(f.check == check and f.target in (target, "*") for f in active(env))
