"""The committed gRPC stubs are exactly what `python -m proto.generate` makes now."""

from __future__ import annotations

from proto.generate import PROTO_DIR, generate


def test_committed_stubs_are_current(tmp_path):
    for fresh in generate(tmp_path):
        committed = PROTO_DIR / fresh.name
        assert committed.read_bytes() == fresh.read_bytes(), (
            f"{committed} is stale: run `python -m proto.generate`"
        )
