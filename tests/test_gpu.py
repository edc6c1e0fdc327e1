"""The CUDA paths, checked on a GPU: skipped (not faked) on machines without one.

What a CPU run cannot reach: the engine's forward on CUDA tensors against transformers
on the same GPU, decode steps replayed from CUDA graphs captured at start-up (at every
batch bucket), the Triton kernels compiled (against their dense reference, and in the
engine against the torch gather path), bf16 greedy agreement with transformers on the
GPU's own matmuls, KV blocks leaving and entering CUDA pools (in one process, and
between two over gRPC; NCCL pairs need two GPUs), NVML's reading of the device, the
KV pool sized from `gpu_memory_utilization` within that share of the device (and a
cluster's, when its config gives no block count), the device checksum against its
definition, a transfer running beside decode steps without slowing them (its own
stream), and a dead NCCL peer failing only the fetch (two GPUs).
`make test-gpu` runs this module and the short bench (bench/gpu_check.py);
docs/operations.md says how to run them on a GPU machine that has no network (its own
torch, no virtualenv).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.kv_cache import KVLayout
from engine.sampling_params import SamplingParams
from kv_transfer import ExportTicket, TransportOptions, make_receiver
from tests.factories import (
    _hf_model,
    assert_no_leaks,
    hf_greedy,
    make_engine,
    our_greedy_with_logits,
    prompt_of,
)
from tests.test_kv_transfer_contract import import_and_decode, moves_a_prompt_in_one_process

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU here"),
]

DEVICE = "cuda"
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
OPTIONS = TransportOptions(chunk_bytes=16 << 10, token="cluster-secret", timeout_s=30)


@pytest.fixture(autouse=True)
def full_float32_matmuls():
    """TF32 would round every float32 matmul's inputs to 10 bits of mantissa: the parity
    below is against float32, on this GPU, with the same setting for both sides."""
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = saved


def gpu_engine(model_dir, **overrides):
    return make_engine(model_dir, device=DEVICE, **overrides)


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_cuda_greedy_equals_transformers_on_the_same_gpu(tiny_model_dirs, family):
    model_dir = tiny_model_dirs[family]
    engine = gpu_engine(model_dir, cuda_graphs=False)
    assert engine.kv_pool.kv.device.type == torch.device(DEVICE).type
    prompts = [prompt_of(n, salt=11) for n in (5, 13, 30)]

    outputs = engine.generate(prompts, GREEDY)

    for prompt, seq in zip(prompts, outputs, strict=True):
        assert seq.output_token_ids == hf_greedy(model_dir, prompt, 24, device=DEVICE)[0]
    assert_no_leaks(engine)


def test_cuda_logits_match_transformers_step_by_step(tiny_llama_dir):
    engine = gpu_engine(tiny_llama_dir, cuda_graphs=False)
    prompt = prompt_of(13)
    ref_tokens, ref_logits = hf_greedy(tiny_llama_dir, prompt, 16, device=DEVICE)

    ours = our_greedy_with_logits(engine, prompt, 16)

    torch.testing.assert_close(ours.to(ref_logits.device), ref_logits, atol=2e-4, rtol=1e-4)
    assert [int(row.argmax()) for row in ours] == ref_tokens
    assert_no_leaks(engine)


@pytest.mark.parametrize("attention_backend", ["auto", "triton", "torch"])
def test_decode_graphs_captured_at_start_replay_as_eager_at_every_bucket(
    tiny_llama_dir, attention_backend
):
    """Every batch bucket up to max_num_seqs is captured while the engine is built; decode
    batches of 1, 2, 3, 6 and 8 (every bucket, some padded) replay them, with long
    prompts whose decode splits its keys over programs: the graphs' tokens are the
    eager engine's, and the scratch block is the only block no sequence owns that the
    graphs wrote."""
    settings = dict(max_num_seqs=8, attention_backend=attention_backend)
    eager = gpu_engine(tiny_llama_dir, cuda_graphs=False, **settings)
    graphed = gpu_engine(tiny_llama_dir, cuda_graphs=True, **settings)
    graphs = graphed.runner.graphs
    assert eager.runner.graphs is None and eager.allocator.scratch_block is None
    assert {batch for batch, _ in graphs.steps} == {1, 2, 4, 8}
    assert all(step.graph is not None for step in graphs.steps.values())
    scratch = graphed.allocator.scratch_block
    assert scratch == graphed.kv_pool.num_blocks - 1 == graphed.allocator.num_blocks
    others = graphed.kv_pool.kv[:scratch].clone()
    assert others.abs().sum() == 0  # capture wrote nothing outside the scratch block
    for batch in (1, 2, 3, 6, 8):
        prompts = [prompt_of(9 + 37 * i, salt=batch) for i in range(batch)]
        expected = [s.output_token_ids for s in eager.generate(prompts, GREEDY)]
        replays = graphs.replays
        actual = [s.output_token_ids for s in graphed.generate(prompts, GREEDY)]
        assert actual == expected, batch
        assert graphs.replays - replays >= GREEDY.max_tokens - 1, batch
    assert_no_leaks(graphed)


def test_triton_kernels_equal_the_dense_reference_on_the_gpu():
    """The interpreter's kernel tests (tests/test_triton_attention.py), compiled: fp16 and
    bf16 on the tensor cores, float32 in IEEE dots, split decode, windows."""
    from tests import test_triton_attention as kernels

    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for block_size, group, head_dim in ((16, 1, 64), (16, 8, 128), (32, 4, 64)):
            kernels.run_decode(kernels.DECODE_LENS, block_size, group, head_dim, dtype)
            kernels.run_prefill(kernels.CHUNKS, block_size, group, head_dim, dtype)
        kernels.run_decode([1, 70, 600, 2000], 16, 4, 128, dtype, splits=None)
        kernels.run_decode([1, 70, 600, 2000], 16, 4, 128, dtype, splits=7, window=100)
        kernels.run_prefill(kernels.CHUNKS, 16, 4, 64, dtype, window=20)


def test_triton_backend_equals_the_torch_reference_on_whole_requests(tiny_model_dirs):
    """The engine on the Triton kernels (and the Triton KV store) against the same
    engine on the torch gather path, on the same GPU, over chunked prompts and a
    prefix-cache hit."""
    model_dir = tiny_model_dirs["qwen2"]
    settings = dict(block_size=16, prefill_chunk_size=16, max_batch_tokens=64)
    triton_engine = gpu_engine(model_dir, attention_backend="triton", **settings)
    torch_engine = gpu_engine(model_dir, attention_backend="torch", **settings)
    assert triton_engine.model.attention.name == "triton"
    prompts = [prompt_of(n, salt=6) for n in (5, 16, 37, 70)]
    prompts.append(prompts[3][:48] + prompt_of(5, salt=8))
    expected = [s.output_token_ids for s in torch_engine.generate(prompts, GREEDY)]
    outputs = triton_engine.generate(prompts, GREEDY)
    assert [s.output_token_ids for s in outputs] == expected
    assert_no_leaks(triton_engine)


def _hf_bf16_greedy(model_dir, prompt: list[int], count: int) -> list[int]:
    model = _hf_model(str(model_dir), DEVICE, torch.bfloat16)
    ids = torch.tensor([prompt], device=DEVICE)
    with torch.no_grad():
        for _ in range(count):
            token = model(ids).logits[0, -1].float().argmax()
            ids = torch.cat([ids, token.view(1, 1)], dim=1)
    return ids[0, len(prompt) :].tolist()


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_bf16_greedy_agrees_with_transformers_bf16_on_the_same_gpu(tiny_model_dirs, family):
    """The default GPU path in bf16 (auto backend, CUDA graphs, block size 16): its
    greedy tokens are transformers' own in bf16, on the same GPU. The tiny models' logits
    are widened (tests/factories.py), so rounding elsewhere does not flip a choice."""
    model_dir = tiny_model_dirs[family]
    engine = gpu_engine(model_dir, dtype="bfloat16", block_size=16)
    assert engine.runner.graphs is not None
    prompts = [prompt_of(n, salt=12) for n in (5, 13, 40)]
    for prompt, seq in zip(prompts, engine.generate(prompts, GREEDY), strict=True):
        assert seq.output_token_ids == _hf_bf16_greedy(model_dir, prompt, GREEDY.max_tokens)
    assert_no_leaks(engine)


def test_bf16_on_the_gpu_strays_no_further_than_transformers_bf16(tiny_llama_dir):
    engine = gpu_engine(tiny_llama_dir, dtype="bfloat16", cuda_graphs=False)
    hf_bf16 = _hf_model(str(tiny_llama_dir), DEVICE, torch.bfloat16)
    for length in (5, 13, 30):
        prompt = prompt_of(length, salt=3)
        reference = hf_greedy(tiny_llama_dir, prompt, 1, device=DEVICE)[1][0]
        ours = our_greedy_with_logits(engine, prompt, 1)[0].to(reference.device)
        with torch.no_grad():
            theirs = hf_bf16(torch.tensor([prompt], device=DEVICE)).logits[0, -1].float()

        def error(logits, reference=reference):
            return float((logits - reference).norm() / reference.norm())

        # Other kernels round elsewhere; a path gone wrong (fp16 overflow, a bf16
        # residual) strays ten times as far.
        assert error(ours) <= 1.25 * error(theirs), length
    assert_no_leaks(engine)


def test_every_cuda_attention_backend_agrees_with_torch_on_whole_requests(tiny_llama_dir):
    """`auto` on CUDA picks FlashInfer, then flash-attn (where it pages the block size),
    where importable, else the Triton kernels, never the torch gather path; its greedy
    tokens must be the torch backend's."""
    from engine.flash_attention import FlashPagedAttention, flash_available
    from engine.flashinfer_backend import flashinfer_available

    dtype, block_size = "bfloat16", 16
    torch_backend = gpu_engine(tiny_llama_dir, dtype=dtype, attention_backend="torch")
    auto = gpu_engine(tiny_llama_dir, dtype=dtype, block_size=block_size)
    if flashinfer_available(torch.bfloat16, block_size):
        expected_name = "flashinfer"
    elif flash_available(torch.bfloat16) and FlashPagedAttention.pages(block_size):
        expected_name = "flash_attn"
    else:
        expected_name = "triton"
    assert auto.model.attention.name == expected_name
    prompts = [prompt_of(n, salt=4) for n in (6, 21)]
    expected = [s.output_token_ids for s in torch_backend.generate(prompts, GREEDY)]
    assert [s.output_token_ids for s in auto.generate(prompts, GREEDY)] == expected
    assert_no_leaks(auto)


