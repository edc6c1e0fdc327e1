"""What shaping a row's logits keeps between steps, so a step costs tensor ops, not a
Python walk over a request's bias entries or a sequence's whole history.

Two owners, two lifetimes:
    per SamplingParams  the logit_bias as (token ids, values) tensors (`LogitBias`) and
                        the ids the min_tokens ban covers (stop_token_ids, plus EOS
                        unless ignore_eos). Built the first time a step shapes a row
                        of those params on a device, and kept with the params
                        (`SamplingParams.derived`): sequences that share the params
                        share them.
    TokenCounts         per sequence: how often each token occurs in its output, and
                        which tokens its prompt holds. The engine keeps one on each
                        penalized sequence; each step counts only the tokens decided
                        since the last one. A sequence new to this engine (an imported
                        or migrated one, its output decided elsewhere) starts from
                        nothing, so its first step counts its whole history, and it is
                        penalized exactly as where it started.
Only ids inside the logits' vocabulary are kept (the frontend refuses others; a direct
caller's are skipped, as before).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class LogitBias:
    """One SamplingParams' logit_bias, on one device: as its entries, or, when it names
    more than a third of the vocabulary, as a dense row (adding a row is one vector op,
    scattering 49k entries into each row of a step was 12 ms for 16 rows; and the row
    takes no more memory than the entries would)."""

    ids: torch.Tensor
    """long [entries]: the token ids it names (a repeated id adds up); empty if dense."""
    values: torch.Tensor
    """float32 [entries]: the bias of each; empty if dense."""
    dense: torch.Tensor | None = None
    """float32 [vocab]: every token's bias (0 where none), or None."""


def logit_bias_of(params: SamplingParams, like: torch.Tensor) -> LogitBias:
    """The bias of `params` for logits shaped like `like` ([rows, vocab]), built once per
    device and vocabulary."""
    vocab, device = like.shape[-1], like.device
    return params.derived(("logit_bias", device, vocab), lambda: _bias(params, vocab, device))


def banned_ids_of(
    params: SamplingParams, eos_token_ids: frozenset[int], like: torch.Tensor
) -> torch.Tensor:
    """long [ids]: the distinct tokens `params` bans until min_tokens are out (its stop
    token ids, and EOS unless ignore_eos), built once per device, vocabulary and EOS set."""
    vocab, device = like.shape[-1], like.device
    key = ("banned", device, vocab, eos_token_ids)
    return params.derived(key, lambda: _banned(params, eos_token_ids, vocab, device))


def _bias(params: SamplingParams, vocab: int, device: torch.device) -> LogitBias:
    pairs = [(t, b) for t, b in params.logit_bias if t < vocab]
    ids = _long([t for t, _ in pairs], device)
    values = torch.tensor([b for _, b in pairs], dtype=torch.float32).to(device)
    if 3 * len(pairs) <= vocab:
        return LogitBias(ids, values)
    dense = torch.zeros(vocab, dtype=torch.float32, device=device).index_put_(
        (ids,), values, accumulate=True
    )
    return LogitBias(ids[:0], values[:0], dense)


def _banned(
    params: SamplingParams, eos_token_ids: frozenset[int], vocab: int, device: torch.device
) -> torch.Tensor:
    banned = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
    return _long(sorted(t for t in banned if t < vocab), device)


def _long(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long).to(device)


class TokenCounts:
    """One sequence's output-token counts and prompt-token mask, over the vocabulary.

    The engine creates one per penalized sequence and hands it to the sampler with the
    sequence's history every step (`RowHistory.counts`); `sync` brings it up to date.
    """

    def __init__(self) -> None:
        self.output: torch.Tensor | None = None
        """[vocab] in the logits' dtype: occurrences of each token in the output."""
        self.counted = 0
        """Output tokens already in `output`."""
        self._prompt_seen: torch.Tensor | None = None

    def sync(self, output_token_ids: list[int], like: torch.Tensor) -> torch.Tensor:
        """The output counts, after counting the tokens decided since the last call (all
        of them the first time, or when the logits' vocabulary, device or dtype differ)."""
        vocab = like.shape[-1]
        if (
            self.output is None
            or self.output.shape[0] != vocab
            or self.output.device != like.device
            or self.output.dtype != like.dtype
            or len(output_token_ids) < self.counted
        ):
            self.output = torch.zeros(vocab, dtype=like.dtype, device=like.device)
            self.counted = 0
            self._prompt_seen = None
        new = [t for t in output_token_ids[self.counted :] if t < vocab]
        if len(new) == 1:
            self.output[new[0]] += 1
        elif new:
            index = torch.tensor(new, dtype=torch.long, device=like.device)
            self.output.index_put_((index,), torch.ones_like(index, dtype=like.dtype), True)
        self.counted = len(output_token_ids)
        return self.output

    def prompt_seen(self, prompt_token_ids: list[int]) -> torch.Tensor:
        """bool [vocab]: the tokens of the prompt (built on the first call after a `sync`
        that started over; the prompt never changes)."""
        if self._prompt_seen is None:
            output = self.output
            vocab = output.shape[0]
            seen = torch.zeros(vocab, dtype=torch.bool, device=output.device)
            ids = [t for t in prompt_token_ids if t < vocab]
            if ids:
                seen[torch.tensor(ids, dtype=torch.long, device=output.device)] = True
            self._prompt_seen = seen
        return self._prompt_seen
