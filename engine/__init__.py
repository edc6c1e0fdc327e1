"""Model execution shared by prefill and decode workers.

A request enters as token ids, gets a block table from the paged KV pool, runs
through the decoder forward of its architecture (engine/architectures.py) in prefill
chunks and then decode steps, and leaves as sampled token ids that the incremental
detokenizer turns into text.
"""

from engine.config import EngineConfig
from engine.errors import EngineError, InvalidRequestError, OutOfBlocksError
from engine.sampling_params import SamplingParams

__all__ = [
    "EngineConfig",
    "EngineError",
    "InvalidRequestError",
    "OutOfBlocksError",
    "SamplingParams",
]