def test_local_transport_moves_cuda_blocks_in_one_process(tiny_llama_dir):
    prefill = gpu_engine(tiny_llama_dir)
    decode = gpu_engine(tiny_llama_dir, prefix_caching=False)
    moves_a_prompt_in_one_process(prefill, decode, prompt_of(37, salt=9))


@pytest.mark.parametrize(
    "transport",
    [
        "grpc",
        pytest.param(
            "collective",
            marks=pytest.mark.skipif(
                torch.cuda.device_count() < 2, reason="an NCCL pair needs two GPUs"
            ),
        ),
    ],
)
def test_cuda_blocks_cross_processes(tiny_llama_dir, transport):
    """The prefill side in a child process with its own CUDA pool; gRPC copies through
    host memory, NCCL from device to device (each side on its own GPU)."""
    from tests.kv_transfer_peer import Peer

    peer_device = "cuda:1" if transport == "collective" else DEVICE
    peer = Peer(str(tiny_llama_dir), device=peer_device)
    decode = gpu_engine(tiny_llama_dir, num_kv_blocks=64, prefix_caching=False)
    prompt = prompt_of(37, salt=10)
    try:
        peer.call("open_sender", transport, transport, OPTIONS)
        ticket_dict, sent, first, expected = peer.call(
            "prefill_and_export", transport, "req-gpu", prompt, 8
        )
        receiver = make_receiver(transport, "decode-gpu", decode.kv_pool, OPTIONS)
        try:
            ticket = ExportTicket.from_dict(ticket_dict)
            result, received, tokens = import_and_decode(decode, receiver, ticket, prompt, first)
        finally:
            receiver.close()
        assert np.array_equal(np.frombuffer(received, np.uint8), np.frombuffer(sent, np.uint8))
        assert (tokens, result.transport) == (expected, transport)
        peer.call("ack", transport, "req-gpu")
        assert peer.call("wait_all_free") == 0
    finally:
        peer.close()
    assert_no_leaks(decode)


