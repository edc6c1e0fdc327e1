from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from tests.factories import make_tiny_model


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory) -> dict[str, object]:
    root = tmp_path_factory.mktemp("tiny-models")
    return {
        family: make_tiny_model(root / family, family) for family in ("llama", "qwen2", "mistral")
    }


class _LazyModelDirs(dict):
    """Family -> tiny model directory, each written on first use (a session that tests
    one family does not pay for the others)."""

    def __init__(self, root):
        super().__init__()
        self.root = root

    def __missing__(self, family: str):
        self[family] = make_tiny_model(self.root / family, family)
        return self[family]


@pytest.fixture(scope="session")
def family_model_dirs(tmp_path_factory) -> dict[str, object]:
    """Tiny models of `tests.factories.NEW_FAMILIES`, written when first asked for."""
    return _LazyModelDirs(tmp_path_factory.mktemp("family-models"))


@pytest.fixture(scope="session")
def tiny_llama_dir(tiny_model_dirs):
    return tiny_model_dirs["llama"]


def make_engine(model_dir, **overrides) -> LLMEngine:
    settings = dict(
        model=str(model_dir), dtype="float32", block_size=8, num_kv_blocks=256, num_threads=1
    )
    settings.update(overrides)
    return LLMEngine(EngineConfig(**settings))


def assert_no_leaks(engine: LLMEngine) -> None:
    """Every scenario ends here: no sequence left, every KV block back in the pool."""
    assert not engine.has_unfinished()
    engine.allocator.assert_all_free()
