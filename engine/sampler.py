"""Token selection: greedy, temperature, top-k, top-p, with per-request seeds.

A seeded request draws its n-th token from a generator seeded by (seed, n), not
from a generator that carries state across steps. So the same request gives the
same tokens whatever batch it rides in, and a request that migrates to another
worker mid-stream continues exactly as it would have.

The rows that sample are handled as one batch: temperature, top-k, softmax, top-p
and the inverse-CDF draw run once over [rows, vocab] (row by row, with an exponential
race, a 16-row step at a 49k vocabulary cost 24 ms more than greedy); only the one
uniform number of a seeded row is drawn alone, from that row's own generator.

Generators live on the device of the logits they draw noise for: a CPU generator
cannot fill a CUDA tensor, and would crash every sampled request on a GPU worker.

Before the draw, the rows that ask for it get their logits shaped (engine/penalties.py:
logit_bias, the min_tokens ban, the grammar mask of engine/structured.py, penalties),
and rows that ask for logprobs get them from those logits over the temperature
(engine/logprobs.py). A row that asks for none of this keeps the plain path: greedy
rows are one argmax over the raw logits, as before.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.logprobs import TokenLogprobs, token_logprobs
from engine.penalties import (
    RowHistory,
    apply_logit_bias,
    apply_penalties,
    ban_stops_before_min_tokens,
)
from engine.sampling_params import SamplingParams
from engine.structured import Guide, apply_bitmask, fill_bitmask

_MIX = 0x9E3779B97F4A7C15


def step_seed(seed: int, output_index: int) -> int:
    return (seed * _MIX + output_index * 0xBF58476D1CE4E5B9 + 1) % (1 << 63)


def greedy_tokens(logits: torch.Tensor) -> list[int]:
    """The first index of each row's largest logit. CPU float32 rows go through numpy: its
    argmax took 5 us over a 49152-token vocabulary where torch's took 52 (60 against
    430 us at 16 rows), on the decode step's critical path. Both pick the first maximum,
    and the first NaN where there is one."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return logits.numpy().argmax(axis=-1).tolist()
    return logits.argmax(dim=-1).tolist()


@dataclass
class SamplerOutput:
    tokens: list[int]
    logprobs: list[TokenLogprobs | None]
    """Per row: the chosen token's logprobs when its request asked (else None)."""


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
        histories: list[RowHistory] | None = None,
        guides: list[Guide | None] | None = None,
    ) -> list[int]:
        """logits [N, vocab] float32 -> one token id per row."""
        return self.run(logits, params, output_indices, histories, guides).tokens

    def run(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        output_indices: list[int],
        histories: list[RowHistory] | None = None,
        guides: list[Guide | None] | None = None,
        argmax: list[int] | None = None,
    ) -> SamplerOutput:
        """The engine's call: tokens and, for rows that asked, logprobs. `histories`
        (prompt and output tokens, EOS ids) and `guides` (grammar state) are needed
        only by rows whose params shape their logits. `argmax`: each row's greedy token
        where the step computed it (`StepResult.greedy`); used unless a row is shaped."""
        guides = guides or [None] * len(params)
        shaped = [
            i
            for i, p in enumerate(params)
            if p.shapes_logits(output_indices[i]) or guides[i] is not None
        ]
        if len(shaped) == len(params):  # every row: no gather and scatter
            logits = _shape(logits.clone(), params, histories, guides)
        elif shaped:
            logits = logits.clone()
            logits[shaped] = _shape(
                logits[shaped],
                [params[i] for i in shaped],
                [histories[i] for i in shaped] if histories else None,
                [guides[i] for i in shaped],
            )
        tokens = self._tokens(logits, params, output_indices, None if shaped else argmax)
        return SamplerOutput(tokens, _logprobs(logits, params, tokens))

    def _tokens(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        output_indices: list[int],
        argmax: list[int] | None,
    ) -> list[int]:
        tokens = list(argmax) if argmax is not None else greedy_tokens(logits)
        rows = [i for i, p in enumerate(params) if not p.greedy]
        if rows:
            picked = self._sample_rows(
                logits[rows], [params[i] for i in rows], [output_indices[i] for i in rows]
            )
            for row, token in zip(rows, picked, strict=True):
                tokens[row] = token
        return tokens

    def _sample_rows(
        self, logits: torch.Tensor, params: list[SamplingParams], output_indices: list[int]
    ) -> list[int]:
        device = logits.device
        temperature = torch.tensor([p.temperature for p in params], device=device)
        probs = _keep_min_p(torch.softmax(logits / temperature[:, None], dim=-1), params)
        uniform = self._uniforms(params, output_indices, device)
        vocab = probs.shape[-1]
        truncated = [i for i, p in enumerate(params) if 0 < p.top_k < vocab or p.top_p < 1.0]
        plain = [i for i in range(len(params)) if i not in set(truncated)]
        picked = torch.empty(len(params), dtype=torch.long, device=device)
        if plain:
            picked[plain] = _draw(probs[plain], uniform[plain])
        if truncated:
            picked[truncated] = _draw_truncated(
                probs[truncated],
                [params[i].top_k for i in truncated],
                [params[i].top_p for i in truncated],
                uniform[truncated],
            )
        return picked.tolist()

    def _uniforms(
        self, params: list[SamplingParams], output_indices: list[int], device: torch.device
    ) -> torch.Tensor:
        """One uniform number per row: from the row's own (seed, position) generator when
        seeded, else one batched draw from this device's self-seeded generator."""
        uniform = torch.empty(len(params), device=device)
        unseeded = [i for i, p in enumerate(params) if p.seed is None]
        if unseeded:
            draw = torch.rand(len(unseeded), device=device, generator=self._unseeded(device))
            uniform[unseeded] = draw
        for i, (p, index) in enumerate(zip(params, output_indices, strict=True)):
            if p.seed is not None:
                generator = torch.Generator(device=device).manual_seed(step_seed(p.seed, index))
                uniform[i] = torch.rand(1, device=device, generator=generator)[0]
        return uniform

    def _unseeded(self, device: torch.device) -> torch.Generator:
        if device not in self.unseeded:
            self.unseeded[device] = torch.Generator(device=device)
            self.unseeded[device].seed()
        return self.unseeded[device]


