"""Fixtures only (pytest injects them by name); helpers are in tests/factories.py."""

from __future__ import annotations

import pytest

from tests.factories import LazyModelDirs, make_tiny_model


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory) -> dict[str, object]:
    root = tmp_path_factory.mktemp("tiny-models")
    return {
        family: make_tiny_model(root / family, family) for family in ("llama", "qwen2", "mistral")
    }


@pytest.fixture(scope="session")
def family_model_dirs(tmp_path_factory) -> dict[str, object]:
    """Tiny models of `tests.factories.NEW_FAMILIES`, written when first asked for."""
    return LazyModelDirs(tmp_path_factory.mktemp("family-models"))


@pytest.fixture(scope="session")
def tiny_llama_dir(tiny_model_dirs):
    return tiny_model_dirs["llama"]


@pytest.fixture(scope="session")
def tp_model_dirs(tmp_path_factory) -> dict[str, object]:
    """Tiny models whose heads split over 2 ranks (`tests.factories.TP_FAMILIES`, and
    any other family), written when first asked for."""
    return LazyModelDirs(tmp_path_factory.mktemp("tp-models"))