def test_nvml_reads_the_gpu_a_worker_runs_on():
    pytest.importorskip("pynvml")
    from engine.gpu_stats import read_gpu_stats

    stats = read_gpu_stats("cuda:0")
    assert stats is not None
    assert 0.0 <= stats["utilization_ratio"] <= 1.0
    assert 0 < stats["memory_used_bytes"] <= stats["memory_total_bytes"]
    assert read_gpu_stats("cpu") is None


def test_kv_pool_sized_within_the_configured_share(tiny_llama_dir):
    """An engine given no block count sizes its pool from `gpu_memory_utilization`: what
    the device lost while it was built stays within that share of the device, the pool
    takes most of it, and the engine serves from it."""
    share = 0.25
    torch.zeros(1, device=DEVICE)  # the CUDA context exists before the first reading
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free_before, total = torch.cuda.mem_get_info()
    engine = gpu_engine(
        tiny_llama_dir, num_kv_blocks=None, gpu_memory_utilization=share, block_size=256
    )
    torch.cuda.synchronize()
    free_after, _ = torch.cuda.mem_get_info()
    sizing = engine.kv_sizing
    assert sizing is not None and engine.kv_pool.num_blocks == sizing.num_blocks
    assert engine.allocator.num_blocks == sizing.usable_blocks == sizing.num_blocks - 1
    taken = free_before - free_after
    assert taken <= share * total, (taken, share * total)
    # A tiny model: its weights, largest step, graphs and runtime leave the pool most of it.
    assert sizing.used_bytes < 0.1 * share * total
    assert taken >= sizing.pool_bytes
    assert sizing.max_concurrency == sizing.usable_blocks // sizing.blocks_per_seq
    prompts = [prompt_of(n, salt=13) for n in (5, 40)]
    assert all(len(s.output_token_ids) == 24 for s in engine.generate(prompts, GREEDY))
    assert_no_leaks(engine)