def _shape(
    logits: torch.Tensor,
    params: list[SamplingParams],
    histories: list[RowHistory] | None,
    guides: list[Guide | None],
) -> torch.Tensor:
    """The shaped rows' logits, in vLLM's order (engine/sampling_params.py)."""
    if histories is None:
        histories = [RowHistory([], []) for _ in params]
    apply_logit_bias(logits, params)
    ban_stops_before_min_tokens(logits, params, histories)
    guided = [i for i, g in enumerate(guides) if g is not None]
    words = (logits.shape[-1] + 31) // 32
    if len(guided) == len(guides):
        apply_bitmask(logits, fill_bitmask(guides, words))
    elif guided:
        masked = logits[guided]
        apply_bitmask(masked, fill_bitmask([guides[i] for i in guided], words))
        logits[guided] = masked
    apply_penalties(logits, params, histories)
    return logits


def _logprobs(
    logits: torch.Tensor, params: list[SamplingParams], tokens: list[int]
) -> list[TokenLogprobs | None]:
    """From the logits the draw used, over the temperature (1 for greedy rows)."""
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    result: list[TokenLogprobs | None] = [None] * len(params)
    if not rows:
        return result
    temperature = torch.tensor([params[i].temperature or 1.0 for i in rows], device=logits.device)
    computed = token_logprobs(
        logits[rows] / temperature[:, None],
        [tokens[i] for i in rows],
        [params[i].logprobs for i in rows],
    )
    for row, entry in zip(rows, computed, strict=True):
        result[row] = entry
    return result


def _keep_min_p(probs: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Rows with min_p: probabilities under min_p x the row's largest set to zero, the rest
    renormalized (top-p then measures its nucleus within what min_p kept)."""
    rows = [i for i, p in enumerate(params) if p.min_p > 0.0]
    if not rows:
        return probs
    kept = probs[rows]
    floor = torch.tensor([params[i].min_p for i in rows], device=probs.device)
    kept = kept.masked_fill(kept < floor[:, None] * kept.amax(dim=-1, keepdim=True), 0.0)
    probs[rows] = kept / kept.sum(dim=-1, keepdim=True)
    return probs


def _draw(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Inverse CDF: the first token whose running mass reaches (1 - u) x total. One
    uniform number per row (an exponential race, argmax(p / E), needs a log per
    vocabulary entry: 16 rows x 49k took 20 ms of a decode step). 1 - u lies in
    (0, 1], so a zero-probability token is never picked."""
    cdf = probs.cumsum(dim=-1)
    target = (1.0 - uniform) * cdf[:, -1]
    picked = torch.searchsorted(cdf, target[:, None]).squeeze(-1)
    return picked.clamp(max=probs.shape[-1] - 1)


_CANDIDATES = 1024
"""Tokens a top-k / top-p row is first cut to (its largest probabilities); the whole
vocabulary is sorted only when a row's nucleus does not fit in them."""


def _draw_truncated(
    probs: torch.Tensor, top_k: list[int], top_p: list[float], uniform: torch.Tensor
) -> torch.Tensor:
    """Top-k, then top-p over the renormalized top-k (the smallest prefix whose mass
    reaches top_p, at least one token), then the draw, on the largest probabilities."""
    vocab = probs.shape[-1]
    ks = torch.tensor([k if 0 < k < vocab else 0 for k in top_k], device=probs.device)
    ps = torch.tensor(top_p, device=probs.device)
    every_row_top_k = bool((ks > 0).all())
    width = min(vocab, int(ks.max()) if every_row_top_k else max(int(ks.max()), _CANDIDATES))
    while True:
        values, ids = probs.topk(width, dim=-1)
        in_k = torch.arange(width, device=probs.device)[None, :] < ks[:, None]
        values = torch.where((ks[:, None] == 0) | in_k, values, torch.zeros_like(values))
        cumulative = values.cumsum(dim=-1)
        mass = torch.where(ks > 0, cumulative[:, -1], torch.ones_like(ps))
        covered = (ks > 0) | (cumulative[:, -1] >= ps)
        if width == vocab or bool(covered.all()):
            break
        width = vocab  # a nucleus wider than the candidates: sort everything once
    drop = cumulative - values >= (ps * mass)[:, None]
    values = values.masked_fill(drop, 0.0)
    return ids.gather(-1, _draw(values, uniform)[:, None]).squeeze(-1)
