"""The CPU ranks' shared-memory all-reduce (engine/parallel/shm_all_reduce.py): sums
equal to gloo's with the same bits on every rank, call after call through both phases;
what it cannot hold goes to gloo; a dead or aborted peer raises instead of waiting; no
segment outlives the join."""

from __future__ import annotations

import mmap
import subprocess
import sys
import threading

import pytest
import torch
import torch.distributed as dist

from engine.parallel.group import TPGroup
from engine.parallel.shm_all_reduce import (
    LINE,
    SHM_DIR,
    SLOT_BYTES,
    PeerGone,
    ShmAllReduce,
    shm_all_reduce_supported,
)

pytestmark = pytest.mark.skipif(
    not shm_all_reduce_supported("cpu"), reason="needs Linux's /dev/shm on x86-64"
)


def on_ranks(size: int, body) -> dict[int, object]:
    """`body(group)` on `size` ranks, one thread each, joined on one store: each rank's
    return value (an exception is raised in the caller)."""
    store = dist.HashStore()
    results, failures = {}, []

    def rank(r: int) -> None:
        try:
            results[r] = body(TPGroup.join(store, r, size))
        except BaseException as exc:
            failures.append(exc)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    if failures:
        raise failures[0]
    return results


def inputs(rank: int, calls: int, dtype) -> list[torch.Tensor]:
    """Rank `rank`'s tensors: rows of different counts, so the phases see other sizes."""
    generator = torch.Generator().manual_seed(rank)
    return [torch.randn(1 + call % 5, 576, generator=generator).to(dtype) for call in range(calls)]


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sums_equal_gloo_and_every_rank_gets_the_same_bits(size, dtype):
    calls = 12

    def body(group):
        assert group.shm is not None
        mine = inputs(group.rank, calls, dtype)
        through_shm = [group.all_reduce(t.clone()) for t in mine]
        through_gloo = []
        for t in mine:
            t = t.clone()
            group.group.allreduce([t]).wait()
            through_gloo.append(t)
        return through_shm, through_gloo

    results = on_ranks(size, body)
    # Three bf16 terms round differently in another order: a few units of its last place.
    tolerance = {"atol": 2**-6, "rtol": 2**-6} if dtype == torch.bfloat16 else {}
    for call in range(calls):
        expected = sum(inputs(r, calls, torch.float32)[call].to(dtype) for r in range(size))
        for rank in range(size):
            shm, gloo = results[rank][0][call], results[rank][1][call]
            assert torch.equal(shm, results[0][0][call]), (rank, call)
            torch.testing.assert_close(shm, gloo, **tolerance)
            torch.testing.assert_close(shm, expected, **tolerance)
    if size == 2:  # a + b, in either order, is one value: the same bits as gloo's
        assert all(torch.equal(s, g) for s, g in zip(*results[0], strict=True))


def test_a_tensor_larger_than_a_slot_goes_to_gloo():
    rows = SLOT_BYTES // (576 * 4) + 1

    def body(group):
        tensor = torch.full((rows, 576), float(group.rank + 1))
        assert not group.shm.fits(tensor)
        return group.all_reduce(tensor)

    for result in on_ranks(2, body).values():
        assert torch.equal(result, torch.full((rows, 576), 3.0))


def test_the_segment_is_gone_once_every_rank_has_joined():
    before = set(SHM_DIR.glob("pdserve-tp-*"))
    on_ranks(2, lambda group: group.all_reduce(torch.ones(8)))
    assert set(SHM_DIR.glob("pdserve-tp-*")) <= before


def two_rank_segment(tmp_path) -> tuple[ShmAllReduce, ShmAllReduce]:
    """Rank 0's and rank 1's handles on one segment, built without a store."""
    nbytes = 2 * LINE + 2 * 8 + 2 * 2 * SLOT_BYTES
    path = tmp_path / "segment"
    path.write_bytes(b"\0" * nbytes)
    with open(path, "r+b") as file:
        buffer = mmap.mmap(file.fileno(), nbytes)
    return ShmAllReduce(0, 2, buffer, timeout_s=60), ShmAllReduce(1, 2, buffer, timeout_s=60)


def test_a_dead_peer_fails_the_waiting_rank_at_once(tmp_path):
    rank0, rank1 = two_rank_segment(tmp_path)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    rank1._pids[1] = int(dead.stdout)  # rank 1's process has exited
    with pytest.raises(PeerGone, match=r"rank 1 \(pid \d+\) died during all-reduce 1"):
        rank0.all_reduce(torch.ones(4))


def test_an_aborted_group_fails_the_waiting_rank(tmp_path):
    rank0, _ = two_rank_segment(tmp_path)  # rank 1 is alive (this process) but silent
    timer = threading.Timer(0.2, rank0.abort)
    timer.start()
    with pytest.raises(PeerGone, match="aborted"):
        rank0.all_reduce(torch.ones(4))
    timer.join()