def test_a_share_that_holds_no_sequence_is_refused_on_the_gpu(tiny_llama_dir):
    from engine.kv_sizing import KVMemoryError

    with pytest.raises(KVMemoryError, match=r"gpu_memory_utilization 1e-06 of .* Raise"):
        gpu_engine(tiny_llama_dir, num_kv_blocks=None, gpu_memory_utilization=1e-6)


def test_a_cuda_clusters_pool_is_sized_from_the_gpu(tiny_llama_dir):
    """1. a colocated worker on a whole GPU, no kv_blocks; 2. it sizes its pool within
    gpu_memory_utilization 0.3 of the device, far past any CPU default; 3. the cluster
    reports that size and serves from it."""
    pytest.importorskip("ray")  # the rest of this module runs without the cluster's packages
    from cluster.config import CPU_POOL_KV_BLOCKS
    from tests.cluster_helpers import collect, run_cluster, tiny_cluster_config

    share = 0.3
    config = tiny_cluster_config(
        tiny_llama_dir,
        mode="colocated",
        gpus_per_worker=1,
        gpu_memory_utilization=share,
        block_size=256,
        decode={"kv_blocks": "auto"},
    )
    assert config.engine_config("decode").sizes_kv_from_device

    async def scenario(cluster):
        tokens, _ = await collect(cluster, prompt_of(20), GREEDY)
        return {
            "blocks": cluster.controller.kv_capacity("decode"),
            "lines": cluster.sized_pool_capacity(),
            "block_bytes": KVLayout.for_model(cluster.spec, torch.float32, 256).block_nbytes,
            "tokens": tokens,
        }

    seen = run_cluster(config, scenario)
    blocks, total = seen["blocks"], torch.cuda.get_device_properties(0).total_memory
    assert max(CPU_POOL_KV_BLOCKS.values()) < blocks
    # Within the share, the CUDA graphs' scratch block included:
    assert (blocks + 1) * seen["block_bytes"] <= share * total
    assert seen["lines"] == [
        f"colocated workers: KV sized from gpu_memory_utilization {share:g}: {blocks} blocks "
        f"of 256 tokens per worker, at most {blocks // 2} concurrent 512-token sequences"
    ]
    assert len(seen["tokens"]) == GREEDY.max_tokens


def test_the_device_checksum_equals_its_reference_on_the_gpu():
    from kv_transfer.device_checksum import wsum64, wsum64_reference

    generator = torch.Generator().manual_seed(5)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        cpu = torch.randn(40, 3, 2, 16, 3, 64, generator=generator).to(dtype)
        ids = [39, 0, 17, 17, 5]
        on_gpu = wsum64(cpu.to(DEVICE), ids)
        assert on_gpu == wsum64(cpu, ids)
        assert on_gpu[:2] == [
            wsum64_reference(cpu[b].contiguous().view(torch.uint8).numpy().tobytes())
            for b in ids[:2]
        ]


DECODE_STEP_TOLERANCE = 1.3
"""A decode step's median time under a running transfer may exceed its median alone by
at most this factor (plus 0.2 ms): the transfer's copies and checksums share the GPU's
memory bandwidth and SMs, but no decode kernel queues behind them. On the engine's own
stream, each step would wait for whole fetches (hundreds of MB of copies and sums)."""


