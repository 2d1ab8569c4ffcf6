"""The Python API: what `import orchestrator` (or `import autoresearch`) offers, and what the CLI and the MCP
server call. Jobs (`submit`, `cancel`, `jobs`, `job`, `wait`, `logs`), a service in this process (`serve`),
agent sessions (`start_session`, `session`, `sessions`, the `Session` handle) and results (`leaderboard`,
`experiment`, `experiments`), with typed results (`Job`, `Leaderboard`, `Verdict`, `Event`, `Experiment`) and
one exception for bad input (`BadInput`, carrying the line the CLI prints)."""

from orchestrator.core.errors import BadInput, OrchestratorError
from orchestrator.faces.pyapi.jobapi import cancel, job, jobs, logs, submit, wait
from orchestrator.faces.pyapi.resultapi import Service, experiment, experiments, leaderboard, serve
from orchestrator.faces.pyapi.sessionapi import Session, session, sessions, start_session
from orchestrator.faces.pyapi.types import Entry, Event, Experiment, Job, JobEvent, Leaderboard, Verdict

__all__ = ["submit", "cancel", "jobs", "job", "wait", "logs", "serve", "Service", "start_session", "session",
           "sessions", "Session", "leaderboard", "experiment", "experiments", "Job", "JobEvent", "Leaderboard",
           "Entry", "Event", "Verdict", "Experiment", "BadInput", "OrchestratorError"]
