"""autoresearch's service side (queue, scheduling, executors, service, agent, tracking, CLI), and its Python API.

    import orchestrator as ar

    with ar.serve(devices="cpu:2"):
        job = ar.wait(ar.submit(["python", "train.py"], time_limit="5m"))
    session = ar.start_session("digits", proposer="tpe", trials=8)
    print(session.wait().headline)

The names below are loaded on first use (PEP 562), so that `import orchestrator` costs nothing: every
`autoresearch` command imports this package first, and `submit` must stay fast. They live in
`orchestrator.faces.pyapi`; the reference is docs/reference/python-api.md.
"""

from __future__ import annotations

__all__ = ["submit", "cancel", "jobs", "job", "wait", "logs", "serve", "Service", "start_session", "session",
           "sessions", "Session", "leaderboard", "experiment", "experiments", "Job", "JobEvent", "Leaderboard",
           "Entry", "Event", "Verdict", "Experiment", "BadInput", "OrchestratorError"]


def __getattr__(name: str) -> object:
    if name in __all__:
        from orchestrator.faces import pyapi

        value = getattr(pyapi, name)
        globals()[name] = value  # the next look-up is an ordinary attribute
        return value
    raise AttributeError(f"module 'orchestrator' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
