"""A prefill-side peer process for the KV transfer tests, driven over a pipe.

The test process is the decode side; `Peer` starts this module's `serve` in a real
child process (forkserver, so the heavy imports happen once) that owns a KV pool, a
`BlockAllocator` standing in for the worker's engine, and any number of senders.
Each command is one method call of `PeerState`, answered with its return value or
the exception; the child frees released blocks itself, as a prefill worker would.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import random
import time
import traceback

import torch

from engine.block_manager import BlockAllocator
from engine.kv_cache import KVCachePool, KVLayout
from kv_transfer import TransportOptions, make_sender

LAYOUT = KVLayout("tiny-test", "float32", num_layers=2, num_kv_heads=2, head_dim=16, block_size=8)
POOL_BLOCKS = 64


def split_layout(size: int, rank: int) -> KVLayout:
    """`LAYOUT`'s heads split over `size` ranks: rank `rank`'s."""
    per_rank = LAYOUT.num_kv_heads // size
    return KVLayout(
        **{
            **LAYOUT.as_dict(),
            "num_kv_heads": per_rank,
            "tp_size": size,
            "tp_rank": rank,
            "kv_head_start": rank * per_rank,
            "total_kv_heads": LAYOUT.num_kv_heads,
        }
    )


def random_pool(layout: KVLayout = LAYOUT, num_blocks: int = POOL_BLOCKS, seed: int = 0):
    pool = KVCachePool(layout, num_blocks)
    pool.kv.copy_(torch.randn(pool.kv.shape, generator=torch.Generator().manual_seed(seed)))
    return pool


class PeerState:
    """What lives in the child: pool + allocator (or a whole engine) + senders."""

    def __init__(self, model_dir: str | None = None, device: str = "cpu"):
        self.engine = None
        if model_dir is None:
            self.pool, self.allocator = random_pool(), BlockAllocator(POOL_BLOCKS)
        else:
            from tests.factories import make_engine

            self.engine = make_engine(model_dir, device=device)
            self.pool, self.allocator = self.engine.kv_pool, self.engine.allocator
        self.senders = {}
        self.rank_senders = {}
        """Senders of ranks 1.. of a split pool (`export_split`): their released blocks are
        rank 0's, freed once through its sender."""

    def open_sender(self, key: str, transport: str, options: TransportOptions) -> dict:
        self.senders[key] = make_sender(transport, key, self.pool, options)
        return self.senders[key].endpoint()

    def export_random(self, key: str, request_id: str, num_blocks: int) -> tuple[dict, bytes]:
        """Allocate blocks in a shuffled order (non-contiguous runs) and export them."""
        ids = self.allocator.allocate(num_blocks, request_id)
        random.Random(request_id).shuffle(ids)
        ticket = self.senders[key].export(request_id, ids, num_blocks * LAYOUT.block_size, "peer")
        return ticket.to_dict(), self.pool.read_blocks(ids).numpy().tobytes()

    def prefill_and_export(self, key: str, request_id: str, prompt: list[int], max_tokens: int):
        """Real prompt through the engine; returns ticket, block bytes, expected tokens."""
        from engine.sampling_params import SamplingParams

        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        expected = self.engine.generate([prompt], params)[0].output_token_ids
        self.engine.add_request(request_id, prompt, params, stop_after_prefill=True)
        while self.engine.has_unfinished():
            self.engine.step()

        def export(seq):
            ticket = self.senders[key].export(request_id, seq.block_ids, len(prompt), "decode")
            blocks = self.pool.read_blocks(seq.block_ids).cpu().numpy().tobytes()
            return ticket.to_dict(), blocks, list(seq.output_token_ids)

        ticket, blocks, first = self.engine.export_prefilled(request_id, export)
        return ticket, blocks, first, expected

    def export_split(
        self, key: str, transport: str, options, request_id: str, num_blocks: int, size: int
    ) -> tuple[dict, bytes]:
        """The random pool's KV heads split over `size` rank pools (a tensor-parallel
        prefill worker's), each with a sender of `transport`, and the same blocks exported
        from every rank. Returns rank 0's ticket (the others in its shards) and the blocks'
        bytes as the unsplit pool holds them."""
        ids = self.allocator.allocate(num_blocks, request_id)
        tickets = []
        for rank in range(size):
            layout = split_layout(size, rank)
            pool = KVCachePool(layout, POOL_BLOCKS)
            name = key if rank == 0 else f"{key}.rank{rank}"
            sender = make_sender(transport, name, pool, options)  # shm re-homes the pool
            heads = layout.kv_heads
            pool.kv.copy_(self.pool.kv[:, :, :, :, heads.start : heads.stop])
            (self.senders if rank == 0 else self.rank_senders)[name] = sender
            tokens = num_blocks * LAYOUT.block_size
            tickets.append(sender.export(request_id, ids, tokens, "peer"))
        ticket = tickets[0].with_shards(tickets[1:])
        return ticket.to_dict(), self.pool.read_blocks(ids).numpy().tobytes()

    def ack(self, key: str, request_id: str) -> None:
        self.senders[key].ack(request_id)
        for name, sender in self.rank_senders.items():
            if name.startswith(f"{key}.rank"):
                sender.ack(request_id)

    def abort(self, key: str, request_id: str) -> None:
        self.senders[key].abort(request_id)

    def free_released(self) -> int:
        for sender in self.rank_senders.values():
            sender.poll_released()
        freed = 0
        for sender in self.senders.values():
            for ids in sender.poll_released():
                self.allocator.free(ids)
                freed += len(ids)
        return freed

    def wait_all_free(self, timeout_s: float = 5.0) -> int:
        """Poll like an engine loop until every block is back; returns blocks still used."""
        deadline = time.monotonic() + timeout_s
        while self.allocator.num_used and time.monotonic() < deadline:
            self.free_released()
            time.sleep(0.01)
        self.free_released()
        return self.allocator.num_used

    def stats(self, key: str):
        return self.senders[key].stats()

    def close_sender(self, key: str) -> None:
        self.senders.pop(key).close()


