"""A safetensors checkpoint read lazily, whole tensors or slices of them.

The weight loader (engine/weights.py) asks for each tensor by name as it builds the
model. Files are memory-mapped by safetensors and stay open for the load; a tensor is
read only when asked for, and a tensor-parallel rank asks for its rows or columns only
(`read(name, index)`, through `get_slice`), so it never holds more of the checkpoint
than its shard: a model larger than one device loads over several.

Every name read is marked used; whatever is left at the end (`unused`) is the loader's
to refuse.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch
from safetensors import safe_open

from engine.errors import ModelLoadError

Index = tuple[slice, ...]
"""Per leading dimension, the part to read (`(slice(0, 8),)`: rows 0..7;
`(slice(None), slice(4, 8))`: columns 4..7 of every row)."""


def checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        shard_names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / name for name in shard_names]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors in {model_dir}")
    return files


class Checkpoint:
    """Open for one load (a context manager); `read` each tensor at most once."""

    def __init__(self, model_dir: str | Path):
        self.model_dir = Path(model_dir)
        self._files = contextlib.ExitStack()
        self._handles: dict[str, object] = {}
        for path in checkpoint_files(self.model_dir):
            handle = self._files.enter_context(safe_open(str(path), framework="pt"))
            for name in handle.keys():  # noqa: SIM118 - safe_open is not a dict
                self._handles[name] = handle
        self.unused: set[str] = set(self._handles)
        """Names not read yet."""
        self.bytes_read = 0
        """Bytes of the tensors (or slices) read so far."""

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._files.close()

    def __contains__(self, name: str) -> bool:
        """Whether `name` is in the checkpoint and not read yet."""
        return name in self.unused

    def shape(self, name: str) -> list[int]:
        return list(self._handles[name].get_slice(name).get_shape())

    def read(self, name: str, index: Index = ()) -> torch.Tensor:
        """The tensor `name`, or its part `index` (read through a slice of the mapping,
        never whole). Raises KeyError when it is missing or was read already."""
        return self.read_parts(name, [index])

    def read_parts(self, name: str, indexes: list[Index], dim: int = 0) -> torch.Tensor:
        """Several parts of one tensor, concatenated along `dim` (a rank of a fused
        q|k|v projection takes its q rows, its k rows and its v rows)."""
        if name not in self.unused:
            raise KeyError(name)
        self.unused.discard(name)
        handle = self._handles[name]
        parts = [
            handle.get_slice(name)[index] if index else handle.get_tensor(name) for index in indexes
        ]
        tensor = parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)
        self.bytes_read += tensor.numel() * tensor.element_size()
        return tensor
