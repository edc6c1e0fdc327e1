"""Typed engine errors. Each carries the request id when one is involved.

`kind` names the error class on the wire: workers send it in an `ErrorEvent`, and the
frontend maps it to an HTTP status (invalid_request -> 400, aborted -> the client is
gone, internal -> 500), so no worker-side error has to be guessed from its text.
"""

from __future__ import annotations


class EngineError(Exception):
    """Base class of every error the engine raises on purpose."""

    kind = "internal"

    def __init__(self, message: str, request_id: str | None = None):
        self.request_id = request_id
        self.message = message
        prefix = f"[request {request_id}] " if request_id else ""
        super().__init__(prefix + message)


class InvalidRequestError(EngineError):
    """The request itself is wrong (too long, bad sampling params): a 4xx, not a crash."""

    kind = "invalid_request"


class RequestAbortedError(EngineError):
    """The request was aborted (its client went away) before or while this step ran."""

    kind = "aborted"


class OutOfBlocksError(EngineError):
    """The KV block pool cannot satisfy an allocation; callers check first."""


class ModelLoadError(EngineError):
    """A model directory is missing, incomplete, or of an unsupported architecture."""
