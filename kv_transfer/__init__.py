"""KV transfer between prefill and decode workers; see kv_transfer/base.py for the contract.

Workers import from here: `make_sender`, `make_receiver`, `TransportOptions`,
`FaultOptions`, and the contract types.
"""

from kv_transfer.base import (
    ExportTicket,
    FailureReason,
    KVReceiver,
    KVSender,
    KVTransferError,
    TransferResult,
    TransferState,
)
from kv_transfer.config import FaultOptions, TransportOptions
from kv_transfer.registry import TRANSPORTS, make_receiver, make_sender

__all__ = [
    "TRANSPORTS",
    "ExportTicket",
    "FailureReason",
    "FaultOptions",
    "KVReceiver",
    "KVSender",
    "KVTransferError",
    "TransferResult",
    "TransferState",
    "TransportOptions",
    "make_receiver",
    "make_sender",
]
