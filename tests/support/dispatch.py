"""Waiting on the queue service's dispatcher instead of sleeping: "nothing started" means something only once
a dispatch pass has looked at the queue."""

from __future__ import annotations

from tests.orchestrator.helpers import wait_for


def wait_for_dispatch(service, timeout: float = 30.0) -> None:
    """Return once a dispatch pass that began after this call has ended.

    Passes run one at a time on one thread, so of the two passes that end after `service.passes` is read,
    at most the first was already under way: the second began after the call and saw everything submitted
    before it.
    """
    start = service.passes

    def second_pass_done() -> bool:
        if service.passes >= start + 2:
            return True
        service.wake()  # do not wait for the next tick
        return False

    wait_for(second_pass_done, timeout=timeout, what="a dispatch pass after the submits")
