"""Optional peer libraries for `pdserve bench transfer`: NIXL over its default UCX
backend and the Mooncake transfer engine over TCP with P2P handshake (no etcd), each
moving CPU memory between two processes on this host.

Neither is a dependency (`make peers` or `pip install -e ".[peers]"`; CI has neither).
Both are measured the way KV is pulled: the sender (prefill stand-in, a spawned child)
registers a buffer of `size` random bytes, and the receiver (this process, the decode
side) registers its own buffer and READs the sender's into it, as vLLM's NIXL
connector has the decode side do, in the bench's 1 MiB blocks. On one host UCX reads
with cma (process_vm_readv: one kernel copy, no socket); Mooncake's tcp goes through
loopback. Timing covers posting the read and waiting for its completion; agent/engine
setup, registration and metadata exchange are outside, like export and ack for our
transports. The receive buffer is zeroed before every run and its SHA-256 compared
with the sender's after the timed runs, so a transfer that moved nothing cannot
report a speed.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import importlib
import importlib.util
import multiprocessing as mp
import os
import time
from pathlib import Path

MIB = 1 << 20
PEERS = ("nixl", "mooncake")
PATHS = {
    "nixl": "NIXL UCX backend, DRAM, READ, no progress threads",
    "mooncake": "Mooncake tcp, P2PHANDSHAKE, DRAM, READ",
}
"""What each peer column measured (printed and written to the JSON by the bench)."""

IBVERBS_DIR = Path(__file__).resolve().parents[1] / ".tools" / "ibverbs"
"""Where `make peers` unpacks Debian's libibverbs1 and libnl (never installed)."""
_IBVERBS_LIBS = ("libnl-3.so.200", "libnl-route-3.so.200", "libibverbs.so.1")
_DISTRIBUTIONS = {"nixl": "nixl-cu12", "mooncake": "mooncake-transfer-engine-non-cuda"}
TIMEOUT_S = 120


# --- availability --------------------------------------------------------------------


def available_peers() -> list[str]:
    """Called by tests: the peers that import and initialise here."""
    return [name for name in installed_peers() if peer_problem(name) is None]


def installed_peers() -> list[str]:
    """Called by transfer_bench for `--peers auto`: the peers whose package is here."""
    return [name for name in PEERS if _module(name) is not None]


def peer_problem(name: str) -> str | None:
    """Called by transfer_bench for each requested peer: None, or why it cannot run.

    The initialisation runs in a spawned child so that a library that aborts while
    starting (native code) cannot take the bench down with it.
    """
    if name not in PEERS:
        return f"unknown peer (known: {', '.join(PEERS)})"
    if _module(name) is None:
        return f"not installed (make peers, or pip install {_DISTRIBUTIONS[name]})"
    ctx = mp.get_context("spawn")
    parent, child_conn = ctx.Pipe()
    child = ctx.Process(target=_probe_main, args=(child_conn, name), daemon=True)
    child.start()
    child_conn.close()
    try:
        if not parent.poll(TIMEOUT_S):
            return f"its probe did not answer in {TIMEOUT_S}s"
        return parent.recv()
    except EOFError:
        child.join(10)
        return f"its probe process died (exit code {child.exitcode})"
    finally:
        _stop(child)


def _probe_main(conn, name: str) -> None:
    try:
        _PROBES[name]()
        conn.send(None)
    except BaseException as exc:  # any failure to start is the answer, not a crash
        conn.send(f"{type(exc).__name__}: {exc}".strip())


def _probe_nixl() -> None:
    _nixl_agent("pdserve-probe")


def _probe_mooncake() -> None:
    _mooncake_engine()


def _module(name: str) -> str | None:
    """The peer's importable package, or None when it is not installed."""
    # `nixl` is the meta package (picks a CUDA build); the bare wheel is `nixl_cu12`.
    candidates = ("nixl", "nixl_cu12") if name == "nixl" else ("mooncake",)
    return next((m for m in candidates if importlib.util.find_spec(m)), None)


# --- library setup (both sides) --------------------------------------------------------


