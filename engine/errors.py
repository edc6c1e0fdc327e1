"""Typed engine errors. Each carries the request id when one is involved."""

from __future__ import annotations


class EngineError(Exception):
    """Base class of every error the engine raises on purpose."""

    def __init__(self, message: str, request_id: str | None = None):
        self.request_id = request_id
        prefix = f"[request {request_id}] " if request_id else ""
        super().__init__(prefix + message)


class InvalidRequestError(EngineError):
    """The request itself is wrong (too long, bad sampling params): a 4xx, not a crash."""


class OutOfBlocksError(EngineError):
    """The KV block pool cannot satisfy an allocation; callers check first."""


class ModelLoadError(EngineError):
    """A model directory is missing, incomplete, or of an unsupported architecture."""
