"""Worker processes started ahead of need, so that a restart skips the process start.

A worker's restart is mostly its process's start: Ray starts a Python worker, which
imports torch, transformers and the engine (3-4 s of a core for the demo model), while
building the engine over the memory-mapped weight cache takes ~0.2 s. A prestarted
process has done the first part and
waits with nothing built (no weights mapped, no KV pool). When a worker dies, the
controller's restart takes one of its role (`take`) and activates it as the dead
worker's next generation; a new one is started `standby_restart_delay_s` later
(`refill_later`), so that its imports do not take a core from the requests
recovering on the survivors.

Unlike a `standby_workers` spare, a prestarted process serves nothing until it is
activated: the role is short for the activation's fraction of a second, and the
process costs its interpreter's memory, not a model's. CPU pools only: on a GPU pool
it would hold its GPU idle (`ClusterConfig` refuses that).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Callable
from typing import Any

import ray

StartProcess = Callable[[str, str], Any]
"""(role, actor name) -> the handle of a new prestarted worker actor of that role."""


class PrestartedProcesses:
    """Owned by the controller: `fill` at start, `take` in a restart, `shutdown` last."""

    def __init__(self, per_role: int, start_process: StartProcess):
        self.per_role = per_role
        self._start_process = start_process
        self.waiting: dict[str, list[Any]] = {}
        """Role -> handles of its processes waiting to be taken, oldest first."""
        self._serial = itertools.count()
        self._refills: set[asyncio.Task] = set()

    def fill(self, role: str) -> None:
        """Start processes of `role` until `per_role` of them wait."""
        waiting = self.waiting.setdefault(role, [])
        while len(waiting) < self.per_role:
            name = f"pdserve-prestarted-{role}-{next(self._serial)}"
            waiting.append(self._start_process(role, name))

    def take(self, role: str) -> Any | None:
        """The oldest waiting process of `role` (still importing, perhaps: it is further
        along than a new one), or None; the caller now owns it."""
        waiting = self.waiting.get(role)
        return waiting.pop(0) if waiting else None

    def refill_later(self, role: str, delay_s: float) -> None:
        """Replace a taken process of `role` after `delay_s` (called in the event loop)."""

        async def refill() -> None:
            await asyncio.sleep(delay_s)
            self.fill(role)

        task = asyncio.get_running_loop().create_task(refill())
        self._refills.add(task)
        task.add_done_callback(self._refills.discard)

    def counts(self) -> dict[str, int]:
        """Role -> processes waiting (metrics, `/admin/workers`)."""
        return {role: len(waiting) for role, waiting in self.waiting.items()}

    def shutdown(self) -> None:
        for task in self._refills:
            task.cancel()
        for waiting in self.waiting.values():
            for handle in waiting:
                with contextlib.suppress(Exception):
                    ray.kill(handle, no_restart=True)
        self.waiting.clear()
