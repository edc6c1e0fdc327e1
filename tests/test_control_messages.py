"""The control channel's messages are typed on both ends and the same bytes on the wire.

Each message's JSON is compared with the exact text the shm and collective transports
sent before they had types (keys in the same order, absent ones left out), so a sender
and a receiver of different versions still understand each other; and what a handler
parses comes back as the message that was sent.
"""

from __future__ import annotations

import json

import pytest

from kv_transfer.base import FailureReason
from kv_transfer.control_messages import (
    Begin,
    Done,
    Fetch,
    Heartbeat,
    Pair,
    Reply,
    UnknownOp,
    parse_request,
)

WIRE = [
    (Begin(4096, "r1"), '{"op": "begin", "nbytes": 4096, "request_id": "r1"}'),
    (Heartbeat("r1"), '{"op": "heartbeat", "request_id": "r1"}'),
    (Heartbeat(""), '{"op": "heartbeat", "request_id": ""}'),
    (Pair("decode-0"), '{"op": "pair", "receiver": "decode-0"}'),
    (
        Fetch("r1", [4, 5, 6]),
        '{"op": "fetch", "request_id": "r1", "dst_block_ids": [4, 5, 6]}',
    ),
    (Reply(True), '{"ok": true}'),
    (Reply(False, FailureReason.UNKNOWN_REQUEST), '{"ok": false, "reason": "unknown_request"}'),
    (Reply(True, FailureReason.UNKNOWN_REQUEST), '{"ok": true, "reason": "unknown_request"}'),
    (Reply(False, FailureReason.UNAUTHORIZED), '{"ok": false, "reason": "unauthorized"}'),
    (
        Reply(False, FailureReason.INTERNAL, "op None"),
        '{"ok": false, "reason": "internal", "message": "op None"}',
    ),
    (Reply(True, prefix="kv/p/d/1"), '{"ok": true, "prefix": "kv/p/d/1"}'),
    (Reply(True, piece_bytes=1 << 20), '{"ok": true, "piece_bytes": 1048576}'),
    (Done(3 << 20), '{"done": true, "nbytes": 3145728}'),
]


@pytest.mark.parametrize(("message", "text"), WIRE, ids=[t for _, t in WIRE])
def test_each_message_is_the_json_the_transports_always_sent(message, text):
    assert json.dumps(message.to_json()) == text
    data = json.loads(text)
    if "op" in data:
        assert parse_request(data) == message
    elif "done" in data:
        assert Done.from_json(data) == message
    else:
        assert Reply.from_json(data) == message


def test_handlers_read_requests_as_leniently_as_before():
    assert parse_request({"op": "heartbeat"}) == Heartbeat("")
    assert parse_request({"op": "begin", "request_id": 7}) == Begin(0, "7")
    assert parse_request({"op": "pair"}) == Pair("None")
    assert parse_request({"op": "ping", "token": "t"}) == UnknownOp("ping")
    assert parse_request({}) == UnknownOp(None)
    with pytest.raises(KeyError):  # the server closes such a connection
        parse_request({"op": "fetch", "request_id": "r1"})


def test_a_refusal_without_a_known_reason_reads_as_internal():
    assert Reply.from_json({"ok": False}).failure == FailureReason.INTERNAL
    assert Reply.from_json({"ok": False, "reason": "novel"}).failure == FailureReason.INTERNAL
    assert Reply.from_json({"ok": False, "reason": "timeout"}).failure == FailureReason.TIMEOUT
    assert Done.from_json({"ok": True}) is None