def _quiet() -> None:
    """Called before either library is imported: their INFO logs would break up the
    bench's table. Failures still surface as return codes turned into exceptions;
    NIXL_LOG_LEVEL=INFO or MC_LOG_LEVEL=INFO shows the libraries' own logs."""
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    # ERROR is mooncake's quietest; it still logs "Local segment descriptor not found"
    # once per engine in P2P mode (it looks itself up before publishing), harmlessly.
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")


def _nixl_agent(name: str):
    _quiet()
    api = importlib.import_module(f"{_module('nixl')}._api")
    # No progress thread: the Python API's spins a whole core (pthrDelay 0: 3.0 CPU s
    # per 3 s idle), and with one per side it took the core the copy needs on 2 cores
    # (64 MiB: 1.3-3.7 GB/s with, 4.9-6.4 without). The reader progresses by polling its
    # READ, the sender from its wait loop, as a worker's step loop would.
    config = api.nixl_agent_config(enable_prog_thread=False, backends=["UCX"])
    agent = api.nixl_agent(name, config)
    if "UCX" not in agent.backends:
        raise RuntimeError(f"NIXL has no UCX backend here (plugins: {agent.plugin_list})")
    return agent


def _load_ibverbs() -> None:
    """Called before importing mooncake, whose engine links libibverbs even for TCP.

    A system copy wins; otherwise the one `make peers` unpacked is loaded by path, so
    the dynamic linker resolves mooncake's dependency by soname when it is imported.
    LD_LIBRARY_PATH would only count from the start of a process, this process and
    every spawned one alike.
    """
    try:
        ctypes.CDLL("libibverbs.so.1")
        return
    except OSError:
        pass
    for soname in _IBVERBS_LIBS:  # dependencies first
        found = sorted(IBVERBS_DIR.rglob(soname)) if IBVERBS_DIR.is_dir() else []
        if found:
            ctypes.CDLL(str(found[0]), mode=ctypes.RTLD_GLOBAL)


def _mooncake_engine():
    _quiet()
    _load_ibverbs()
    try:
        from mooncake.engine import TransferEngine
    except ImportError as exc:
        if "libibverbs" not in str(exc):
            raise
        raise ImportError(f"{exc} (`make peers` unpacks it into {IBVERBS_DIR})") from exc

    engine = TransferEngine()
    rc = engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
    if rc != 0:
        raise _mooncake_failed("TransferEngine.initialize(tcp, P2PHANDSHAKE)", rc)
    return engine


def _mooncake_failed(what: str, rc: int) -> RuntimeError:
    return RuntimeError(f"mooncake {what} returned {rc} (MC_LOG_LEVEL=INFO shows its log)")


def _random_bytes(size: int):
    import numpy as np

    return np.random.default_rng(0).integers(0, 255, size, dtype=np.uint8)


def _blocks(size: int) -> list[tuple[int, int]]:
    return [(offset, min(MIB, size - offset)) for offset in range(0, size, MIB)]


# --- child processes (the sender, READ's target) -----------------------------------------


def _nixl_sender_main(conn, size: int) -> None:
    data = _random_bytes(size)
    agent = _nixl_agent("pdserve-prefill")
    base = data.ctypes.data
    agent.register_memory([(base, size, 0, "")], "DRAM")
    blocks = agent.get_xfer_descs([(base + o, n, 0) for o, n in _blocks(size)], "DRAM")
    conn.send((agent.get_agent_metadata(), agent.get_serialized_descs(blocks), _digest(data)))
    while not conn.poll(0.001):  # stop; until then the memory stays registered
        agent.get_new_notifs()  # progresses UCX (connection setup needs this side)
    conn.recv()


def _mooncake_sender_main(conn, size: int) -> None:
    data = _random_bytes(size)
    engine = _mooncake_engine()
    if (rc := engine.register_memory(data.ctypes.data, size)) != 0:
        raise _mooncake_failed("register_memory (sender)", rc)
    conn.send((f"127.0.0.1:{engine.get_rpc_port()}", data.ctypes.data, _digest(data)))
    conn.recv()  # stop
    engine.unregister_memory(data.ctypes.data)


