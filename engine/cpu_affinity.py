"""Keep a process's threads on a set of cores (Linux; elsewhere a no-op).

A local CPU cluster gives each worker its own cores (`cluster/core_plan.py`): each
worker pins itself before it builds its engine, so that the OpenMP threads its first
step creates inherit the worker's cores, and once every worker is up the controller
moves the driver and Ray's own processes onto the cores left to them.
"""

from __future__ import annotations

import os
from collections.abc import Iterable


def pinning_supported() -> bool:
    return hasattr(os, "sched_setaffinity") and os.path.isdir("/proc/self/task")


def process_cores() -> tuple[int, ...]:
    """The cores this process's calling thread may run on, sorted."""
    if not hasattr(os, "sched_getaffinity"):
        return tuple(range(os.cpu_count() or 1))
    return tuple(sorted(os.sched_getaffinity(0)))


def pin_process(cores: Iterable[int], pid: int | None = None) -> None:
    """Every thread of process `pid` (default: this one), and every thread or process
    they start later, on `cores`.

    `sched_setaffinity` moves one thread; a thread started later inherits its starter's
    cores, so each thread that exists now is moved by its id. A thread (or the whole
    process) that ends meanwhile is skipped."""
    wanted = set(cores)
    if not wanted or not pinning_supported():
        return
    tasks = f"/proc/{'self' if pid is None else pid}/task"
    try:
        names = os.listdir(tasks)
    except FileNotFoundError:
        return
    for name in names:
        try:
            os.sched_setaffinity(int(name), wanted)
        except (ProcessLookupError, PermissionError):
            continue
