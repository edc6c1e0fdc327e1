"""KV transfer between prefill and decode workers; see kv_transfer/base.py for the contract.

Workers import from here: `make_sender`, `make_receiver`, `TransportOptions`,
`FaultOptions`, and the contract types. The names load on first use, so that code
that needs only the options (the cluster's config, read by every CLI command) does
not import torch with the transports.
"""

from __future__ import annotations

import importlib

_HOMES = {
    "ExportTicket": "kv_transfer.base",
    "FailureReason": "kv_transfer.base",
    "KVReceiver": "kv_transfer.base",
    "KVSender": "kv_transfer.base",
    "KVTransferError": "kv_transfer.base",
    "TransferResult": "kv_transfer.base",
    "TransferState": "kv_transfer.base",
    "FaultOptions": "kv_transfer.config",
    "TransportOptions": "kv_transfer.config",
    "TRANSPORTS": "kv_transfer.registry",
    "make_receiver": "kv_transfer.registry",
    "make_sender": "kv_transfer.registry",
}

__all__ = sorted(_HOMES)


def __getattr__(name: str):
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'kv_transfer' has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)
