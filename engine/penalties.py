"""What changes a row's logits before the draw, with vLLM's semantics, batched.

Called by the sampler on the rows that need it (`SamplingParams.shapes_logits`), in
this order: logit_bias is added; until `min_tokens` are out, EOS and the request's
stop token ids are banned; the grammar's mask bans what it cannot take; then the
penalties. What these read is built once, not every step (engine/shaping_state.py):
the bias and the banned ids as tensors per SamplingParams, the output counts per
sequence, counted as tokens are decided, from the whole history the first time a
sequence is seen (a migrated one is penalized exactly as where it started).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.sampling_params import SamplingParams
from engine.shaping_state import TokenCounts, banned_ids_of, logit_bias_of


@dataclass
class RowHistory:
    """The tokens a row's penalties look at."""

    prompt_token_ids: list[int]
    output_token_ids: list[int]
    eos_token_ids: frozenset[int] = frozenset()
    counts: TokenCounts | None = None
    """The sequence's counts, kept across steps by its engine; None: counted afresh."""


def apply_logit_bias(logits: torch.Tensor, params: list[SamplingParams]) -> None:
    rows, ids, values = [], [], []
    dense_rows, dense = [], []
    for row, p in enumerate(params):
        if not p.logit_bias:
            continue
        bias = logit_bias_of(p, logits)
        if bias.dense is not None:
            dense_rows.append(row)
            dense.append(bias.dense)
        else:
            rows.append(row)
            ids.append(bias.ids)
            values.append(bias.values)
    if dense_rows:
        index = torch.tensor(dense_rows, dtype=torch.long, device=logits.device)
        logits.index_add_(0, index, torch.stack(dense).to(logits.dtype))
    if rows:
        index = _row_index(rows, ids, logits)
        logits.index_put_(index, torch.cat(values).to(logits.dtype), accumulate=True)


def ban_stops_before_min_tokens(
    logits: torch.Tensor, params: list[SamplingParams], histories: list[RowHistory]
) -> None:
    rows, ids = [], []
    for row, (p, h) in enumerate(zip(params, histories, strict=True)):
        if len(h.output_token_ids) < p.min_tokens:
            rows.append(row)
            ids.append(banned_ids_of(p, h.eos_token_ids, logits))
    if rows:
        logits[_row_index(rows, ids, logits)] = float("-inf")


def apply_penalties(
    logits: torch.Tensor, params: list[SamplingParams], histories: list[RowHistory]
) -> None:
    """Repetition (prompt and output), then frequency and presence (output), in place,
    on the penalized rows (the others would be left as they are by penalties of 0 and 1)."""
    rows = [i for i, p in enumerate(params) if p.penalized]
    if not rows:
        return
    every_row = len(rows) == len(params)
    shaped = logits if every_row else logits[rows]
    counters = [_counts(histories[i]) for i in rows]
    counts = torch.stack(
        [c.sync(histories[i].output_token_ids, logits) for c, i in zip(counters, rows, strict=True)]
    )
    device = logits.device
    repetition = torch.tensor([float(params[i].repetition_penalty) for i in rows], device=device)
    if bool((repetition != 1.0).any()):
        prompts = [histories[i].prompt_token_ids for i in rows]
        seen = torch.stack([c.prompt_seen(p) for c, p in zip(counters, prompts, strict=True)])
        seen |= counts > 0
        factor = torch.where(seen, repetition[:, None], torch.ones_like(shaped))
        shaped.copy_(torch.where(shaped > 0, shaped / factor, shaped * factor))
    frequency = torch.tensor([float(params[i].frequency_penalty) for i in rows], device=device)
    presence = torch.tensor([float(params[i].presence_penalty) for i in rows], device=device)
    shaped -= frequency[:, None] * counts + presence[:, None] * (counts > 0)
    if not every_row:
        logits[rows] = shaped


def _counts(history: RowHistory) -> TokenCounts:
    return history.counts if history.counts is not None else TokenCounts()


def _row_index(
    rows: list[int], ids: list[torch.Tensor], like: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, column) index tensors that put each row's `ids` in its row."""
    lengths = [len(i) for i in ids]
    row_ids = torch.repeat_interleave(
        torch.tensor(rows, dtype=torch.long, device=like.device),
        torch.tensor(lengths, dtype=torch.long, device=like.device),
        output_size=sum(lengths),
    )
    return row_ids, torch.cat(ids)