def _decode_step_times(engine, steps: int) -> list[float]:
    import time

    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return times


def test_a_transfer_while_decode_runs_leaves_the_decode_step_time_unchanged(tiny_llama_dir):
    """Decode steps of 8 sequences (CUDA graphs), timed alone and then while another
    thread keeps fetching 128 MiB exports into the same pool on the `local` transport
    (the transfer stream, wsum64 verification): the step time holds within
    DECODE_STEP_TOLERANCE, and the fetches did run during the timed steps. The exports
    are made first, as a prefill worker's engine thread makes them between its steps."""
    import statistics
    import threading

    from engine.kv_cache import KVCachePool
    from kv_transfer import make_sender

    settings = dict(dtype="bfloat16", block_size=256, num_kv_blocks=4096, max_num_seqs=8)
    engine = gpu_engine(tiny_llama_dir, **settings)
    count = (128 << 20) // engine.layout.block_nbytes
    source = KVCachePool(engine.layout, count, DEVICE)
    source.kv.normal_()
    options = TransportOptions(chunk_bytes=64 << 20, token="cluster-secret", timeout_s=30)
    sender = make_sender("local", "prefill-under-decode", source, options)
    receiver = make_receiver("local", "decode-under-decode", engine.kv_pool, options)
    tickets = [
        sender.export(f"moved-{i}", list(range(count)), count * 256, "decode") for i in range(400)
    ]
    params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
    for i in range(8):
        engine.add_request(f"decode-{i}", prompt_of(20 + i, salt=i), params)
    _decode_step_times(engine, 20)  # prefill and warm-up
    alone = statistics.median(_decode_step_times(engine, 100))
    dst = engine.allocator.allocate(count, "transfer-target")
    done, results = threading.Event(), []

    def keep_fetching():
        for ticket in tickets:
            if done.is_set():
                return
            results.append(receiver.fetch(ticket, dst, timeout_s=30))

    mover = threading.Thread(target=keep_fetching)
    mover.start()
    try:
        busy = statistics.median(_decode_step_times(engine, 100))
        fetched_while_timed = len(results)
    finally:
        done.set()
        mover.join()
    engine.allocator.free(dst)
    print(f"decode step median: {alone * 1e3:.3f} ms alone, {busy * 1e3:.3f} ms under transfer")
    assert 3 <= fetched_while_timed < len(tickets)  # the mover was still busy at the end
    assert all(r.ok and r.checksum == "wsum64" for r in results)
    assert busy <= alone * DECODE_STEP_TOLERANCE + 0.0002, (alone, busy)
    for seq_id in list(engine.sequences):
        engine.abort(seq_id)
    receiver.close()
    sender.close()
    assert_no_leaks(engine)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="an NCCL pair needs two GPUs")
def test_a_dead_nccl_peer_fails_the_fetch_and_the_worker_serves_on(tiny_llama_dir):
    """The prefill side dies as its NCCL sends begin: the fetch fails (blocking wait
    raises in it; the watchdog aborts the pair's communicator, not this process), the
    destination blocks come back, and this process's engine decodes afterwards."""
    from dataclasses import replace

    from kv_transfer import FailureReason, FaultOptions
    from tests.kv_transfer_peer import Peer

    decode = gpu_engine(tiny_llama_dir, num_kv_blocks=64, prefix_caching=False)
    doomed = Peer(str(tiny_llama_dir), device="cuda:1")
    options = replace(OPTIONS, timeout_s=10, faults=FaultOptions(mode="kill"))
    prompt = prompt_of(37, salt=14)
    try:
        doomed.call("open_sender", "nccl-kill", "collective", options)
        ticket_dict, _, first, _ = doomed.call(
            "prefill_and_export", "nccl-kill", "req-dead", prompt, 8
        )
        receiver = make_receiver("collective", "decode-survivor", decode.kv_pool, options)
        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        seq = decode.begin_import("req-dead", prompt, first, params, len(prompt))
        assert decode.reserve_imports() == [seq]
        try:
            result = receiver.fetch(ExportTicket.from_dict(ticket_dict), seq.block_ids, 20)
        finally:
            receiver.close()
        assert not result.ok
        assert result.reason in {FailureReason.PEER_DIED, FailureReason.TIMEOUT}, result
        assert not decode.finish_import("req-dead", ok=False, recompute=False)
    finally:
        doomed.close()
    assert [len(s.output_token_ids) for s in decode.generate([prompt], GREEDY)] == [24]
    assert_no_leaks(decode)
