"""Bandwidth cap and added latency of one link, for the TTFT-vs-bandwidth experiments.

Each transport calls `Shaper.start()` once when a transfer's first byte is about to
move and `Shaper.pace(n)` before each piece of `n` bytes, on the side that moves the
bytes (the sender for gRPC and collective, the receiver for shm and local). Pacing
sleeps until the bytes already sent would have taken that long at the cap, so a
transfer of B bytes takes B / cap plus one piece's real time; `piece_bytes` keeps
pieces near 1% of a second's worth so that remainder stays small.
"""

from __future__ import annotations

import time


class Shaper:
    """Per-transfer pacing; create one per transfer (it is not thread-safe)."""

    def __init__(self, bandwidth_bytes_per_s: float | None, added_latency_s: float = 0.0):
        self.bandwidth = bandwidth_bytes_per_s
        self.latency = added_latency_s
        self._start = 0.0
        self._sent = 0

    @property
    def active(self) -> bool:
        return self.bandwidth is not None or self.latency > 0

    def piece_bytes(self, chunk_bytes: int) -> int:
        """Largest piece to plan with: small enough that pacing stays smooth."""
        if self.bandwidth is None:
            return chunk_bytes
        return max(64 << 10, min(chunk_bytes, int(self.bandwidth / 100)))

    def start(self) -> None:
        if self.latency > 0:
            time.sleep(self.latency)
        self._start = time.monotonic()
        self._sent = 0

    def pace(self, nbytes: int) -> None:
        """Block until the link has room for `nbytes` more, then count them as sent."""
        if self.bandwidth is not None:
            due = self._start + self._sent / self.bandwidth
            delay = due - time.monotonic()
            if delay > 0:
                time.sleep(delay)
        self._sent += nbytes

    def finish(self) -> None:
        """Wait out the last piece's share so the whole transfer honours the cap."""
        if self.bandwidth is not None:
            delay = self._start + self._sent / self.bandwidth - time.monotonic()
            if delay > 0:
                time.sleep(delay)
