"""Chunk messages of proto/kv_transfer.proto encoded and decoded by hand, without copies.

The bytes on the wire are exactly what protobuf would write for
`FetchResponse{chunk: Chunk{offset, data}}`; the server's response serializer and
the client's response deserializer (kv_transfer/transports/grpc.py) call these so a
chunk's payload is copied once out of the sender's pool and viewed, not copied, on
arrival. Every other message goes through the generated protobuf classes.
"""

from __future__ import annotations

from proto import kv_transfer_pb2 as pb

_RESPONSE_CHUNK = 0x0A  # field 1 (chunk), wire type 2
_CHUNK_OFFSET = 0x08  # field 1 (offset), wire type 0
_CHUNK_DATA = 0x12  # field 2 (data), wire type 2


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        low = value & 0x7F
        value >>= 7
        if value:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)


def _read_varint(buf, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7


def encode_chunk(offset: int, data) -> bytes:
    """Serialized FetchResponse holding one chunk; `data` is any buffer (one copy)."""
    inner_head = bytes([_CHUNK_OFFSET]) + _varint(offset) + bytes([_CHUNK_DATA])
    inner_head += _varint(len(data))
    head = bytes([_RESPONSE_CHUNK]) + _varint(len(inner_head) + len(data)) + inner_head
    return b"".join((head, data))


def serialize_response(message) -> bytes:
    """Server side: pre-encoded chunks pass through, protobuf messages are serialized."""
    return message if isinstance(message, bytes) else message.SerializeToString()


def deserialize_response(raw: bytes):
    """Client side: ("chunk", offset, memoryview) for chunks, else a FetchResponse."""
    if not raw or raw[0] != _RESPONSE_CHUNK:
        return pb.FetchResponse.FromString(raw)
    _, pos = _read_varint(raw, 1)
    offset, data = 0, memoryview(raw)[0:0]
    while pos < len(raw):
        tag = raw[pos]
        if tag == _CHUNK_OFFSET:
            offset, pos = _read_varint(raw, pos + 1)
        elif tag == _CHUNK_DATA:
            length, pos = _read_varint(raw, pos + 1)
            data, pos = memoryview(raw)[pos : pos + length], pos + length
        else:  # a field we do not hand-parse: let protobuf do it
            return pb.FetchResponse.FromString(raw)
    return ("chunk", offset, data)
