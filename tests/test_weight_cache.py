"""The prepared-weight cache: a cached engine computes what a freshly prepared one does.

`engine/weight_cache.py` saves the weights as the kernels take them (stacked, packed)
and later engines map that file instead of preparing again. Cached and fresh engines
must give bit-identical logits, on the native kernels and on the torch ops; a changed
checkpoint or a torn file must never be served.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from engine import weight_cache
from tests.factories import make_engine, our_greedy_with_logits, prompt_of


@pytest.fixture()
def cache_dir(tmp_path, monkeypatch):
    cache = tmp_path / "weights"
    monkeypatch.setenv("PDSERVE_WEIGHT_CACHE", str(cache))
    return cache


@pytest.fixture()
def model_copy(tiny_model_dirs, tmp_path):
    return shutil.copytree(tiny_model_dirs["qwen2"], tmp_path / "model")


def count_prepares(monkeypatch) -> list[int]:
    calls = [0]
    prepare = weight_cache._prepare

    def counted(*args):
        calls[0] += 1
        return prepare(*args)

    monkeypatch.setattr(weight_cache, "_prepare", counted)
    return calls


def entries(cache_dir) -> list:
    return sorted(cache_dir.glob(f"*{weight_cache.SUFFIX}"))


@pytest.mark.parametrize("kernels", ["native", "torch"])
def test_a_cached_engine_computes_exactly_what_a_fresh_one_does(
    model_copy, cache_dir, monkeypatch, kernels
):
    prepares = count_prepares(monkeypatch)
    prompt = prompt_of(13)
    fresh = our_greedy_with_logits(make_engine(model_copy, kernels=kernels), prompt, 12)
    assert prepares[0] == 1 and len(entries(cache_dir)) == 1

    cached = our_greedy_with_logits(make_engine(model_copy, kernels=kernels), prompt, 12)

    assert prepares[0] == 1  # the second engine mapped the file
    assert torch.equal(fresh, cached)


def test_a_changed_checkpoint_is_prepared_again(model_copy, cache_dir, monkeypatch):
    prepares = count_prepares(monkeypatch)
    make_engine(model_copy)
    (checkpoint,) = model_copy.glob("*.safetensors")
    stat = checkpoint.stat()
    os.utime(checkpoint, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))

    make_engine(model_copy)

    assert prepares[0] == 2 and len(entries(cache_dir)) == 2


@pytest.mark.parametrize("damage", ["header", "data"])
def test_a_torn_cache_file_is_prepared_again_and_replaced(
    model_copy, cache_dir, monkeypatch, damage
):
    prompt = prompt_of(9)
    fresh = our_greedy_with_logits(make_engine(model_copy), prompt, 8)
    (entry,) = entries(cache_dir)
    whole = entry.read_bytes()
    torn = b"\x10" + bytes(7) + b"{not json}" if damage == "header" else whole[: len(whole) // 2]
    entry.write_bytes(torn)
    prepares = count_prepares(monkeypatch)

    again = our_greedy_with_logits(make_engine(model_copy), prompt, 8)
    make_engine(model_copy)

    assert prepares[0] == 1  # prepared once more, then mapped from the rewritten file
    assert torch.equal(fresh, again)
    assert entry.read_bytes() == whole


def test_entries_of_deleted_models_are_removed_on_the_next_write(
    tiny_model_dirs, tmp_path, cache_dir
):
    doomed = shutil.copytree(tiny_model_dirs["llama"], tmp_path / "doomed")
    make_engine(doomed)
    shutil.rmtree(doomed)
    assert len(entries(cache_dir)) == 1
    (cache_dir / "tmpdeadwriter.tmp").write_bytes(b"half a file")  # a writer killed mid-way

    make_engine(shutil.copytree(tiny_model_dirs["llama"], tmp_path / "kept"))

    (kept,) = entries(cache_dir)
    assert kept.stat().st_size > 0
    assert not list(cache_dir.glob("*.tmp"))


def test_weights_are_copied_out_of_the_cache_file_into_one_aligned_arena(model_copy, cache_dir):
    """A worker steps its own copy of the weights (on huge pages where the kernel gives
    them), not the file's mapping: zeros written over the file in place (which a mapping
    of it would show) leave a built engine's answers as they were."""
    prompt = prompt_of(11)
    fresh = our_greedy_with_logits(make_engine(model_copy, kernels="native"), prompt, 4)
    engine = make_engine(model_copy, kernels="native")  # copies out of the file
    for path in entries(cache_dir):
        with open(path, "r+b") as file:
            file.write(bytes(path.stat().st_size))
    assert torch.equal(our_greedy_with_logits(engine, prompt, 4), fresh)


def test_copied_to_huge_pages_keeps_every_tensor_and_aligns_each():
    from engine.host_memory import copied_to_huge_pages

    tensors = {
        "odd": torch.arange(7, dtype=torch.float32),
        "matrix": torch.randn(5, 3),
        "half": torch.randn(9).to(torch.bfloat16),
        "strided": torch.randn(4, 6)[:, ::2],
    }
    copies = copied_to_huge_pages(tensors, align=64)
    for name, tensor in tensors.items():
        assert copies[name].dtype == tensor.dtype and copies[name].shape == tensor.shape
        assert torch.equal(copies[name], tensor)
        assert copies[name].data_ptr() % 64 == 0
