"""What changes a row's logits before the draw, with vLLM's semantics, batched.

Called by the sampler on the rows that need it (`SamplingParams.shapes_logits`), in
this order: logit_bias is added; until `min_tokens` are out, EOS and the request's
stop token ids are banned; the grammar's mask bans what it cannot take; then the
penalties. Nothing here keeps state between steps: the output counts are rebuilt
from the decided tokens every step, so a request that migrated to another worker is
penalized exactly as it would have been where it started.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.sampling_params import SamplingParams


@dataclass
class RowHistory:
    """The tokens a row's penalties look at."""

    prompt_token_ids: list[int]
    output_token_ids: list[int]
    eos_token_ids: frozenset[int] = frozenset()


def apply_logit_bias(logits: torch.Tensor, params: list[SamplingParams]) -> None:
    rows, cols, values = [], [], []
    vocab = logits.shape[-1]
    for row, p in enumerate(params):
        for token_id, bias in p.logit_bias:
            if token_id < vocab:
                rows.append(row)
                cols.append(token_id)
                values.append(bias)
    if rows:
        index = (_long(rows, logits), _long(cols, logits))
        logits.index_put_(index, torch.tensor(values, device=logits.device), accumulate=True)


def ban_stops_before_min_tokens(
    logits: torch.Tensor, params: list[SamplingParams], histories: list[RowHistory]
) -> None:
    rows, cols = [], []
    vocab = logits.shape[-1]
    for row, (p, h) in enumerate(zip(params, histories, strict=True)):
        if len(h.output_token_ids) >= p.min_tokens:
            continue
        stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(h.eos_token_ids))
        for token_id in stops:
            if token_id < vocab:
                rows.append(row)
                cols.append(token_id)
    if rows:
        logits[_long(rows, logits), _long(cols, logits)] = float("-inf")


def apply_penalties(
    logits: torch.Tensor, params: list[SamplingParams], histories: list[RowHistory]
) -> None:
    """Repetition (prompt and output), then frequency and presence (output), in place."""
    if not any(p.penalized for p in params):
        return
    counts = _token_counts(logits, [h.output_token_ids for h in histories])
    repetition = torch.tensor([float(p.repetition_penalty) for p in params], device=logits.device)
    if bool((repetition != 1.0).any()):
        seen = _token_counts(logits, [h.prompt_token_ids for h in histories]) > 0
        seen |= counts > 0
        factor = torch.where(seen, repetition[:, None], torch.ones_like(logits))
        logits.copy_(torch.where(logits > 0, logits / factor, logits * factor))
    frequency = torch.tensor([float(p.frequency_penalty) for p in params], device=logits.device)
    presence = torch.tensor([float(p.presence_penalty) for p in params], device=logits.device)
    logits -= frequency[:, None] * counts + presence[:, None] * (counts > 0)


def _token_counts(logits: torch.Tensor, token_lists: list[list[int]]) -> torch.Tensor:
    """[rows, vocab] float: how often each token occurs in each row's list."""
    counts = torch.zeros_like(logits)
    vocab = logits.shape[-1]
    rows = [row for row, tokens in enumerate(token_lists) for t in tokens if t < vocab]
    cols = [t for tokens in token_lists for t in tokens if t < vocab]
    if rows:
        ones = torch.ones(len(rows), device=logits.device)
        counts.index_put_((_long(rows, logits), _long(cols, logits)), ones, accumulate=True)
    return counts


def _long(values: list[int], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, device=like.device)
