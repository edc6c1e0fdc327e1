"""`pdserve bench transfer`: KV transfer GB/s per transport and size, next to a raw
loopback socket and a memcpy of the same size measured in the same run.

A sender child process (spawned, like a prefill worker) holds a pool of 1 MiB blocks
and exports a request per repetition; this process is the receiver and times
`fetch` only (export and ack are outside the timing). Baselines: the same bytes over
a plain TCP socket from a child process into a preallocated buffer, a memcpy between
two buffers of this process on as many threads as the shm receiver copies with, and
(`pool-memcpy`, shm only) that copy from the same mapped pages of the sender's pool into
the same destination blocks, timed in turn with each shm fetch (`gloo-paired` and
`grpc-paired` are the bare libraries below timed the same way, in turn with each
collective or grpc fetch: on a shared machine a ceiling timed a minute apart from the
fetch can differ from it by a third). Library ceilings, also from a child process into
a preallocated buffer: bare gloo send/recv of the same pieces, each transfer behind the
same pipe round trip as a fetch (`gloo-bare`), and a bare grpcio stream of the same
messages (`grpc-bare`), with none of our code (no registry, no checksums), so each
transport's own overhead reads as transport / ceiling. Optional peers, when installed
(`make peers`): NIXL over UCX and the Mooncake transfer engine over TCP, each reading
the sender child's registered CPU buffer (bench/transfer_peers.py). Each figure is the
best of `--repeats` runs. See docs/kv_transfer.md.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import socket
import statistics
import time
from dataclasses import dataclass, field

from bench.hardware import cpu_model
from bench.transfer_peers import PATHS, installed_peers, measure_peer, peer_problem

MIB = 1 << 20
DEFAULT_TRANSPORTS = "shm,collective,grpc"
TOKEN = "bench-token"


def add_transfer_parser(kinds) -> None:
    """Called by bench/cli.py when the `pdserve bench` parser is built."""
    parser = kinds.add_parser(
        "transfer",
        help="KV transfer GB/s per transport vs raw socket and memcpy, same run",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--transport",
        default=DEFAULT_TRANSPORTS,
        help="comma-separated transports to measure: shm, collective, grpc, local "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--sizes",
        default="1MiB,16MiB,64MiB,256MiB",
        help="comma-separated request sizes, whole MiB (KV of one prompt: 1 MiB blocks); "
        "each size is one export of that many blocks (default: %(default)s)",
    )
    parser.add_argument(
        "--chunk",
        default="4MiB",
        help="the transports' chunk_bytes: largest piece per send / copy; gRPC caps its "
        "messages at 1 MiB below it; bare gloo sends pieces of this size (default: %(default)s)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=5,
        help="timed runs per size and column, after one untimed warm-up; each figure is the "
        "best of them (default: %(default)s)",
    )
    parser.add_argument(
        "--copy-threads",
        type=int,
        default=0,
        help="shm receiver copy lanes (0: this process's torch threads, as in a worker)",
    )
    parser.add_argument(
        "--no-ceilings", action="store_true", help="skip the bare gloo / grpcio measurements"
    )
    parser.add_argument(
        "--peers",
        default="auto",
        help="auto (whichever of nixl, mooncake is installed), none, or e.g. nixl,mooncake",
    )
    parser.add_argument("--json", default=None, help="also write results to this JSON file")
    parser.set_defaults(func=run_transfer_bench)


def parse_size(text: str) -> int:
    units = {"KiB": 1 << 10, "MiB": MIB, "GiB": 1 << 30, "B": 1}
    for unit, factor in units.items():
        if text.endswith(unit):
            return int(float(text[: -len(unit)]) * factor)
    return int(text)


def _layout():
    from engine.kv_cache import KVLayout

    return KVLayout("bench", "float32", 1, 1, 512, 256)  # 1 MiB per block (K and V)


def _options(chunk_bytes: int, copy_threads: int = 0):
    from kv_transfer import TransportOptions

    return TransportOptions(
        chunk_bytes=chunk_bytes,
        copy_threads=copy_threads,
        token=TOKEN,
        timeout_s=120,
        max_message_bytes=max(64 * MIB, 2 * chunk_bytes),
    )


# --- child processes -------------------------------------------------------------------


def _sender_main(conn, transport: str, num_blocks: int, chunk_bytes: int) -> None:
    """Prefill stand-in: serve exports of the first n blocks until told to stop."""
    import torch

    from engine.kv_cache import KVCachePool
    from kv_transfer import make_sender

    pool = KVCachePool(_layout(), num_blocks)
    pool.kv.copy_(torch.randn(pool.kv.shape))
    sender = make_sender(transport, f"bench-{transport}", pool, _options(chunk_bytes))
    conn.send(sender.endpoint())
    while (msg := conn.recv()) is not None:
        request_id, n = msg
        conn.send(sender.export(request_id, list(range(n)), n * 256, "bench").to_dict())
        conn.recv()
        sender.ack(request_id)
        sender.poll_released()
    sender.close()


def _socket_sender_main(port: int, size: int, repeats: int) -> None:
    import numpy as np

    data = np.random.default_rng(0).integers(0, 255, size, dtype=np.uint8)
    with socket.create_connection(("127.0.0.1", port)) as sock:
        for _ in range(repeats):
            sock.recv(1)
            sock.sendall(memoryview(data))


def _gloo_store(port: int = 0):
    """The pair's rendezvous: port 0 makes the master, which binds a free port itself
    (`.port`); any other port joins that master."""
    from datetime import timedelta

    import torch.distributed as dist

    master = port == 0
    return dist.TCPStore(
        "127.0.0.1", port, 2, master, timedelta(seconds=60), wait_for_workers=False
    )


def _gloo_pair(rank: int, store):
    """The collective transport's own two-rank gloo group, without the transport."""
    import torch

    from kv_transfer.transports.collective import make_pair_group

    return make_pair_group(store, "bench", rank, "127.0.0.1", torch.device("cpu"), 60)


