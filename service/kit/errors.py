"""The error taxonomy: expected failures of the outside world, typed at the adapter edge.

::

    ExternalError            an API server or the database did not give an expected answer
    ├── Unavailable          no answer at all: refused, reset, timed out, connection lost
    ├── ApiError             an answer, but not the expected one (status, message, Retry-After)
    └── Undecodable          an answer that cannot be read as what it should be (a pod that
                             does not decode): logged and counted where it is read, never acted on

Adapters (``service.kube``, ``service.pg``) catch their libraries' exceptions at the edge and
raise one of these, with the original chained as ``__cause__``. Anything else an adapter raises
is a bug, which the worker loop reports (``engine/controller.py``) and which never leads to a
delete (docs/architecture.md, "Errors").
"""

from __future__ import annotations


class ExternalError(Exception):
    """An expected failure of something outside the process."""


class Unavailable(ExternalError):
    """No answer: the peer refused, reset or dropped the connection, or did not answer in time."""


class ApiError(ExternalError):
    """An answer that was not the expected one. ``status`` is the HTTP status (0: none, e.g. a
    protocol violation); ``retry_after_s`` is how long the server asked us to wait."""

    def __init__(self, status: int, message: str, *, retry_after_s: float | None = None) -> None:
        super().__init__(f"{status}: {message}" if status else message)
        self.status = status
        self.message = message
        self.retry_after_s = retry_after_s


class Undecodable(ExternalError):
    """An answer that came but cannot be read as what the protocol promises (an object that does
    not decode). Never a reason to act: the reader logs and counts it and skips the object."""
