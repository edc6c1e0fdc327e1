"""The clock that worker-side timings read: this process's monotonic clock.

Workers only ever report durations taken on it (see `worker.messages`), never
a time of day, so nodes whose clocks disagree cannot shift a request's phases. Tests
prove it by skewing this clock (`PDSERVE_CLOCK_SKEW_S`) in the worker processes.
"""

from __future__ import annotations

import time

from engine import envs

_SKEW_S = envs.clock_skew_s()


def now() -> float:
    return time.monotonic() + _SKEW_S
