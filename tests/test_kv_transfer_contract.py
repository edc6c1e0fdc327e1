"""One contract over every transport: a real prompt's KV moves between two processes.

The child process (tests/kv_transfer_peer.py) is the prefill worker with a real engine;
this process is the decode worker. For every transport: prefill a prompt there, export,
fetch here into our own engine's blocks, check the bytes, decode, compare with the
child's own decode, ack, and end with both pools free. `local` is in-process by nature,
so its case runs both ends here.
"""

from __future__ import annotations

import numpy as np
import pytest

from engine.sampling_params import SamplingParams
from kv_transfer import ExportTicket, TransportOptions, make_receiver, make_sender
from tests.factories import assert_no_leaks, make_engine
from tests.kv_transfer_peer import Peer

PROMPT = [5 + (i * 7) % 300 for i in range(37)]  # 5 blocks of 8, the last one partial
MAX_TOKENS = 8
OPTIONS = TransportOptions(chunk_bytes=16 << 10, token="cluster-secret", timeout_s=20)

CASES = {
    # case: (sender transport, receiver transport, receiver node override, expected transport)
    "shm": ("shm", "shm", None, "shm"),
    "grpc": ("grpc", "grpc", None, "grpc"),
    "collective": ("collective", "collective", None, "collective"),
    "auto-same-node": ("auto", "auto", None, "shm"),
    "auto-cross-node": ("auto", "auto", "another-node", "collective"),
}


@pytest.fixture(scope="module")
def prefill_peer(tiny_llama_dir):
    peer = Peer(str(tiny_llama_dir))
    yield peer
    peer.close()


@pytest.fixture(scope="module")
def decode_engine(tiny_llama_dir):
    # Every case imports the same prompt: without a prefix cache each pulls all of it
    # (pulling only missing blocks is tests/test_prefix_reuse_transfer.py).
    return make_engine(tiny_llama_dir, num_kv_blocks=64, prefix_caching=False)


def import_and_decode(engine, receiver, ticket: ExportTicket, prompt, first_tokens):
    """Decode side, steps 2-4: reserve, fetch, decode; returns (result, block bytes,
    tokens). The bytes are read back to host memory from a pool on any device."""
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    seq = engine.begin_import(ticket.request_id, prompt, first_tokens, params, len(prompt))
    assert engine.reserve_imports() == [seq]
    result = receiver.fetch(ticket, seq.block_ids, timeout_s=20)
    assert result.ok, result.message
    blocks = block_bytes(engine, seq.block_ids)
    assert engine.finish_import(ticket.request_id, result.ok, recompute=False)
    while engine.has_unfinished():
        engine.step()
    return result, blocks, seq.output_token_ids


def block_bytes(engine, block_ids) -> bytes:
    return engine.kv_pool.read_blocks(block_ids).cpu().numpy().tobytes()


@pytest.mark.parametrize("case", list(CASES))
def test_transport_moves_a_real_prompt_between_processes(case, prefill_peer, decode_engine):
    sender_name, receiver_name, node, expected_transport = CASES[case]
    request_id = f"req-{case}"
    # 1. prefill side: sender of this transport, prompt prefilled and exported
    prefill_peer.call("open_sender", case, sender_name, OPTIONS)
    ticket_dict, sent, first, expected = prefill_peer.call(
        "prefill_and_export", case, request_id, PROMPT, MAX_TOKENS
    )
    ticket = ExportTicket.from_dict(ticket_dict)
    receiver = make_receiver(
        receiver_name, f"decode-{case}", decode_engine.kv_pool, _with_node(OPTIONS, node)
    )
    try:
        # 2-4. decode side imports and decodes from the imported KV
        result, received, tokens = import_and_decode(decode_engine, receiver, ticket, PROMPT, first)
    finally:
        receiver.close()
    # 5. byte-identical blocks, same decode, the transport named is the one used
    assert np.array_equal(np.frombuffer(received, np.uint8), np.frombuffer(sent, np.uint8))
    assert tokens == expected
    assert result.transport == expected_transport
    assert result.checksum == "xxh3_64"
    assert result.num_bytes == len(sent)
    # 6. ack releases the sender's blocks exactly once; both pools end free
    prefill_peer.call("ack", case, request_id)
    assert prefill_peer.call("wait_all_free") == 0
    stats = prefill_peer.call("stats", case)
    assert (stats.exports, stats.acks, stats.transfers_served) == (1, 1, 1)
    assert stats.pinned_blocks == 0
    assert_no_leaks(decode_engine)


def test_local_transport_in_one_process(tiny_llama_dir, decode_engine):
    moves_a_prompt_in_one_process(make_engine(tiny_llama_dir), decode_engine, PROMPT)


def moves_a_prompt_in_one_process(prefill, decode, prompt: list[int]) -> None:
    """`local` between two engines of this process (on CPU here, on a GPU in
    tests/test_gpu.py): the same bytes and the same decode; both pools end free."""
    sender = make_sender("local", "prefill-local", prefill.kv_pool, OPTIONS)
    receiver = make_receiver("local", "decode-local", decode.kv_pool, OPTIONS)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    expected = prefill.generate([prompt], params)[0].output_token_ids
    prefill.add_request("r", prompt, params, stop_after_prefill=True)
    while prefill.has_unfinished():
        prefill.step()

    def export(seq):
        ticket = sender.export("r", seq.block_ids, len(prompt), "decode-local")
        return ticket, block_bytes(prefill, seq.block_ids), seq

    ticket, sent, seq = prefill.export_prefilled("r", export)
    result, received, tokens = import_and_decode(
        decode, receiver, ticket, prompt, seq.output_token_ids
    )
    assert (result.transport, received, tokens) == ("local", sent, expected)
    # Device pools verify on the device (kv_transfer/device_checksum.py); CPU pools as before.
    assert result.checksum == ("wsum64" if decode.kv_pool.kv.is_cuda else "xxh3_64")
    sender.ack("r")
    for ids in sender.poll_released():
        prefill.release_blocks(ids)
    sender.close()
    assert_no_leaks(prefill)
    assert_no_leaks(decode)


def _with_node(options: TransportOptions, node: str | None) -> TransportOptions:
    from dataclasses import replace

    return options if node is None else replace(options, node_id=node)
