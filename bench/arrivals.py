"""When requests are sent: a closed loop, an open loop at a rate, or both together.

Closed loop (`--concurrency C`): C requests in flight, a new one as soon as one ends.
Open loop (`--rate R`): send times drawn in advance from an inter-arrival
distribution with mean 1/R, whatever the server does:
  constant  every 1/R seconds
  poisson   exponential gaps (gamma with shape 1)
  gamma     gamma gaps with shape B = --burstiness: B < 1 is burstier than Poisson,
            B > 1 more regular; the mean stays 1/R
Both (`--rate R --concurrency C`): open-loop arrivals, at most C in flight; a request
that arrives while C are in flight waits at the client (its wait is recorded apart
from its latency, which starts when it is sent).
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator
from dataclasses import dataclass

ARRIVALS = ("poisson", "constant", "gamma")


@dataclass(frozen=True)
class ArrivalSpec:
    rate: float | None = None
    """Requests (sessions) per second; None = closed loop."""
    concurrency: int | None = None
    """Most requests in flight; None = unbounded (open loop only)."""
    kind: str = "poisson"
    burstiness: float = 1.0

    def __post_init__(self) -> None:
        if self.rate is None and not self.concurrency:
            raise ValueError("give --concurrency (closed loop), --rate (open loop), or both")
        if self.rate is not None and self.rate <= 0:
            raise ValueError(f"--rate must be positive, got {self.rate}")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"--concurrency must be >= 1, got {self.concurrency}")
        if self.kind not in ARRIVALS:
            raise ValueError(f"--arrival must be one of {ARRIVALS}, got {self.kind!r}")
        if self.burstiness <= 0:
            raise ValueError(f"--burstiness must be positive, got {self.burstiness}")

    @property
    def open_loop(self) -> bool:
        return self.rate is not None

    def describe(self) -> str:
        if not self.open_loop:
            return f"closed loop, concurrency {self.concurrency}"
        shape = f", burstiness {self.burstiness:g}" if self.kind == "gamma" else ""
        cap = f", at most {self.concurrency} in flight" if self.concurrency else ""
        return f"open loop, {self.kind} arrivals at {self.rate:g}/s{shape}{cap}"


def gap_stream(spec: ArrivalSpec, seed: int = 0) -> Iterator[float]:
    """Seconds to wait before each request, without end (the first is 0)."""
    yield 0.0
    if not spec.open_loop:
        yield from itertools.repeat(0.0)
    rng = random.Random(seed)
    mean = 1.0 / spec.rate
    shape = 1.0 if spec.kind == "poisson" else spec.burstiness
    while True:
        yield mean if spec.kind == "constant" else rng.gammavariate(shape, mean / shape)


def inter_arrival_gaps(spec: ArrivalSpec, count: int, seed: int = 0) -> list[float]:
    """`count` gaps; the first request goes at 0, request i at sum(gaps[: i + 1])."""
    return list(itertools.islice(gap_stream(spec, seed), count))


def send_offsets(spec: ArrivalSpec, count: int, seed: int = 0) -> list[float]:
    """Seconds from the start of the run at which each request is due."""
    offsets, now = [], 0.0
    for gap in inter_arrival_gaps(spec, count, seed):
        now += gap
        offsets.append(now)
    return offsets
