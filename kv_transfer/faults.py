"""Fault injection for experiments and tests, configured by `FaultOptions`.

A transport makes one `FaultPlan` per transfer on the side that moves the bytes and
asks it before each piece (`hit(piece_offset)`). The plan decides once, at creation,
whether this transfer is hit (`probability`), and strikes when the transfer crosses
`after_fraction` of its bytes:

- drop: `DropTransfer` is raised; the transport ends the transfer without telling
  the receiver anything (stream ends, connection closes, nothing arrives).
- stall: sleeps `stall_s` (meant to exceed the receiver's timeout), then continues.
- kill: `os._exit(17)` of this process, the sender dying mid-transfer.
- corrupt: `hit` returns True for that one piece; the transport flips a byte in the
  bytes it moves (never in the sender's pool), so the receiver's checksum fails.
"""

from __future__ import annotations

import logging
import os
import random
import time

from kv_transfer.config import FaultOptions

logger = logging.getLogger(__name__)

KILL_EXIT_CODE = 17


class DropTransfer(Exception):
    """Raised inside a transport's data path to drop the current transfer silently."""


class FaultPlan:
    """The fault (if any) of one transfer of `total_bytes`."""

    def __init__(self, options: FaultOptions, total_bytes: int, request_id: str = ""):
        self.mode = options.mode
        self.stall_s = options.stall_s
        self.request_id = request_id
        armed = self.mode != "none" and random.random() < options.probability
        self._at = int(total_bytes * options.after_fraction) if armed else None

    @property
    def armed(self) -> bool:
        """Whether a fault is still to strike in this transfer."""
        return self._at is not None

    def hit(self, piece_offset: int, piece_nbytes: int) -> bool:
        """Called before moving a piece; True means corrupt this piece."""
        if self._at is None or piece_offset + piece_nbytes < self._at:
            return False
        self._at = None  # strike once
        logger.warning("[request %s] injecting fault %s", self.request_id, self.mode)
        if self.mode == "drop":
            raise DropTransfer(self.request_id)
        if self.mode == "stall":
            time.sleep(self.stall_s)
            return False
        if self.mode == "kill":
            os._exit(KILL_EXIT_CODE)
        return self.mode == "corrupt"


def corrupt_in_place(data) -> None:
    """Flip every bit of the first byte of a writable uint8 buffer (tensor or bytearray)."""
    data[0] = 255 - int(data[0])
