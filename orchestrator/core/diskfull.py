"""A full disk, recognised: ENOSPC/EDQUOT or SQLite's "database or disk is full", anywhere in an error's chain
(SQLAlchemy's `orig`, `__cause__`, `__context__`), and the one-line log such an error gets instead of a traceback
(the service and sessions wait a full disk out and go on)."""

from __future__ import annotations

import errno
import logging


def is_disk_full(exc: BaseException) -> bool:
    """Whether an error is a full disk: ENOSPC/EDQUOT, or SQLite's "database or disk is full"."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        text = str(exc).lower()
        if "disk is full" in text or "no space left" in text or "disk quota" in text:
            return True
        exc = getattr(exc, "orig", None) or exc.__cause__ or exc.__context__
    return False


def log_failure(logger: logging.Logger, what: str, exc: BaseException) -> None:
    """Log a failed write: one line when the disk is full (an episode the service or session waits out and
    goes on from), the traceback otherwise."""
    if is_disk_full(exc):
        logger.warning("%s: the disk is full (%s)", what, str(exc).splitlines()[0][:200])
    else:
        logger.error(what, exc_info=exc)
