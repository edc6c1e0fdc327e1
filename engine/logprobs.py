"""Log-probabilities of chosen tokens and their most likely alternatives.

Output logprobs come from the logits the sampler drew from: after logit_bias, the
min_tokens ban, the grammar mask and the penalties, divided by the temperature
(greedy rows: by 1), before top-k/top-p truncation, as vLLM documents. Prompt
logprobs (for `echo`) come from the model's raw logits at each prompt position.

Where they are made and how they travel: the engine that samples a token computes its
`TokenLogprobs` in the same step (the prefill worker for the first token, sent in
`PrefillResult`; the decode worker for the rest, in each `TokenEvent`); the engine
that computes a prompt computes its prompt logprobs, piece by piece across chunked
prefill steps, and sends them with the first token. The frontend turns them into
OpenAI's shapes (it holds the tokenizer that names the tokens).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenLogprobs:
    """One position: the token there, its logprob and rank, and the top alternatives."""

    token_id: int
    logprob: float
    rank: int
    """1 for the most likely token of the distribution."""
    top: tuple[tuple[int, float], ...] = ()
    """(token id, logprob) of the most likely tokens, best first."""


def token_logprobs(
    logits: torch.Tensor, token_ids: list[int], top_counts: list[int]
) -> list[TokenLogprobs]:
    """logits [rows, vocab] (already scaled), the token of each row, and how many
    alternatives each row wants -> one TokenLogprobs per row."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen_ids = torch.tensor(token_ids, dtype=torch.long, device=logits.device)
    chosen = logprobs.gather(-1, chosen_ids[:, None]).squeeze(-1)
    ranks = (logprobs > chosen[:, None]).sum(dim=-1) + 1
    width = max(top_counts, default=0)
    top_values, top_ids = (
        logprobs.topk(width, dim=-1) if width else (logprobs[:, :0], chosen_ids[:, None][:, :0])
    )
    chosen_list, rank_list = chosen.tolist(), ranks.tolist()
    values_list, ids_list = top_values.tolist(), top_ids.tolist()
    return [
        TokenLogprobs(
            token_id=token_ids[row],
            logprob=chosen_list[row],
            rank=rank_list[row],
            top=tuple(zip(ids_list[row][:k], values_list[row][:k], strict=True)),
        )
        for row, k in enumerate(top_counts)
    ]


@dataclass
class PromptLogprobs:
    """A sequence's prompt logprobs as its prefill pieces compute them (engine-owned)."""

    top_count: int
    computed_positions: int = 0
    """Positions p whose logits (which score prompt token p + 1) are done."""
    entries: list[TokenLogprobs] | None = None

    def wanted(self, start: int, end: int, prompt_len: int) -> range:
        """Positions of the piece [start, end) whose logits are still needed."""
        return range(max(start, self.computed_positions), min(end, prompt_len - 1))

    def add(self, logits: torch.Tensor, first_position: int, prompt: list[int]) -> None:
        count = logits.shape[0]
        next_tokens = prompt[first_position + 1 : first_position + 1 + count]
        self.entries = (self.entries or []) + token_logprobs(
            logits, next_tokens, [self.top_count] * count
        )
        self.computed_positions = first_position + count

    def result(self) -> list[TokenLogprobs | None]:
        """OpenAI's list: None for the first prompt token, then one entry per token."""
        return [None, *(self.entries or [])]
