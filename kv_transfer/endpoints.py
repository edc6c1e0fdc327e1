"""Where a receiver reaches a sender: the `sender_endpoint` every export ticket carries.

A sender builds its endpoint once per export (`RegistrySender.endpoint`): its transport
name, worker and node, and one entry per server it runs (the `auto` transport serves
shm and collective both). Each transport server's `endpoint()` returns its own entry
type; the receiver of that transport reads the entry it needs, and finds it missing
when the sender does not serve it. A ticket crosses Ray (pickled by Ray) as these
dataclasses; `to_dict` / `from_dict` give its JSON form for anything else.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import ClassVar


@dataclass(frozen=True)
class HostPort:
    """An address a receiver dials."""

    host: str
    port: int

    def __iter__(self):
        """`host, port = address`, as a socket address unpacks."""
        return iter((self.host, self.port))

    @classmethod
    def from_dict(cls, data: dict) -> HostPort:
        return cls(str(data["host"]), int(data["port"]))


@dataclass(frozen=True)
class ShmTable:
    """The sender's export table file (kv_transfer/transports/shm_table.py)."""

    path: str
    blocks: int

    @classmethod
    def from_dict(cls, data: dict) -> ShmTable:
        return cls(str(data["path"]), int(data["blocks"]))


@dataclass(frozen=True)
class ShmEndpoint:
    """`shm`: the sender's pool file, its control server and its export table."""

    slot: ClassVar[str] = "shm"
    path: str
    """The pool file the receiver maps (its name ends in the writer's pid)."""
    nbytes: int
    control: HostPort
    table: ShmTable | None
    """None when the sender publishes no table (a sender-side fault is configured):
    every fetch then sends `begin`."""

    @classmethod
    def from_dict(cls, data: dict) -> ShmEndpoint:
        table = data.get("table")
        return cls(
            path=str(data["path"]),
            nbytes=int(data["nbytes"]),
            control=HostPort.from_dict(data["control"]),
            table=ShmTable.from_dict(table) if table is not None else None,
        )


@dataclass(frozen=True)
class CollectiveEndpoint:
    """`collective`: the sender's control server and rendezvous store, and the piece
    size it sends in (receivers post their receives with the fetch)."""

    slot: ClassVar[str] = "collective"
    control: HostPort
    store: HostPort
    piece_bytes: int

    @classmethod
    def from_dict(cls, data: dict) -> CollectiveEndpoint:
        return cls(
            control=HostPort.from_dict(data["control"]),
            store=HostPort.from_dict(data["store"]),
            piece_bytes=int(data["piece_bytes"]),
        )


@dataclass(frozen=True)
class GrpcEndpoint:
    """`grpc`: the sender's gRPC server, as a channel address (`host:port`)."""

    slot: ClassVar[str] = "grpc"
    address: str

    @classmethod
    def from_dict(cls, data: dict) -> GrpcEndpoint:
        return cls(str(data["address"]))


@dataclass(frozen=True)
class LocalEndpoint:
    """`local`: the sender's process; only a receiver in the same one can pull."""

    slot: ClassVar[str] = "local"
    pid: int

    @classmethod
    def from_dict(cls, data: dict) -> LocalEndpoint:
        return cls(int(data["pid"]))


ServerEndpoint = ShmEndpoint | CollectiveEndpoint | GrpcEndpoint | LocalEndpoint
_ENTRY_TYPES: tuple[type, ...] = (ShmEndpoint, CollectiveEndpoint, GrpcEndpoint, LocalEndpoint)


@dataclass(frozen=True)
class SenderEndpoint:
    """Everything a receiver needs to reach one sender, whichever transport it uses."""

    transport: str
    worker: str
    node: str
    """The sender's node id: `auto` receivers use shm only on the same node."""
    shm: ShmEndpoint | None = None
    collective: CollectiveEndpoint | None = None
    grpc: GrpcEndpoint | None = None
    local: LocalEndpoint | None = None

    @classmethod
    def serving(
        cls, transport: str, worker: str, node: str, entries: list[ServerEndpoint]
    ) -> SenderEndpoint:
        """The endpoint of a sender running servers with these `entries`."""
        return cls(transport, worker, node, **{entry.slot: entry for entry in entries})

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> SenderEndpoint:
        entries = [
            entry.from_dict(data[entry.slot])
            for entry in _ENTRY_TYPES
            if data.get(entry.slot) is not None
        ]
        return cls.serving(str(data["transport"]), str(data["worker"]), str(data["node"]), entries)