def serve(conn, model_dir: str | None, device: str = "cpu") -> None:
    state = PeerState(model_dir, device)
    conn.send(("ok", None))
    while True:
        method, args = conn.recv()
        if method == "exit":
            return
        try:
            conn.send(("ok", getattr(state, method)(*args)))
        except Exception as exc:
            conn.send(("error", f"{exc!r}\n{traceback.format_exc()}"))


_CONTEXT = None


def _context():
    global _CONTEXT
    if _CONTEXT is None:
        _CONTEXT = mp.get_context("forkserver")
        _CONTEXT.set_forkserver_preload(["tests.kv_transfer_peer", "kv_transfer.registry"])
    return _CONTEXT


class PeerDied(RuntimeError):
    pass


class Peer:
    """Handle on one child process; `peer.call("method", *args)` runs it there."""

    def __init__(
        self, model_dir: str | None = None, start_timeout_s: float = 60.0, device: str = "cpu"
    ):
        ctx = _context()
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=serve, args=(child, model_dir, device), daemon=True)
        self.process.start()
        child.close()
        self._answer(start_timeout_s)

    def call(self, method: str, *args, timeout_s: float = 60.0):
        self.conn.send((method, args))
        return self._answer(timeout_s)

    def _answer(self, timeout_s: float):
        if not self.conn.poll(timeout_s):
            raise TimeoutError("peer did not answer")
        try:
            status, value = self.conn.recv()
        except EOFError:
            raise PeerDied(f"peer exited with {self.process.exitcode}") from None
        if status == "error":
            raise RuntimeError(value)
        return value

    def close(self) -> None:
        if self.process.is_alive():
            with contextlib.suppress(OSError):
                self.conn.send(("exit", ()))
            self.process.join(5)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)
