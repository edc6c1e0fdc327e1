"""Stopping without dropping what is in flight: the frontend's drain.

`pdserve serve` calls `Drain.begin(timeout_s)` on its first SIGTERM or Ctrl-C, as
uvicorn closes its listening socket: from then on `/health` answers 503 `draining`
and a request that still reaches the server (on a connection opened before) is
refused with a 503. Requests in flight run on. `timeout_s` later `cut` is set, and
every request still running ends with a 503 "shutting down" error: in its SSE stream
(an error event, then `[DONE]`) or as its answer. It is closed with reason
`CloseReason.SHUTDOWN`, which aborts it on its workers and frees its KV blocks, before the
workers themselves are stopped.
"""

from __future__ import annotations

import asyncio

from cluster.api.openai_protocol import ApiError


class Drain:
    """One per frontend (`OpenAIHandler.drain`); `begin` once, from the serving loop."""

    def __init__(self) -> None:
        self.started = False
        self._cut: asyncio.Future | None = None

    @property
    def cut(self) -> asyncio.Future:
        """Done when the drain's time is up: what each running request waits on beside
        its own end. Made on first use, on the serving loop."""
        if self._cut is None:
            self._cut = asyncio.get_running_loop().create_future()
        return self._cut

    def begin(self, timeout_s: float) -> None:
        """Called by `pdserve serve`'s first stop signal, on the serving loop."""
        if self.started:
            return
        self.started = True
        asyncio.get_running_loop().call_later(timeout_s, self.cut_now)

    def cut_now(self) -> None:
        """End every running request now (the drain's time is up, or a second signal)."""
        if not self.cut.done():
            self.cut.set_result(None)

    @staticmethod
    def error() -> ApiError:
        return ApiError(
            503,
            "the server is shutting down; send the request again (to another replica)",
            kind="service_unavailable",
            headers={"Retry-After": "1"},
        )
