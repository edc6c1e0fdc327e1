"""Which machine a worker runs on, so `auto` can tell same-node pairs from cross-node ones.

Senders put `node_id()` in their endpoint at start; receivers compare it with their
own for every ticket. Hostname plus the kernel's boot id: two containers that share a
hostname but not a kernel (and so not /dev/shm) still differ.
"""

from __future__ import annotations

import socket
from functools import cache


@cache
def node_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "unknown-boot"
    return f"{socket.gethostname()}/{boot}"
