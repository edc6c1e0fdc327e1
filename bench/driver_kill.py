"""`pdserve drill --kill frontend-driver`: what a death of `pdserve serve` itself does.

The frontend process is the Ray driver that owns every worker actor, so its death
takes the workers with it (Ray reaps a dead driver's non-detached actors): every
stream in flight ends with a connection error at once, nothing hangs, no worker
process or KV stays behind, and the cluster is gone until `pdserve serve` is started
again (under systemd or Kubernetes, by its restart policy). This drill shows exactly
that: load, kill the driver, then count how the streams ended and which worker
processes are left.
"""

from __future__ import annotations

import asyncio
import os
import time

import psutil

from bench.drill import _SIGNALS, Admin, drill_prompts
from bench.loadgen import LoadSpec, run_load

_REAP_WAIT_S = 20.0


def run_driver_kill(args) -> int:
    result = asyncio.run(_drill(args))
    for name, value in result.items():
        print(f"{name:<36}{value}")
    passed = result["hung streams"] == 0 and not result["worker processes left"]
    print("PASS (behaved as documented)" if passed else "FAIL")
    return 0 if passed else 1


async def _drill(args) -> dict:
    admin = Admin(args.url.rstrip("/"), args.api_key, args.admin_api_key)
    body = await admin.get("/admin/workers")
    workers = [w["pid"] for w in body["workers"] if w.get("pid")]
    spec = LoadSpec(
        url=admin.url,
        model=args.model or await admin.model(),
        prompts=drill_prompts(args.requests),
        max_tokens=args.max_tokens,
        concurrency=args.concurrency,
        api_key=args.api_key,
        timeout_s=60.0,
    )
    load = asyncio.create_task(run_load(spec))
    await asyncio.sleep(args.at if args.at is not None else 2.0)
    os.kill(body["frontend_pid"], _SIGNALS[args.signal])
    killed = time.perf_counter()
    records = await load
    deadline = time.monotonic() + _REAP_WAIT_S
    while any(psutil.pid_exists(p) for p in workers) and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
    cut = [r for r in records if not r.ok and r.start < killed]
    return {
        "requests": len(records),
        "finished before the kill": sum(1 for r in records if r.ok),
        "streams cut by the kill": len(cut),
        "hung streams": sum(1 for r in records if r.outcome == "timeout"),
        "worker processes left": [p for p in workers if psutil.pid_exists(p)],
    }
