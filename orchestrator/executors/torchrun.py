"""torchrun for multi-device jobs, with the exit code a single process would give the queue.

`python -m orchestrator.executors.torchrun ARGS` takes torchrun's own arguments. torchrun turns any rank's
failure into exit 1, so a rank asking to be requeued (exit 75, EX_TEMPFAIL) would spend an attempt: here a
rank's 75 becomes the job's 75, another failure gives the first failed rank's code (128+N when a signal
killed it), and a SIGTERM/SIGINT that stopped torchrun gives 128+N, as a shell reports it.
"""

from __future__ import annotations

import sys
from typing import Optional

from runtime.protocol import EX_TEMPFAIL


def exit_code(failures: dict) -> int:
    """The job's exit code from torchrun's failed ranks (`ChildFailedError.failures`: rank -> failure)."""
    codes = [f.exitcode for _, f in sorted(failures.items(), key=lambda kv: getattr(kv[1], "timestamp", 0))]
    if EX_TEMPFAIL in codes:
        return EX_TEMPFAIL
    first = codes[0] if codes else 1
    return 128 - first if first < 0 else (first or 1)


def main(argv: Optional[list[str]] = None) -> int:
    """Run torchrun with `argv`; returns the job's exit code."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    try:
        torchrun(argv)
    except ChildFailedError as exc:
        return exit_code(exc.failures)
    except SignalException as exc:
        return 128 + int(exc.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
