"""Prepared CPU weights cached on disk and memory-mapped by every worker that loads them.

Preparing the weights (stacking q/k/v and gate/up, packing every projection for the
native kernels) copies the whole model twice: 0.7 of the 0.9 s an engine takes to
build on the demo model, in every worker start and every restart after a kill. The
prepared tensors are saved once in one file, each tensor aligned for the kernels;
later loads map it and make one copy, from the page cache (shared by the workers of a
machine) into the worker's own anonymous memory on transparent huge pages
(engine/host_memory.py). Stepped from the file's mapping, the demo model's batch-1
float32 step took 10% longer: every 4 KiB of the weight stream was a TLB miss and a new
start for the hardware prefetcher.

The file is keyed by what the prepared tensors depend on: the checkpoint files
(path, size, mtime), config.json, the dtype, the ops' packed layout, `FORMAT` and, for
a tensor-parallel rank, the split and the rank (its shard is a file of its own).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import logging
import math
import os
import struct
import tempfile
from pathlib import Path

import numpy as np
import torch

from engine.envs import weight_cache_dir
from engine.host_memory import copied_to_huge_pages
from engine.layer_ops import Linear
from engine.model_spec import ModelSpec
from engine.parallel.shard import ModelShard
from engine.weights import LayerWeights, ModelWeights, checkpoint_files, load_weights

logger = logging.getLogger(__name__)

FORMAT = 2
"""Bumped whenever the way prepared weights are laid out or named here changes."""

SUFFIX = ".weights"
ALIGN = 64
"""Byte alignment of every tensor in the file (a cache line; AVX-512 vector width)."""


def load_prepared_weights(
    model_dir: Path,
    spec: ModelSpec,
    dtype: torch.dtype,
    device: str,
    ops,
    shard: ModelShard | None = None,
) -> ModelWeights:
    """The model's weights (a tensor-parallel rank's `shard` of them) as `ops` runs
    them. Called once per engine by `LlamaForward`.

    On CPU they come from the cache when it holds them, and are prepared and saved
    there otherwise (each rank's shard in a file of its own); other devices prepare
    them in place every time."""
    shard = shard or ModelShard.of(spec)
    if torch.device(device).type != "cpu":
        return _prepare(model_dir, spec, dtype, device, ops, shard)
    path = weight_cache_dir() / f"{cache_key(model_dir, dtype, ops, shard)}{SUFFIX}"
    cached = _read(path)
    if cached is not None:
        return cached
    tensors, layout = _flatten(_prepare(model_dir, spec, dtype, device, ops, shard))
    _write(path, tensors, layout, model_dir)
    return _unflatten(copied_to_huge_pages(tensors, ALIGN), layout)


def cache_key(model_dir: Path, dtype: torch.dtype, ops, shard: ModelShard | None = None) -> str:
    digest = hashlib.sha256(f"format={FORMAT};dtype={dtype};ops={ops.prepared_layout};".encode())
    if shard is not None and not shard.whole:
        digest.update(f"tp={shard.size};rank={shard.rank};".encode())
    digest.update(hashlib.sha256((model_dir / "config.json").read_bytes()).digest())
    for path in checkpoint_files(model_dir):
        stat = path.stat()
        digest.update(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns};".encode())
    return digest.hexdigest()[:32]


def _prepare(model_dir, spec, dtype, device, ops, shard: ModelShard) -> ModelWeights:
    weights = load_weights(model_dir, spec, dtype, device, shard)
    weights.prepare(ops.prepare_linear)
    return weights


def _flatten(weights: ModelWeights) -> tuple[dict[str, torch.Tensor], dict]:
    """Every tensor by name, and what rebuilds the objects around them."""
    tensors: dict[str, torch.Tensor] = {"final_norm": weights.final_norm}
    kinds: dict[str, dict] = {}

    def put(name: str, projection) -> None:
        fields = {}
        for field in dataclasses.fields(projection):
            value = getattr(projection, field.name)
            if isinstance(value, torch.Tensor):
                tensors[f"{name}.{field.name}"] = value
            else:
                fields[field.name] = value
        kinds[name] = {"class": type(projection).__name__, "fields": fields}

    layer_parts = []
    for index, layer in enumerate(weights.layers):
        norms, projections = layer.norms(), layer.projections()
        for name, norm in norms.items():
            tensors[f"layers.{index}.{name}"] = norm
        for name, projection in projections.items():
            put(f"layers.{index}.{name}", projection)
        layer_parts.append({"norms": list(norms), "projections": list(projections)})
    put("lm_head", weights.lm_head)
    tied = weights.embed is weights.lm_head
    if not tied:
        put("embed", weights.embed)
    layout = {"layers": layer_parts, "tied": tied, "projections": kinds}
    return tensors, layout


def _projection_classes() -> dict[str, type]:
    classes: dict[str, type] = {"Linear": Linear}
    with contextlib.suppress(ImportError):
        from engine.native.ops import PackedLinear

        classes["PackedLinear"] = PackedLinear
    return classes


def _unflatten(tensors: dict[str, torch.Tensor], layout: dict) -> ModelWeights:
    classes = _projection_classes()

    def take(name: str):
        kind = layout["projections"][name]
        cls = classes[kind["class"]]
        values = dict(kind["fields"])
        for field in dataclasses.fields(cls):
            if field.name not in values:
                values[field.name] = tensors.get(f"{name}.{field.name}")
        return cls(**values)

    layers = []
    for index, parts in enumerate(layout["layers"]):
        prefix = f"layers.{index}."
        layer = LayerWeights(
            input_norm=tensors[prefix + "input_norm"],
            qkv=take(prefix + "qkv"),
            o_proj=take(prefix + "o_proj"),
            post_norm=tensors[prefix + "post_norm"],
        )
        for name in parts["norms"]:
            setattr(layer, name, tensors[prefix + name])
        for name in parts["projections"]:
            if name.startswith("experts_"):
                getattr(layer, name.partition(".")[0]).append(None)
            layer.set_projection(name, take(prefix + name))
        layers.append(layer)
    lm_head = take("lm_head")
    embed = lm_head if layout["tied"] else take("embed")
    return ModelWeights(
        embed=embed, layers=layers, final_norm=tensors["final_norm"], lm_head=lm_head
    )


def _read(path: Path) -> ModelWeights | None:
    """The cached weights, mapped (not copied); None when missing or unreadable."""
    try:
        header, data = _map(path)
        tensors = {name: _tensor_at(data, entry) for name, entry in header["tensors"].items()}
        return _unflatten(copied_to_huge_pages(tensors, ALIGN), header["layout"])
    except FileNotFoundError:
        return None
    except Exception as exc:  # torn, or foreign: files are only ever renamed in whole
        logger.warning("removing unreadable weight cache %s: %s", path, exc)
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        return None


def _map(path: Path) -> tuple[dict, np.ndarray]:
    """The file's header and a copy-on-write mapping of all of it (MAP_PRIVATE; only
    ever read, but torch takes writable arrays only)."""
    with open(path, "rb") as file:
        (header_nbytes,) = struct.unpack("<Q", file.read(8))
        header = json.loads(file.read(header_nbytes))
    if header.get("format") != FORMAT:
        raise ValueError(f"format {header.get('format')}, not {FORMAT}")
    return header, np.memmap(path, dtype=np.uint8, mode="c")


def _tensor_at(data: np.ndarray, entry: dict) -> torch.Tensor:
    dtype = getattr(torch, entry["dtype"])
    shape = entry["shape"]
    nbytes = math.prod(shape) * dtype.itemsize
    raw = torch.from_numpy(data[entry["offset"] : entry["offset"] + nbytes])
    return raw.view(dtype).view(shape)


def _write(path: Path, tensors: dict, layout: dict, model_dir: Path) -> None:
    """Save for the next process. Workers that start together all miss the cache; the
    one holding the lock writes, the rest go on without waiting."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path.parent / ".lock", "w") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return
            if path.exists():
                return
            _remove_entries_of_deleted_models(path.parent)
            _write_file(path, tensors, layout, str(Path(model_dir).resolve()))
    except OSError as exc:
        logger.warning("could not cache prepared weights in %s: %s", path.parent, exc)


