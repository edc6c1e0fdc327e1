"""A starting worker yields the CPU to the workers that are serving.

Ray starts every worker process at a raised nice value (its `worker_niceness`, 15),
so that workers never starve Ray's own processes. pdserve keeps that for a worker's
start, the imports and weight loading of a (re)started worker, which on shared cores (a
small machine, or workers packed onto one node) would otherwise take the cores from
the survivors carrying its requests: in the no-spare drills those streams decoded at
half speed until the restart was done. Once its engine is built, before its first
health call is answered, the worker moves to `serving_niceness` (the driver's by
default), so that serving outranks starting.

Called by the worker constructors (`serve_at`), with the value from their `WorkerSpec`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import resource

logger = logging.getLogger(__name__)

_CAP_SYS_NICE = 23


def serve_at(niceness: int | None) -> dict[str, int]:
    """Move every thread of this process to `niceness` (None: stay). Linux keeps one
    nice value per thread; the threads started from the constructor's inherited its
    value. Returns both values for the worker's startup report."""
    at_start = os.getpriority(os.PRIO_PROCESS, 0)
    if niceness is not None and niceness != at_start:
        if niceness < at_start and not _may_lower_to(niceness):
            logger.warning(
                "cannot lower this worker's nice value to %d (no CAP_SYS_NICE): it serves at %d",
                niceness,
                at_start,
            )
        else:
            for task in os.listdir("/proc/self/task"):
                with contextlib.suppress(ProcessLookupError):  # a thread that just ended
                    os.setpriority(os.PRIO_PROCESS, int(task), niceness)
    return {"niceness_at_start": at_start, "niceness_serving": max(thread_niceness())}


def thread_niceness():
    """The nice value of each of this process's threads."""
    for task in os.listdir("/proc/self/task"):
        with contextlib.suppress(ProcessLookupError):
            yield os.getpriority(os.PRIO_PROCESS, int(task))


def _may_lower_to(niceness: int) -> bool:
    """Whether this process may set its nice value down to `niceness`."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NICE)
    if soft != resource.RLIM_INFINITY and 20 - soft <= niceness:
        return True
    try:
        with open("/proc/self/status") as status:
            line = next(row for row in status if row.startswith("CapEff:"))
    except (OSError, StopIteration):
        return False
    return bool(int(line.split()[1], 16) >> _CAP_SYS_NICE & 1)
