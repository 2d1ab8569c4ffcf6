"""Waiting on the queue service's dispatcher instead of sleeping: "nothing started" means something only once
a dispatch pass has looked at the queue."""

from __future__ import annotations

import time


def wait_for_dispatch(service, timeout: float = 30.0) -> None:
    """Return once a dispatch pass that began after this call has ended (`service.passes` counts them).

    Passes run one at a time on one thread, so of the two passes that end after the counter is read, at
    most the first was already under way: the second began after the call and saw everything submitted
    before it.
    """
    target = service.passes + 2
    deadline = time.monotonic() + timeout
    while service.passes < target:
        if time.monotonic() > deadline:
            raise AssertionError(f"no dispatch pass within {timeout}s (the dispatcher is stuck or dead)")
        service.wake()  # do not wait for the next tick
        time.sleep(0.02)
