"""Keep a process's threads on a set of cores (Linux; elsewhere a no-op).

A local CPU cluster gives each worker its own cores (`cluster/control/core_plan.py`). A worker's
process pins itself as it boots, before its imports (`pin_at_boot`, Ray's setup hook
on a local head), and again before it builds its engine, so that the OpenMP threads
its first step creates inherit the worker's cores. Once every worker is up, the
controller moves the driver and Ray's own processes onto the cores left to them.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

BOOT_CORES_ENV = "PDSERVE_BOOT_CORES"
"""Comma-separated cores a worker process pins itself to as it boots (`pin_at_boot`)."""


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


def pin_at_boot() -> None:
    """Ray's `worker_process_setup_hook` on the local head pdserve starts: runs in every
    worker process of the job before its first task, so before a worker actor's class
    (torch and the rest) is imported. A process whose actor names its cores in
    `BOOT_CORES_ENV` boots on them; any other (Ray's idle workers, prestarted
    processes) stays where the raylet started it. A restarted worker thus boots on the
    dead one's idle cores, not on the ones left to Ray, which on a small node are a
    surviving worker's."""
    cores = os.environ.get(BOOT_CORES_ENV)
    if cores:
        pin_process(int(core) for core in cores.split(","))