def _write_file(path: Path, tensors: dict, layout: dict, model_dir: str) -> None:
    """[header length][header JSON][tensors, each at an ALIGN-byte offset]: the kernels'
    vector loads want aligned weights, which safetensors' packed offsets do not give."""
    entries, offset = {}, 0
    for name, tensor in tensors.items():
        offset = -(-offset // ALIGN) * ALIGN
        entries[name] = {
            "dtype": str(tensor.dtype).removeprefix("torch."),
            "shape": list(tensor.shape),
            "offset": offset,
        }
        offset += tensor.numel() * tensor.element_size()
    header = {"format": FORMAT, "model_dir": model_dir, "layout": layout, "tensors": entries}
    relative = {name: entry["offset"] for name, entry in entries.items()}
    data_start = 0
    while True:  # the offsets are in the header: grow its room until it fits
        for name, entry in entries.items():
            entry["offset"] = relative[name] + data_start
        header_bytes = json.dumps(header).encode()
        if 8 + len(header_bytes) <= data_start:
            break
        data_start = -(-(8 + len(header_bytes)) // ALIGN) * ALIGN
    header_bytes = header_bytes.ljust(data_start - 8)
    with tempfile.NamedTemporaryFile(dir=path.parent, suffix=".tmp", delete=False) as tmp:
        try:
            tmp.write(struct.pack("<Q", len(header_bytes)) + header_bytes)
            for name, tensor in tensors.items():
                tmp.seek(entries[name]["offset"])
                tmp.write(tensor.contiguous().view(-1).view(torch.uint8).numpy().data)
            tmp.flush()
            os.chmod(tmp.name, 0o644)
            os.replace(tmp.name, path)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp.name)


def _remove_entries_of_deleted_models(cache_dir: Path) -> None:
    """Entries whose model directory is gone (tests' temporary models) go with it, and
    so do half-written files: only the lock's holder writes, so any left is a dead
    writer's (a worker killed during its first start)."""
    for partial in cache_dir.glob("*.tmp"):
        with contextlib.suppress(FileNotFoundError):
            partial.unlink()
    for entry in cache_dir.glob(f"*{SUFFIX}"):
        try:
            model_dir = _map(entry)[0]["model_dir"]
        except Exception:
            model_dir = None
        if model_dir is None or not Path(model_dir).is_dir():
            with contextlib.suppress(FileNotFoundError):
                entry.unlink()
