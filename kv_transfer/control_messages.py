"""The messages of the control channel (kv_transfer/control.py), as small dataclasses.

The channel carries JSON objects; these give them types on both ends. A receiver
builds a request and sends its `to_json()`; the sender's handler reads what arrives
with `parse_request`, answers with a `Reply` (or, for a collective fetch, a `Reply`
then a `Done`), and the receiver reads the answer with `Reply.from_json`. The JSON
is byte for byte what these exchanges always sent (keys in the same order, absent
ones left out), so a sender and a receiver of different versions still agree.

    receiver -> sender                          sender -> receiver
    Begin(nbytes, request_id)        (shm)      Reply(ok)
    Heartbeat(request_id)            (both)     Reply(ok, reason=unknown_request)
    Pair(receiver)                   (coll.)    Reply(ok, prefix=...)
    Fetch(request_id, dst_block_ids[,   (coll.)    Reply(ok, piece_bytes=...), ..., Done(nbytes)
          first_block])
    Follow(request_id, first_block,     (push)     SegmentNote, [pieces,] ... / WAITING ...,
           dst_block_ids)                          Done(nbytes); Reply(False) when gone

Parsing is as lenient as the handlers always were (a missing id reads as an unknown
request); a message that cannot be read at all raises, and the control server closes
that connection.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import ClassVar

from kv_transfer.base import FailureReason


class _Request:
    """`to_json`: the op first, then the fields in their declared order."""

    op: ClassVar[str]

    def to_json(self) -> dict:
        return {"op": self.op, **{f.name: getattr(self, f.name) for f in fields(self)}}


@dataclass(frozen=True)
class Begin(_Request):
    """shm: a receiver is about to copy an export's blocks (`nbytes` of them) itself; the
    sender extends its lease and counts the transfer served, or says it is gone."""

    op: ClassVar[str] = "begin"
    nbytes: int
    request_id: str

    @classmethod
    def from_json(cls, data: dict) -> Begin:
        return cls(int(data.get("nbytes", 0)), str(data.get("request_id", "")))


@dataclass(frozen=True)
class Heartbeat(_Request):
    """Extend the lease of `request_id`'s export; an empty id only asks whether the
    sender still answers (`control.responsive`)."""

    op: ClassVar[str] = "heartbeat"
    request_id: str

    @classmethod
    def from_json(cls, data: dict) -> Heartbeat:
        return cls(str(data.get("request_id", "")))


@dataclass(frozen=True)
class Pair(_Request):
    """collective: the first message of a receiver's connection, naming it; the sender
    answers with the prefix the pair's group rendezvouses under."""

    op: ClassVar[str] = "pair"
    receiver: str

    @classmethod
    def from_json(cls, data: dict) -> Pair:
        return cls(str(data.get("receiver")))


@dataclass(frozen=True)
class Fetch(_Request):
    """collective: send `request_id`'s blocks into the receiver's `dst_block_ids`: the
    export's last ones, or for a segment of a streamed export those from position
    `first_block` on (sent only when set, so a whole fetch's JSON is as it was)."""

    op: ClassVar[str] = "fetch"
    request_id: str
    dst_block_ids: list[int]
    first_block: int | None = None

    def to_json(self) -> dict:
        data = super().to_json()
        if self.first_block is None:
            del data["first_block"]
        return data

    @classmethod
    def from_json(cls, data: dict) -> Fetch:
        first = data.get("first_block")
        return cls(
            str(data.get("request_id")),
            list(data["dst_block_ids"]),
            int(first) if first is not None else None,
        )


