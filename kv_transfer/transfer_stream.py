"""The CUDA stream a transport side moves a device pool's bytes on, apart from compute.

The engine runs every prefill and decode kernel on its device's default stream. A
copy, NCCL send or receive issued there (or from another thread while the default
stream is current, as it is on every thread until told otherwise) queues in line with
those kernels: a decode step waits behind a transfer's bytes. Each receiver and each
sender server of a device pool owns one `TransferStream`; everything a transfer puts
on the device runs inside `active()`:

- copies (`local`, gRPC's host-to-device and device-to-host), the receiver's device
  checksums, and NCCL's send and receive, whose kernels run on NCCL's own stream after
  waiting only for the stream current when they were issued: this one, not compute's;
- `wait_done()` then blocks the calling thread until everything it queued has
  finished (an event recorded on the stream and waited for), before a receiver reports
  DONE or FAILED: the engine reads (or reuses) the destination blocks only after that,
  so no compute kernel ever waits for a transfer, and no transfer's write outlives its
  fetch.

Ordering against compute needs no event: a sender's blocks were final before any
transfer could start (the export's device checksums are read back on the engine
thread, after the prefill step that wrote them), and a receiver's destination blocks
are reserved for the import, which no step reads until `wait_done` has returned.
On a CPU pool there is no stream; `active()` and `wait_done()` do nothing.
"""

from __future__ import annotations

import contextlib
import time

import torch

_NO_STREAM = contextlib.nullcontext()
POLL_S = 0.0005
"""How often `wait_done` looks at the event while it waits with a deadline."""


class TransferStream:
    """One side's transfer stream; made by the receiver or sender server at start."""

    def __init__(self, device: torch.device):
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def active(self) -> contextlib.AbstractContextManager:
        """Make the transfer stream current on this thread for a `with` block (per
        thread: concurrent fetches on other threads set their own); nothing on a CPU
        pool, at the cost of entering a null context (every CPU fetch passes here)."""
        return _NO_STREAM if self.stream is None else torch.cuda.stream(self.stream)

    def wait_done(self, timeout_s: float | None = None) -> bool:
        """Block until all work queued on the stream so far has finished; False where
        `timeout_s` passed first (a failed transfer's aborted NCCL work that never
        drains: the caller logs it)."""
        if self.stream is None:
            return True
        event = torch.cuda.Event()
        event.record(self.stream)
        if timeout_s is None:
            event.synchronize()
            return True
        deadline = time.monotonic() + timeout_s
        while not event.query():
            if time.monotonic() >= deadline:
                return False
            time.sleep(POLL_S)
        return True
