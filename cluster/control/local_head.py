"""Starts the private Ray head that `pdserve serve` (and every test cluster) runs on when
no Ray address is given, and starts it again when Ray's own start stalls.

Two stalls have been seen on the 2-core machine, each about once in a few hundred starts
(test suites): a GCS that published no port and wrote no log, and a raylet
that was spawned but never wrote a log nor registered with the GCS (still unregistered
two minutes later, so not slow but stuck). Waiting longer mends neither; a new head
does. Ray leaves the stalled head's processes running when its start raises, so they
are killed here before the next try, after their state is logged for whoever looks.

The head listens on loopback only and asks for Ray's token (cluster/control/ray_access.py).
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path

import psutil
import ray

from cluster.control.ray_access import loopback_node_address, require_token_auth

logger = logging.getLogger(__name__)

POOL_CAPACITY = 64
"""Units of `prefill_pool` and `decode_pool` the local node advertises: more than any
local config places."""
GCS_PORT_WAIT_ENV = "RAY_gcs_server_port_wait_time_s"
GCS_PORT_WAIT_S = "60"
"""How long a local `ray.init` waits for its GCS to come up, unless the operator set it."""
BOOT_HOOK = "engine.cpu_affinity.pin_at_boot"
"""Runs in each worker process before its imports: a worker boots on its own cores."""
START_ATTEMPTS = 3
"""Local heads started before giving up."""
STALLED_START_SIGNS = (
    "gcs_server_port",  # the GCS never published its port
    "timed out during startup",  # the raylet never registered (Ray's wait is fixed at 30 s)
)


def start_local_head(namespace: str) -> None:
    """Called by the controller before it places any worker, in the driver process,
    after the core plan has moved that process onto its cores (so Ray's processes
    inherit them)."""
    os.environ.setdefault(GCS_PORT_WAIT_ENV, GCS_PORT_WAIT_S)
    for attempt in range(1, START_ATTEMPTS + 1):
        require_token_auth()
        try:
            with loopback_node_address() as node_address:
                ray.init(
                    namespace=namespace,
                    num_cpus=os.cpu_count(),
                    resources={"prefill_pool": POOL_CAPACITY, "decode_pool": POOL_CAPACITY},
                    runtime_env={"worker_process_setup_hook": BOOT_HOOK},
                    include_dashboard=False,
                    log_to_driver=False,
                    **node_address,
                )
            return
        except Exception as exc:
            if not _is_stalled_start(exc) or attempt == START_ATTEMPTS:
                raise
            logger.warning(
                "Ray's local head stalled starting (%s); starting a new one (%d of %d)",
                exc,
                attempt + 1,
                START_ATTEMPTS,
            )
            _kill_stalled_head(exc)
            ray.shutdown()


def local_head_pids() -> list[int]:
    """Every process of the local head this driver started: Ray's own (GCS, raylet,
    agents, monitors) and the worker processes the raylet spawned (ours among them, idle
    ones too). Empty when this process started no head."""
    node = getattr(ray._private.worker, "_global_node", None)
    if node is None or not ray.is_initialized():
        return []
    roots = [info.process.pid for infos in node.all_processes.values() for info in infos]
    return _with_descendants(roots)


def _with_descendants(roots: list[int]) -> list[int]:
    """`roots` and every process below them, from one pass over the process table (the
    metrics scrape calls this; a `children()` call per root would walk it per root)."""
    children: dict[int, list[int]] = {}
    for proc in psutil.process_iter(["ppid"]):
        children.setdefault(proc.info["ppid"], []).append(proc.pid)
    found, pending = [], list(roots)
    while pending:
        pid = pending.pop()
        found.append(pid)
        pending += children.get(pid, [])
    return found


def _is_stalled_start(exc: Exception) -> bool:
    return any(sign in str(exc) for sign in STALLED_START_SIGNS)


def _kill_stalled_head(exc: Exception) -> None:
    """Ray raises out of its Node constructor and keeps no reference to the node, so the
    node is found in the traceback's frames. Its processes' own children (the agents a
    raylet starts) are killed too: a raylet killed early in its start leaves them
    running for minutes."""
    node = _node_in_traceback(exc)
    if node is None:
        logger.warning("the stalled head's processes were not found; they run until exit")
        return
    children = []
    for process_type, infos in node.all_processes.items():
        for info in infos:
            logger.warning("stalled head: %s %s", process_type, _process_state(info.process.pid))
            children += _children(info.process.pid)
    node.kill_all_processes(check_alive=False, allow_graceful=False, wait=True)
    for child in children:
        with contextlib.suppress(psutil.Error):
            child.kill()
    psutil.wait_procs(children, timeout=5)


def _children(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def _node_in_traceback(exc: BaseException):
    from ray._private.node import Node

    traceback = exc.__traceback__
    while traceback is not None:
        candidate = traceback.tb_frame.f_locals.get("self")
        if isinstance(candidate, Node):
            return candidate
        traceback = traceback.tb_next
    return None


def _process_state(pid: int) -> str:
    """pid, run state, the kernel function it waits in and the system call it is in (the
    number first, as /proc shows it): what tells a stuck process from a slow one."""
    proc = Path(f"/proc/{pid}")
    try:
        state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
        wchan = (proc / "wchan").read_text() or "-"
    except OSError:
        return f"pid {pid} (gone)"
    try:
        syscall = (proc / "syscall").read_text().split()[0]
    except OSError:  # other users' processes, or no permission to trace
        syscall = "?"
    return f"pid {pid} state {state} waiting in {wchan} (system call {syscall})"