def _gloo_sender_main(conn, port: int, max_size: int, piece: int) -> None:
    """`BareGloo`'s sender: for each size it is sent, echo it (the round trip a fetch
    waits behind), then send that many bytes in pieces, all in flight, after the
    receiver's go; then read the ack. None stops it."""
    import torch

    group = _gloo_pair(0, _gloo_store(port))
    data = torch.randint(0, 255, (max_size,), dtype=torch.uint8)
    while (size := conn.recv()) is not None:
        conn.send(size)
        group.recv([torch.zeros(1)], 1, 1).wait()  # go
        step = min(piece, size)
        works = [group.send([data[o : min(o + step, size)]], 1, 0) for o in range(0, size, step)]
        for work in works:
            work.wait()
        conn.recv()  # the ack


def _grpc_sender_main(conn, size: int, message: int, options: list) -> None:
    from concurrent import futures

    import grpc
    import numpy as np

    data = np.random.default_rng(0).integers(0, 255, size, dtype=np.uint8)

    def stream(request, context):
        wanted = int(request) if request else size  # the request names its byte count
        for offset in range(0, wanted, message):
            yield data[offset : min(offset + message, wanted)].tobytes()

    handler = grpc.method_handlers_generic_handler(
        "bench.Bare",
        {"Stream": grpc.unary_stream_rpc_method_handler(stream, lambda b: b, lambda b: b)},
    )
    server = grpc.server(futures.ThreadPoolExecutor(4), options=options)
    server.add_generic_rpc_handlers((handler,))
    conn.send(server.add_insecure_port("127.0.0.1:0"))
    server.start()
    conn.recv()  # stop
    server.stop(None)


# --- measurements --------------------------------------------------------------------


