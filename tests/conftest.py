"""Fixtures only (pytest injects them by name); helpers are in tests/factories.py."""

from __future__ import annotations

import pytest
import ray

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


@pytest.fixture(scope="module")
def ray_head():
    """One local Ray head for a whole module's clusters. A cluster's controller starts no
    head of its own when Ray is already up, and at shutdown stops only its own actors
    and placement groups: the module pays the head's start once (a tiny cluster starts
    in about 4 s on it, against about 11 s with a head of its own on 2 cores). Tests
    that need their own head (core pinning, head restarts) take `no_ray_head`."""
    from cluster.control.local_head import start_local_head

    if ray.is_initialized():
        ray.shutdown()
    start_local_head("pdserve-tests")
    yield
    if ray.is_initialized():
        ray.shutdown()


@pytest.fixture
def no_ray_head():
    """For a test whose cluster must start (and stop) a head of its own: the module's
    shared head, if any, is stopped first; later tests of the module then start their
    own."""
    if ray.is_initialized():
        ray.shutdown()
    yield
    if ray.is_initialized():
        ray.shutdown()