@dataclass(frozen=True)
class Follow(_Request):
    """push (shm, collective): the receiver's standing transfer of `request_id`'s export
    from block position `first_block` on, into `dst_block_ids` (its blocks for those
    positions, in order). The sender answers with a `SegmentNote` per run of blocks as
    they are exported (collective: their pieces right after it), `Waiting` while none
    comes, a refusal (`Reply`) when the export is gone, and `Done` after the final one."""

    op: ClassVar[str] = "follow"
    request_id: str
    first_block: int
    dst_block_ids: list[int]

    @classmethod
    def from_json(cls, data: dict) -> Follow:
        return cls(
            str(data.get("request_id")),
            int(data.get("first_block", 0)),
            list(data.get("dst_block_ids", [])),
        )


@dataclass(frozen=True)
class SegmentNote:
    """push: the next blocks of a followed export, sent as soon as they are exported: the
    sender's block ids from position `first_block` on, their checksums, the tokens the
    export holds so far, and whether it is complete with them."""

    first_block: int
    block_ids: list[int]
    checksums: list[int]
    num_tokens: int
    final: bool

    def to_json(self) -> dict:
        return {"segment": {f.name: getattr(self, f.name) for f in fields(self)}}

    @classmethod
    def from_json(cls, data: dict) -> SegmentNote | None:
        """The message as a `SegmentNote`, or None when it is not one."""
        note = data.get("segment")
        if not isinstance(note, dict):
            return None
        return cls(
            int(note["first_block"]),
            [int(b) for b in note["block_ids"]],
            [int(c) for c in note["checksums"]],
            int(note["num_tokens"]),
            bool(note["final"]),
        )


WAITING = {"waiting": True}
"""push: no new block yet; sent every `push.KEEPALIVE_S` so that each side of a standing
transfer sees the other die, and the receiver can act on a cancel."""


@dataclass(frozen=True)
class UnknownOp:
    """A request whose `op` no handler knows; it is answered `internal`."""

    op: object


ControlRequest = Begin | Heartbeat | Pair | Fetch | Follow
_REQUESTS: dict[str, type] = {cls.op: cls for cls in (Begin, Heartbeat, Pair, Fetch, Follow)}


def parse_request(data: dict) -> ControlRequest | UnknownOp:
    """What a sender's handler received."""
    kind = _REQUESTS.get(data.get("op"))  # type: ignore[arg-type]
    return kind.from_json(data) if kind is not None else UnknownOp(data.get("op"))


@dataclass(frozen=True)
class Reply:
    """The sender's answer to a request: `ok`, and what else that request returns."""

    ok: bool
    reason: FailureReason | None = None
    """Why not (a heartbeat's reply always carries `unknown_request`, read only when
    not ok)."""
    message: str | None = None
    prefix: str | None = None
    """`Pair`: the rendezvous prefix of the pair's group."""
    piece_bytes: int | None = None
    """`Fetch`: the piece size the sender sends in."""

    def to_json(self) -> dict:
        data: dict = {"ok": self.ok}
        for f in fields(self)[1:]:
            value = getattr(self, f.name)
            if value is not None:
                data[f.name] = value.value if isinstance(value, FailureReason) else value
        return data

    @classmethod
    def from_json(cls, data: dict) -> Reply:
        reason = data.get("reason")
        return cls(
            ok=bool(data.get("ok")),
            reason=_failure(reason) if reason is not None else None,
            message=data.get("message"),
            prefix=data.get("prefix"),
            piece_bytes=data.get("piece_bytes"),
        )

    @property
    def failure(self) -> FailureReason:
        """The reason of a refusal (`internal` when the sender gave none)."""
        return self.reason or FailureReason.INTERNAL


@dataclass(frozen=True)
class Done:
    """collective: every piece of a fetch was sent (`nbytes` in all)."""

    nbytes: int

    def to_json(self) -> dict:
        return {"done": True, "nbytes": self.nbytes}

    @classmethod
    def from_json(cls, data: dict) -> Done | None:
        """The message as a `Done`, or None when it is not one."""
        return cls(int(data.get("nbytes", 0))) if data.get("done") else None


def _failure(reason: object) -> FailureReason:
    try:
        return FailureReason(reason)
    except ValueError:  # a reason this side does not know
        return FailureReason.INTERNAL
