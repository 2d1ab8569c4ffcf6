"""`import autoresearch`: the Python API under the name the distribution is installed by.

The code's package is `orchestrator` (the service side; the training runtime is `runtime`), but people install
`autoresearch` and reach for that name first, as with `pip install scikit-learn` / `import sklearn` the mismatch
costs every new user a search. This package is only an alias: `autoresearch.submit is orchestrator.submit`, and
nothing else lives here. Names are loaded on first use, as in `orchestrator`.
"""

from __future__ import annotations

import orchestrator

__all__ = list(orchestrator.__all__)


def __getattr__(name: str) -> object:
    return getattr(orchestrator, name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
