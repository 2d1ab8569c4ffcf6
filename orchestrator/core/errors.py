"""Exceptions of the orchestrator package.

`BadInput` and its subclasses are user errors: the CLI prints their message on one line and exits 2,
having changed nothing. Any other `OrchestratorError` exits 1.
"""


class OrchestratorError(Exception):
    """Base class of every error the orchestrator raises on purpose."""


class BadInput(OrchestratorError):
    """The user asked for something invalid; nothing was changed (CLI exit code 2)."""


class JobNotFound(BadInput):
    """No job has the given id."""

    def __init__(self, job_id: int):
        super().__init__(f"no job with id {job_id}")
        self.job_id = job_id


class InvalidTransition(OrchestratorError):
    """A state change that the job states do not allow (for example, a finished job changing again)."""


class ServiceAlreadyRunning(BadInput):
    """A second service was started on a home that already has one."""


class StoreUnavailable(BadInput):
    """The queue database cannot be reached or opened."""
