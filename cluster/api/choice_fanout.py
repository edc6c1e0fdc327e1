"""The choices of one HTTP request, run together: `n` per prompt, every prompt of a
batched completions request.

Each choice is its own `ClusterRequest` (own id, own seed: the request's seed + its
index within the prompt), admitted with the others. Their streams are merged into one
stream of (choice index, chunk). The first choice of a prompt leads; its siblings start
once the leader's KV sits in the prefix caches they will hit: after its second chunk,
which comes from the decode worker once the import landed (or after it finished).
So, with prefix caching, the prompt's full blocks are computed once on the prefill
worker and moved once to the decode worker; each sibling computes only the prompt's
last, partial block (at least one token must be computed to sample from) and moves
only that block. Without a prefix cache the siblings simply prefill again.

Whatever ends the merged stream (all done, one failed, the client went away), every
choice is closed, the ones never started included, exactly once (their owners'
`close` is idempotent).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from cluster.flow.request import CloseReason, ClusterRequest, GenerationChunk

_DONE = object()
MAX_QUEUED_CHUNKS = 64
"""Chunks the merged stream holds for its reader; past it the choices wait, and the
decode streams behind them fill up and hold their requests (cluster/flow/decode_streams.py)."""
_LEADER_READY_AFTER = 2
"""Chunks of the leader after which its KV is on the decode worker (the first comes
from the prefill worker, the second from decode once the import landed)."""


class ChoiceFanout:
    """Created by the frontend per HTTP request; `stream` is iterated once."""

    def __init__(
        self,
        reqs: list[ClusterRequest],
        choices_per_prompt: int,
        run: Callable[[ClusterRequest], AsyncIterator[GenerationChunk]],
    ):
        self.reqs = reqs
        self.n = choices_per_prompt
        self.run = run
        """`PDCluster.run`, or a wrapper that maps its errors (it closes each request)."""
        self._tasks: list[asyncio.Task] = []
        self._room = asyncio.Event()
        """Set whenever the reader takes a chunk: a choice waiting for room may go on."""

    async def stream(self) -> AsyncIterator[tuple[int, GenerationChunk]]:
        queue: asyncio.Queue = asyncio.Queue()
        for leader in range(0, len(self.reqs), self.n):
            siblings = range(leader + 1, leader + self.n)
            self._start(leader, queue, lambda s=siblings: [self._start(i, queue) for i in s])
        remaining = len(self.reqs)
        try:
            while remaining:
                index, item = await queue.get()
                self._room.set()
                if item is _DONE:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield index, item
        finally:
            await self.close(CloseReason.CANCELLED)

    async def close(self, reason: CloseReason) -> None:
        """Stop every choice still running and close every one (idempotent)."""
        for task in self._tasks:
            task.cancel()
        for req in self.reqs:
            req.close(reason)
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def _start(self, index: int, queue: asyncio.Queue, on_ready=None) -> None:
        self._tasks.append(asyncio.ensure_future(self._pump(index, queue, on_ready)))

    async def _pump(self, index: int, queue: asyncio.Queue, on_ready) -> None:
        seen = 0
        try:
            async for chunk in self.run(self.reqs[index]):
                seen += 1
                while queue.qsize() >= MAX_QUEUED_CHUNKS:
                    self._room.clear()
                    await self._room.wait()
                queue.put_nowait((index, chunk))
                if on_ready is not None and (seen == _LEADER_READY_AFTER or chunk.finished):
                    on_ready, ready = None, on_ready
                    ready()
            if on_ready is not None:
                on_ready()  # a leader that ended without a token: its siblings still run
        except Exception as exc:  # the merged stream raises it, and closes every choice
            queue.put_nowait((index, exc))
        finally:
            queue.put_nowait((index, _DONE))
