"""Token selection: greedy, temperature, top-k, top-p, with per-request seeds.

A seeded request draws its n-th token from a generator seeded by (seed, n), not
from a generator that carries state across steps. So the same request gives the
same tokens whatever batch it rides in, and a request that migrates to another
worker mid-stream continues exactly as it would have.

Generators live on the device of the logits they draw noise for: a CPU generator
cannot fill a CUDA tensor, and would crash every sampled request on a GPU worker.
"""

from __future__ import annotations

import torch

from engine.sampling_params import SamplingParams

_MIX = 0x9E3779B97F4A7C15


def step_seed(seed: int, output_index: int) -> int:
    return (seed * _MIX + output_index * 0xBF58476D1CE4E5B9 + 1) % (1 << 63)


class Sampler:
    """Called by the engine once per step with the logits of sequences that need a token."""

    def __init__(self) -> None:
        self.unseeded: dict[torch.device, torch.Generator] = {}
        """One self-seeded generator per device, for requests without a seed."""

    def sample(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        output_indices: list[int],
    ) -> list[int]:
        """logits [N, vocab] float32 -> one token id per row."""
        tokens = logits.argmax(dim=-1).tolist()
        for row, (p, index) in enumerate(zip(params, output_indices, strict=True)):
            if not p.greedy:
                tokens[row] = self._sample_row(logits[row], p, index)
        return tokens

    def _sample_row(self, logits: torch.Tensor, p: SamplingParams, output_index: int) -> int:
        logits = logits / p.temperature
        if p.top_k and p.top_k < logits.shape[-1]:
            kth = torch.topk(logits, p.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if p.top_p < 1.0:
            probs = _top_p_filter(probs, p.top_p)
        generator = self._generator(probs.device, p.seed, output_index)
        # Exponential race: argmax(p / E) with E ~ Exp(1) samples from p in one pass.
        noise = torch.empty_like(probs).exponential_(generator=generator)
        return int((probs / noise).argmax())

    def _generator(self, device: torch.device, seed: int | None, index: int) -> torch.Generator:
        if seed is not None:
            return torch.Generator(device=device).manual_seed(step_seed(seed, index))
        if device not in self.unseeded:
            self.unseeded[device] = torch.Generator(device=device)
            self.unseeded[device].seed()
        return self.unseeded[device]


def _top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    sorted_probs, order = probs.sort(descending=True)
    cumulative = sorted_probs.cumsum(-1)
    # Keep the smallest prefix whose mass reaches top_p (always at least one token).
    drop_sorted = cumulative - sorted_probs >= top_p
    drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
    return probs.masked_fill(drop, 0.0)