def lane_slices(nbytes: int, lanes: int) -> list[slice]:
    """`nbytes` cut into at most `lanes` contiguous slices of about equal size."""
    step = -(-nbytes // lanes)
    return [slice(o, min(o + step, nbytes)) for o in range(0, nbytes, step)]


def measure_memcpy(size: int, repeats: int, lanes: int = 1) -> float:
    """Best-of memcpy of `size` bytes split over `lanes` threads (numpy copies release the
    GIL), so the shm transport is compared with a copy on as many threads as it uses."""
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np

    src = np.random.default_rng(0).integers(0, 255, size, dtype=np.uint8)
    dst = np.empty_like(src)
    dst[:] = src
    slices = lane_slices(size, lanes)

    def copy(part: slice) -> None:
        dst[part] = src[part]

    best = float("inf")
    with ThreadPoolExecutor(lanes) as pool:
        for _ in range(repeats):
            start = time.perf_counter()
            list(pool.map(copy, slices))
            best = min(best, time.perf_counter() - start)
    return size / best


def measure_socket(size: int, repeats: int) -> float:
    import numpy as np

    server = socket.create_server(("127.0.0.1", 0))
    ctx = mp.get_context("spawn")
    child = ctx.Process(target=_socket_sender_main, args=(server.getsockname()[1], size, repeats))
    child.start()
    conn, _ = server.accept()
    buf = np.empty(size, dtype=np.uint8)
    view = memoryview(buf)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        conn.sendall(b"g")
        got = 0
        while got < size:
            got += conn.recv_into(view[got:], size - got)
        best = min(best, time.perf_counter() - start)
    conn.close()
    server.close()
    child.join()
    return size / best


class BareGloo:
    """A bare gloo pair with a sender child: the collective transport's pieces, all
    sends in flight, none of its code. Each transfer runs in the transport's rhythm: it
    follows a pipe round trip to the child (the export of `measure_transport`) and
    precedes another (the ack). Timed back to back instead, the pair's threads never
    sleep between transfers, a regime no fetch runs in: 1 MiB took 0.31 ms that way
    against 0.48-0.50 ms after a round trip, and 16 MiB moved at 5.7 GB/s against
    3.5-3.7. `seconds(ticket)` times one transfer of as
    many bytes as the ticket's blocks (the collective's paired ceiling, timed in turn
    with each fetch), `seconds_for(size)` any size up to `max_size`."""

    def __init__(self, max_size: int, piece: int):
        import torch

        store = _gloo_store()
        ctx = mp.get_context("spawn")
        self.parent, child_conn = ctx.Pipe()
        self.child = ctx.Process(
            target=_gloo_sender_main, args=(child_conn, store.port, max_size, piece)
        )
        self.child.start()
        self.piece = piece
        self.group = _gloo_pair(1, store)
        self.buf = torch.empty(max_size, dtype=torch.uint8)
        self.go = torch.zeros(1)

    def seconds(self, ticket) -> float:
        return self.seconds_for(len(ticket.block_ids) * MIB)

    def seconds_for(self, size: int) -> float:
        self.parent.send(size)
        self.parent.recv()
        step = min(self.piece, size)
        start = time.perf_counter()
        self.group.send([self.go], 0, 1).wait()
        pieces = [self.buf[o : min(o + step, size)] for o in range(0, size, step)]
        works = [self.group.recv([piece], 0, 0) for piece in pieces]
        for work in works:
            work.wait()
        seconds = time.perf_counter() - start
        self.parent.send("ack")
        return seconds

    def close(self) -> None:
        self.parent.send(None)
        self.child.join()


def measure_gloo_bare(size: int, piece: int, repeats: int) -> float:
    """Best of `repeats` bare gloo transfers of `size` bytes (`BareGloo`)."""
    return _best_rate(BareGloo(size, piece), size, repeats)


def _best_rate(bare, size: int, repeats: int) -> float:
    """B/s of the fastest of `repeats` transfers of `size` bytes by a bare ceiling
    (`BareGloo`, `BareGrpc`), which it closes."""
    try:
        return size / min(bare.seconds_for(size) for _ in range(repeats))
    finally:
        bare.close()


class BareGrpc:
    """A bare grpcio server stream of `bytes` messages from a child process: the grpc
    transport's message size and channel options, none of its code. `seconds(ticket)`
    times one call for as many bytes as the ticket's blocks (a paired ceiling, timed in
    turn with each grpc fetch), `seconds_for(size)` for any size up to `max_size`."""

    def __init__(self, max_size: int, chunk: int):
        import grpc
        import numpy as np

        from kv_transfer.transports.grpc import (
            MESSAGE_BYTES,
            client_channel_options,
            server_channel_options,
        )

        options = _options(chunk)
        ctx = mp.get_context("spawn")
        self.parent, child_conn = ctx.Pipe()
        self.child = ctx.Process(
            target=_grpc_sender_main,
            args=(child_conn, max_size, MESSAGE_BYTES, server_channel_options(options)),
        )
        self.child.start()
        port = self.parent.recv()
        self.buf = np.empty(max_size, dtype=np.uint8)
        self.channel = grpc.insecure_channel(
            f"127.0.0.1:{port}", options=client_channel_options(options)
        )
        self.call = self.channel.unary_stream("/bench.Bare/Stream", lambda b: b, lambda b: b)
        self.seconds_for(min(MIB, max_size))  # the first call connects

    def seconds(self, ticket) -> float:
        return self.seconds_for(len(ticket.block_ids) * MIB)

    def seconds_for(self, size: int) -> float:
        import numpy as np

        start = time.perf_counter()
        offset = 0
        for message in self.call(str(size).encode()):
            self.buf[offset : offset + len(message)] = np.frombuffer(message, dtype=np.uint8)
            offset += len(message)
        return time.perf_counter() - start

    def close(self) -> None:
        self.channel.close()
        self.parent.send("stop")
        self.child.join()


def measure_grpc_bare(size: int, chunk: int, repeats: int) -> float:
    """Best of `repeats` bare grpcio streams of `size` bytes (`BareGrpc`)."""
    return _best_rate(BareGrpc(size, chunk), size, repeats)


def measure_checksum(size: int, repeats: int) -> float:
    import numpy as np

    from kv_transfer.integrity import checksum

    data = np.random.default_rng(0).integers(0, 255, size, dtype=np.uint8)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for block in range(0, size, MIB):
            checksum(data[block : block + MIB], "xxh3_64")
        best = min(best, time.perf_counter() - start)
    return size / best


class PoolMemcpy:
    """The shm transport's own ceiling: a plain copy of the same bytes, from the same
    mapped pages of the sender's pool file into the same destination blocks, on as many
    threads as the receiver copies with, timed in turn with each fetch (the copy that
    runs second finds the source in cache, so the order alternates)."""

    def __init__(self, lanes: int, dst):
        from concurrent.futures import ThreadPoolExecutor

        self.lanes = lanes
        self.dst = dst  # the receiver pool's bytes
        self.pool = ThreadPoolExecutor(lanes)
        self.maps: dict[str, object] = {}

    def seconds(self, ticket) -> float:
        import numpy as np

        src, dst = self._mapped(ticket), self.dst
        nbytes = len(ticket.block_ids) * MIB  # the bench exports blocks 0..n-1 into 0..n-1
        parts = lane_slices(nbytes, self.lanes)

        def copy(part: slice) -> None:
            np.copyto(dst[part], src[part])

        start = time.perf_counter()
        list(self.pool.map(copy, parts))
        return time.perf_counter() - start

    def _mapped(self, ticket):
        import mmap
        import os

        import numpy as np

        path = ticket.sender_endpoint.shm.path
        if path not in self.maps:
            fd = os.open(path, os.O_RDONLY)
            try:
                region = mmap.mmap(fd, 0, mmap.MAP_SHARED, mmap.PROT_READ)
            finally:
                os.close(fd)
            self.maps[path] = np.frombuffer(region, dtype=np.uint8)
        return self.maps[path]

    def close(self) -> None:
        self.pool.shutdown()
        self.maps.clear()


@dataclass
class TransportRun:
    """What `measure_transport` measured for one transport, per size."""

    speeds: dict[int, float]
    """B/s of the best fetch."""
    used: list[str]
    """The transports that moved the bytes (no silent fallback)."""
    ceiling: dict[int, float] = field(default_factory=dict)
    """B/s of the best run of the paired ceiling, timed in turn with each fetch."""
    paired_ratio: dict[int, float] = field(default_factory=dict)
    """The median over the timed fetches of ceiling seconds / fetch seconds, each fetch
    against the ceiling run right before or after it: the steadiest figure of our own
    overhead, since a best-of against a best-of taken apart can land on two different
    minutes of a shared machine."""


def measure_transport(
    transport: str, sizes: list[int], chunk: int, repeats: int, on_done, copy_threads: int = 0
) -> TransportRun:
    """Fetches of each size, sender in a child process, each timed next to the
    transport's paired ceiling where it has one (`PoolMemcpy` for shm, `BareGloo` for
    collective, `BareGrpc` for grpc), the two alternating which goes first."""
    from engine.kv_cache import KVCachePool
    from kv_transfer import ExportTicket, make_receiver
    from kv_transfer.blockio import flat_bytes

    blocks = max(sizes) // MIB
    ctx = mp.get_context("spawn")
    parent, child_conn = ctx.Pipe()
    child = ctx.Process(target=_sender_main, args=(child_conn, transport, blocks, chunk))
    child.start()
    parent.recv()
    pool = KVCachePool(_layout(), blocks)
    pool.kv.fill_(1.0)  # touch every page before timing
    options = _options(chunk, copy_threads)
    receiver = make_receiver(transport, "bench-decode", pool, options)
    paired = None
    if transport == "shm":
        paired = PoolMemcpy(_shm_lanes(chunk, copy_threads), flat_bytes(pool.kv).numpy())
    elif transport == "grpc":
        paired = BareGrpc(max(sizes), chunk)
    elif transport == "collective":
        paired = BareGloo(max(sizes), chunk)
    run, used = TransportRun({}, []), set()
    try:
        for size in sizes:
            n = size // MIB
            fetches, ceilings = [], []
            for rep in range(repeats + 1):  # the first run warms mappings and pairs
                parent.send((f"{size}-{rep}", n))
                ticket = ExportTicket.from_dict(parent.recv())
                if paired is not None and rep % 2:
                    ceilings.append(paired.seconds(ticket))
                result = receiver.fetch(ticket, list(range(n)), timeout_s=120)
                if paired is not None and not rep % 2:
                    ceilings.append(paired.seconds(ticket))
                parent.send("ack")
                if not result.ok:
                    raise RuntimeError(result.message)
                used.add(result.transport)
                fetches.append(result.seconds)
            run.speeds[size] = size / min(fetches[1:])
            if paired is not None:
                run.ceiling[size] = size / min(ceilings[1:])
                run.paired_ratio[size] = statistics.median(
                    c / f for c, f in zip(ceilings[1:], fetches[1:], strict=True)
                )
            on_done()
    finally:
        parent.send(None)
        child.join(30)
        receiver.close()
        if paired is not None:
            paired.close()
    run.used = sorted(used)
    return run


# --- the command ---------------------------------------------------------------------


def run_transfer_bench(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    sizes = [parse_size(s) for s in args.sizes.split(",")]
    if any(s % MIB or s <= 0 for s in sizes):
        raise SystemExit("sizes must be whole MiB")
    transports = [t for t in args.transport.split(",") if t]
    chunk = parse_size(args.chunk)
    ceilings = [] if args.no_ceilings else _ceilings(transports)
    peers = _peers(args.peers)
    per_size = 3 + len(ceilings) + len(peers) + len(transports)
    bar = tqdm(total=len(sizes) * per_size, desc="bench transfer", unit="run")
    rows = {size: {} for size in sizes}
    lanes = _shm_lanes(chunk, args.copy_threads)
    for size in sizes:
        rows[size]["memcpy"] = measure_memcpy(size, args.repeats, lanes)
        rows[size]["checksum"] = measure_checksum(size, args.repeats)
        rows[size]["socket"] = measure_socket(size, args.repeats)
        if "gloo-bare" in ceilings:
            rows[size]["gloo-bare"] = measure_gloo_bare(size, min(chunk, size), args.repeats)
        if "grpc-bare" in ceilings:
            rows[size]["grpc-bare"] = measure_grpc_bare(size, chunk, args.repeats)
        for peer in peers:
            rows[size][peer] = measure_peer(peer, size, args.repeats)
        bar.update(3 + len(ceilings) + len(peers))
    actual, paired_ratios = {}, {}
    for transport in transports:
        run = measure_transport(
            transport, sizes, chunk, args.repeats, lambda: bar.update(1), args.copy_threads
        )
        actual[transport] = run.used
        if run.paired_ratio:
            paired_ratios[transport] = run.paired_ratio
        for size, speed in run.speeds.items():
            rows[size][transport] = speed
            if size in run.ceiling:
                rows[size][PAIRED_CEILING[transport]] = run.ceiling[size]
    bar.close()
    _print_table(rows, transports, ceilings, actual, peers, paired_ratios)
    print(f"memcpy and shm copy on {lanes} lane(s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(_as_json(rows, transports, actual, chunk, peers, paired_ratios), f, indent=2)
    return 0


def _shm_lanes(chunk: int, copy_threads: int) -> int:
    from kv_transfer.transports.shm import copy_lanes

    return copy_lanes(_options(chunk, copy_threads))


PAIRED_CEILING = {"shm": "pool-memcpy", "collective": "gloo-paired", "grpc": "grpc-paired"}
"""The ceiling measured in turn with each fetch of the transport (`measure_transport`):
the shm copy without our code (`PoolMemcpy`), the bare gloo pair (`BareGloo`), the bare
grpcio stream (`BareGrpc`)."""

_CEILING_OF = {"collective": "gloo-bare", "grpc": "grpc-bare"}
"""The bare library under each transport that has one (skipped with --no-ceilings)."""


def _ceilings(transports: list[str]) -> list[str]:
    return [_CEILING_OF[t] for t in transports if t in _CEILING_OF]


def _peers(choice: str) -> list[str]:
    """Called by run_transfer_bench: the optional peers to measure, printing one line
    for each requested one that cannot run."""
    if choice == "none":
        return []
    requested = installed_peers() if choice == "auto" else [p for p in choice.split(",") if p]
    peers = []
    for name in requested:
        if (problem := peer_problem(name)) is None:
            peers.append(name)
        else:
            print(f"peer {name} skipped: {problem}", flush=True)
    return peers


def _print_table(
    rows: dict,
    transports: list[str],
    ceilings: list[str],
    actual: dict,
    peers: list[str],
    paired_ratios: dict,
) -> None:
    paired = [PAIRED_CEILING[t] for t in transports if t in PAIRED_CEILING]
    cols = ["memcpy", "checksum", "socket", *ceilings, *paired, *transports, *peers]
    print(f"{'size':>8} " + " ".join(f"{c:>11}" for c in cols) + "   (GB/s)")
    for size, row in rows.items():
        cells = " ".join(f"{row[c] / 1e9:>11.2f}" for c in cols)
        print(f"{size // MIB:>5}MiB {cells}")
    print("\nratios: " + ", ".join(_ratio_names([*transports, *peers])))
    for size, row in rows.items():
        ratios = " ".join(f"{row[t] / row[_baseline(t)]:>11.2f}" for t in [*transports, *peers])
        print(f"{size // MIB:>5}MiB {ratios}")
    paired = [t for t in transports if t in PAIRED_CEILING]
    if paired:
        names = ", ".join(f"{t}/{PAIRED_CEILING[t]}" for t in paired)
        print(f"\nagainst the paired ceiling, timed in turn with each fetch: {names}")
        print("  best / best, then the median of each fetch against its neighbour:")
        for size, row in rows.items():
            best = " ".join(f"{row[t] / row[PAIRED_CEILING[t]]:>11.2f}" for t in paired)
            median = " ".join(f"{paired_ratios[t][size]:>11.2f}" for t in paired)
            print(f"{size // MIB:>5}MiB {best}   | {median}")
    against = [t for t in transports if _CEILING_OF.get(t) in ceilings]
    if against:
        print("\nagainst the bare library: " + ", ".join(f"{t}/{_CEILING_OF[t]}" for t in against))
        for size, row in rows.items():
            ratios = " ".join(f"{row[t] / row[_CEILING_OF[t]]:>11.2f}" for t in against)
            print(f"{size // MIB:>5}MiB {ratios}")
    smallest = min(rows)
    ceiling = {
        t: _CEILING_OF.get(t) if _CEILING_OF.get(t) in ceilings else _baseline(t)
        for t in transports
    }
    print(f"\nlatency of one {smallest // MIB} MiB transfer (ms), against its ceiling:")
    for t in transports:
        ours, theirs = smallest / rows[smallest][t], smallest / rows[smallest][ceiling[t]]
        print(
            f"  {t:<10} {ours * 1e3:7.3f}  {ceiling[t]:<9} {theirs * 1e3:7.3f}  "
            f"x{ours / theirs:.2f}"
        )
    print("transport that moved the bytes: " + ", ".join(f"{t}={actual[t]}" for t in transports))
    if peers:
        print("peers: " + "; ".join(f"{p}={PATHS[p]}" for p in peers))


def _baseline(transport: str) -> str:
    return "memcpy" if transport in ("shm", "local") else "socket"


def _ratio_names(transports: list[str]) -> list[str]:
    return [f"{t}/{_baseline(t)}" for t in transports]


def _as_json(
    rows: dict,
    transports: list[str],
    actual: dict,
    chunk: int,
    peers: list[str],
    paired_ratios: dict,
) -> dict:
    import os

    return {
        "machine": {"cpu": cpu_model(), "cores": os.cpu_count()},
        "chunk_bytes": chunk,
        "transports_used": actual,
        "peers": {p: PATHS[p] for p in peers},
        "results": [
            {"size_bytes": size, **{k: v / 1e9 for k, v in row.items()}}
            for size, row in rows.items()
        ],
        "units": "GB/s (1e9 bytes/s)",
        "ratio_baselines": {t: _baseline(t) for t in [*transports, *peers]},
        "paired_ceilings": {t: PAIRED_CEILING[t] for t in paired_ratios},
        "paired_median_ratios": {
            t: {str(size): ratio for size, ratio in ratios.items()}
            for t, ratios in paired_ratios.items()
        },
    }