# --- the receiver (this process) ---------------------------------------------------------


def measure_peer(name: str, size: int, repeats: int) -> float:
    """Called by transfer_bench per size and by tests: B/s of a READ of `size` bytes.

    Best of `repeats` after one warm-up; raises if the bytes that arrived are not the
    sender's.
    """
    import numpy as np

    ctx = mp.get_context("spawn")
    parent, child_conn = ctx.Pipe()
    target = {"nixl": _nixl_sender_main, "mooncake": _mooncake_sender_main}[name]
    child = ctx.Process(target=target, args=(child_conn, size), daemon=True)
    child.start()
    child_conn.close()
    buf = np.zeros(size, dtype=np.uint8)  # touched before any timing
    try:
        offer = _offer(parent, child, name)
        read, close = _READERS[name](buf, offer)
        try:
            best = float("inf")
            for rep in range(repeats + 1):  # the first run connects and warms
                buf.fill(0)
                seconds = read()
                if rep:
                    best = min(best, seconds)
        finally:
            close()
        if _digest(buf) != offer[-1]:
            raise RuntimeError(f"{name}: received bytes differ from the sender's")
    finally:
        with contextlib.suppress(OSError):  # the sender may already be gone
            parent.send("stop")
        _stop(child)
    return size / best


def _offer(parent, child, name: str):
    """The sender's (connection info, remote buffer, digest), or why there is none."""
    if not parent.poll(TIMEOUT_S):
        raise RuntimeError(f"{name} sender did not offer its buffer in {TIMEOUT_S}s")
    try:
        return parent.recv()
    except EOFError:
        child.join(10)
        raise RuntimeError(
            f"{name} sender exited (code {child.exitcode}) before offering"
        ) from None


def _stop(child) -> None:
    child.join(30)
    if child.is_alive():
        child.kill()
        child.join()


def _nixl_reader(buf, offer):
    metadata, remote_blocks, _ = offer
    agent = _nixl_agent("pdserve-decode")
    base = buf.ctypes.data
    registered = agent.register_memory([(base, buf.nbytes, 0, "")], "DRAM")
    remote = agent.add_remote_agent(metadata)
    local = agent.get_xfer_descs([(base + o, n, 0) for o, n in _blocks(buf.nbytes)], "DRAM")
    handle = agent.initialize_xfer(
        "READ", local, agent.deserialize_descs(remote_blocks), remote, b""
    )

    def read() -> float:
        start = time.perf_counter()
        state = agent.transfer(handle)
        deadline = start + TIMEOUT_S
        while state == "PROC" and time.perf_counter() < deadline:
            state = agent.check_xfer_state(handle)
        seconds = time.perf_counter() - start
        if state != "DONE":
            raise RuntimeError(f"nixl READ ended in state {state}")
        return seconds

    def close() -> None:
        agent.release_xfer_handle(handle)
        agent.remove_remote_agent(remote)
        agent.deregister_memory(registered)

    return read, close


def _mooncake_reader(buf, offer):
    session, remote_base, _ = offer
    engine = _mooncake_engine()
    base = buf.ctypes.data
    if (rc := engine.register_memory(base, buf.nbytes)) != 0:
        raise _mooncake_failed("register_memory (receiver)", rc)
    blocks = _blocks(buf.nbytes)
    local = [base + o for o, _ in blocks]
    remote = [remote_base + o for o, _ in blocks]
    lengths = [n for _, n in blocks]

    def read() -> float:
        start = time.perf_counter()
        rc = engine.batch_transfer_sync_read(session, local, remote, lengths)
        seconds = time.perf_counter() - start
        if rc != 0:
            raise _mooncake_failed("batch_transfer_sync_read", rc)
        return seconds

    def close() -> None:
        engine.unregister_memory(base)

    return read, close


def _digest(data) -> str:
    return hashlib.sha256(memoryview(data)).hexdigest()


_PROBES = {"nixl": _probe_nixl, "mooncake": _probe_mooncake}
_READERS = {"nixl": _nixl_reader, "mooncake": _mooncake_reader}
