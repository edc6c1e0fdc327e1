"""The controller's decisions about dead, restarted and spare workers, against fake
actor handles (no Ray): stale failures, the restart budget, standby take-over, restarts
into prestarted processes."""

from __future__ import annotations

import asyncio
import time

import pytest

from cluster.config import ClusterConfig, ConfigError
from cluster.control.controller import Controller
from cluster.control.core_plan import plan_cores
from cluster.control.worker_info import WorkerInfo
from cluster.flow.router import Router
from worker.messages import HealthReport


class FakeHandle:
    def __init__(self, worker_id: str):
        self.report = HealthReport(
            worker_id, "decode", queue_depth=0, free_blocks=8, total_blocks=8, num_running=0,
            num_waiting=0, num_threads=1, pid=1,
        )  # fmt: skip
        self.check_health = self
        self.wait_until_stopped = self

    def remote(self):
        future = asyncio.get_running_loop().create_future()
        future.set_result(self.report)
        return future


def controller_with(*workers: WorkerInfo, **config) -> Controller:
    controller = Controller(ClusterConfig.from_dict({"max_restarts": 3, **config}))
    for worker in workers:
        worker.handle = FakeHandle(worker.worker_id)
        controller.workers[worker.worker_id] = worker
    controller._restart = _no_restart  # the restart itself needs Ray; recorded, not run
    return controller


async def _no_restart(worker: WorkerInfo, delay_s: float = 0.0) -> None:
    worker.restart_delay_s = delay_s


def test_a_stale_failure_of_an_old_generation_does_not_kill_its_replacement():
    async def main():
        worker = WorkerInfo("decode-0", "decode", handle=None, generation=2)
        controller = controller_with(worker)
        controller.mark_dead(worker, "a call to the old actor failed", generation=1)
        assert worker.alive and not controller.restart_tasks
        controller.mark_dead(worker, "this actor died", generation=2)
        assert not worker.alive and "decode-0" in controller.restart_tasks
        await controller.restart_tasks["decode-0"]
        assert worker.restart_delay_s == 0  # no spare in its place: restarted at once

    asyncio.run(main())


def test_a_healthy_period_restores_the_restart_budget():
    async def main():
        worker = WorkerInfo("decode-0", "decode", handle=None, recent_restarts=3)
        controller = controller_with(worker, restart_budget_reset_s=300.0)
        worker.alive_since = time.monotonic() - 10
        assert await controller.probe(worker)
        assert worker.recent_restarts == 3  # healthy, but not for long enough yet
        worker.alive_since = time.monotonic() - 301
        assert await controller.probe(worker)
        assert worker.recent_restarts == 0

    asyncio.run(main())


def test_a_standby_takes_a_dead_workers_place_at_once():
    async def main():
        active = WorkerInfo("decode-0", "decode", handle=None)
        spare = WorkerInfo("decode-1", "decode", handle=None, standby=True)
        controller = controller_with(active, spare, decode={"workers": 1}, standby_workers=1)
        router = Router("least_loaded", controller.workers)
        assert router.pick("decode").worker is active
        controller.mark_dead(active, "killed", generation=active.generation)
        assert not spare.standby
        await controller.restart_tasks["decode-0"]
        assert active.restart_delay_s == controller.config.standby_restart_delay_s
        claim = router.pick("decode")
        assert claim.worker is spare
        claim.release()
        assert controller._at_strength("decode")

    asyncio.run(main())


def test_only_a_crash_loop_uses_up_the_restart_budget():
    """A generation that dies young counts; one that served healthy for
    `restart_budget_reset_s` gives the budget back when it dies, probed or not."""

    async def main():
        worker = WorkerInfo("decode-0", "decode", handle=None, recent_restarts=3)
        controller = controller_with(worker, restart_budget_reset_s=20.0)
        worker.alive_since = time.monotonic() - 21
        controller.mark_dead(worker, "killed after serving", generation=worker.generation)
        assert worker.recent_restarts == 0
        young = WorkerInfo("decode-1", "decode", handle=None, recent_restarts=2)
        controller.workers[young.worker_id] = young
        young.handle = FakeHandle(young.worker_id)
        young.alive_since = time.monotonic() - 2
        controller.mark_dead(young, "died right after its start", generation=young.generation)
        assert young.recent_restarts == 2

    asyncio.run(main())


class FakeProcess(FakeHandle):
    """A prestarted process: `activate(spec)` builds it as `spec.worker_id`."""

    def __init__(self, name: str):
        super().__init__(name)
        self.activated_as = None
        self.activate = self

    def remote(self, spec=None):
        if spec is not None:
            self.activated_as = spec.worker_id
        return super().remote()


def test_a_restart_takes_a_prestarted_process_and_replaces_it_later():
    async def main():
        worker = WorkerInfo("decode-0", "decode", handle=None, generation=1)
        controller = controller_with(
            worker, decode={"workers": 1}, prestarted_workers=1, standby_restart_delay_s=0.05
        )
        started: list[FakeProcess] = []

        def start_process(role: str, name: str) -> FakeProcess:
            started.append(FakeProcess(name))
            return started[-1]

        controller.prestarted._start_process = start_process
        controller._spawn = lambda w: pytest.fail("a new process was started, not taken")
        controller.prestarted.fill("decode")
        assert controller.prestarted.counts() == {"decode": 1}
        waiting = started[0]
        controller.mark_dead(worker, "killed", generation=1)
        await controller._next_generation(worker)
        assert worker.handle is waiting and waiting.activated_as == "decode-0"
        assert worker.generation == 2 and worker.alive
        assert controller.prestarted.counts() == {"decode": 0}  # not refilled at once
        await asyncio.sleep(0.2)
        assert controller.prestarted.counts() == {"decode": 1} and len(started) == 2

    asyncio.run(main())


def test_prestarted_processes_are_for_cpu_pools_only():
    with pytest.raises(ConfigError, match="standby_workers"):
        ClusterConfig(prestarted_workers=1, gpus_per_worker=1)


def test_each_worker_gets_its_own_cores_prefill_first():
    plan = plan_cores(ClusterConfig(threads_per_worker=1), (0, 1))  # not this machine's
    assert plan.workers == {"prefill-0": (0,), "decode-0": (1,)}
    assert plan.others == (1,)  # no core is left over: the decode worker's
    wide = plan_cores(
        ClusterConfig.from_dict(
            {"prefill": {"workers": 2}, "decode": {"workers": 1}, "threads_per_worker": 2}
        ),
        tuple(range(8)),
    )
    assert wide.workers == {"prefill-0": (0, 1), "prefill-1": (2, 3), "decode-0": (4, 5)}
    assert wide.others == (6, 7)


@pytest.mark.parametrize(
    "settings",
    [
        dict(pin_cores=False),
        dict(mode="colocated"),
        dict(gpus_per_worker=1.0),
        dict(address="ray://head:10001"),
        dict(standby_workers=1),
        # 4 threads, 2 cores
        dict(prefill={"workers": 2}, decode={"workers": 2}, threads_per_worker=1),
    ],
    ids=["off", "colocated", "gpu", "joined", "spares", "more-threads-than-cores"],
)
def test_no_core_plan_where_it_cannot_hold(settings):
    assert plan_cores(ClusterConfig.from_dict(settings), (0, 1)) is None
