"""Who owns what in a tensor-parallel model: Megatron's split, as vLLM and SGLang make it.

A model of `size` ranks is cut the same way at every layer:

    q, k, v projections    column-parallel: rank r computes its own heads
    o projection           row-parallel: rank r reads its heads' outputs, and the
                           partial sums meet in one all-reduce
    gate, up projections   column-parallel: rank r computes its slice of the
                           intermediate dimension (each expert's, in a mixture)
    down projection        row-parallel, one all-reduce
    embedding, LM head     vocab-parallel: rank r holds a slice of the vocabulary's
                           rows, padded so that every rank holds the same count

With fewer KV heads than ranks, KV heads are replicated (vLLM's rule): rank r holds KV
head `r * num_kv_heads // size`, which serves exactly its query heads when `size` is a
multiple of the KV head count. Anything else is refused at start-up (`check_split`)
with what does not divide.

Plain functions of the model's shapes; `LlamaForward` and the weight loader read a
`ModelShard` and never compute an offset themselves.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.errors import ModelLoadError


class TPSplitError(ModelLoadError):
    """A model's shapes cannot be split over the asked number of ranks."""


@dataclass(frozen=True)
class Span:
    """A contiguous range [start, start + count) of some dimension."""

    start: int
    count: int

    @property
    def stop(self) -> int:
        return self.start + self.count

    def overlap(self, other: Span) -> Span | None:
        """The part both cover, or None."""
        start, stop = max(self.start, other.start), min(self.stop, other.stop)
        return Span(start, stop - start) if stop > start else None

    def rows(self, width: int) -> slice:
        """The span as a slice of a dimension `width` elements per unit (heads of
        `head_dim` rows, say)."""
        return slice(self.start * width, self.stop * width)


@dataclass(frozen=True)
class HeadShard:
    """One rank's attention heads."""

    q: Span
    kv: Span
    total_q: int
    total_kv: int

    @property
    def kv_replicated(self) -> bool:
        """Whether other ranks hold the same KV heads (fewer KV heads than ranks)."""
        return self.kv.count * self.total_q != self.q.count * self.total_kv


def check_split(num_heads: int, num_kv_heads: int, size: int, what: str = "the model") -> None:
    """Raise TPSplitError, naming the numbers, when `size` ranks cannot split the heads."""
    if size < 1:
        raise TPSplitError(f"tensor parallel size must be >= 1, got {size}")
    if num_heads % size:
        raise TPSplitError(
            f"tp={size} cannot split {what}'s {num_heads} attention heads evenly "
            f"(use a tp that divides {num_heads})"
        )
    if num_kv_heads >= size and num_kv_heads % size:
        raise TPSplitError(
            f"tp={size} cannot split {what}'s {num_kv_heads} KV heads evenly "
            f"(use a tp that divides {num_kv_heads}, or a multiple of it to replicate them)"
        )
    if num_kv_heads < size and size % num_kv_heads:
        raise TPSplitError(
            f"tp={size} cannot replicate {what}'s {num_kv_heads} KV heads: with fewer KV "
            f"heads than ranks, tp must be a multiple of {num_kv_heads}"
        )


def head_split(num_heads: int, num_kv_heads: int, size: int, rank: int) -> HeadShard:
    """Rank `rank`'s query and KV heads of `size` ranks."""
    check_split(num_heads, num_kv_heads, size)
    per_rank = num_heads // size
    if num_kv_heads >= size:
        kv_per_rank = num_kv_heads // size
        kv = Span(rank * kv_per_rank, kv_per_rank)
    else:
        kv = Span(rank * num_kv_heads // size, 1)
    return HeadShard(Span(rank * per_rank, per_rank), kv, num_heads, num_kv_heads)


def even_split(total: int, size: int, rank: int, what: str) -> Span:
    """Rank `rank`'s equal share of a dimension of `total` (the MLP's intermediate)."""
    if total % size:
        raise TPSplitError(f"tp={size} cannot split {what} ({total}) evenly")
    per_rank = total // size
    return Span(rank * per_rank, per_rank)


@dataclass(frozen=True)
class VocabShard:
    """One rank's rows of the embedding and the LM head. The vocabulary is padded to a
    multiple of the ranks, so each rank holds `per_rank` rows: `real` of them are real
    tokens, the rest (on the last ranks only) zeros whose logits are cut after the
    gather."""

    real: Span
    per_rank: int
    vocab_size: int


def vocab_split(vocab_size: int, size: int, rank: int) -> VocabShard:
    per_rank = -(-vocab_size // size)
    start = min(rank * per_rank, vocab_size)
    count = max(0, min(per_rank, vocab_size - start))
    return VocabShard(Span(start, count), per_rank, vocab_size)


@dataclass(frozen=True)
class ModelShard:
    """Everything one rank of a `size`-way split owns; size 1 owns everything."""

    rank: int
    size: int
    heads: HeadShard
    intermediate: Span
    """Of each dense MLP."""
    expert_intermediate: Span | None
    """Of each expert's MLP (mixtures only)."""
    vocab: VocabShard

    @property
    def whole(self) -> bool:
        return self.size == 1

    @classmethod
    def of(cls, spec, size: int = 1, rank: int = 0) -> ModelShard:
        """`spec` is the model's `ModelSpec`; raises TPSplitError when it cannot split."""
        if not 0 <= rank < size:
            raise TPSplitError(f"rank {rank} of tp={size}")
        check_split(spec.num_heads, spec.num_kv_heads, size, spec.model_id)
        experts = spec.experts
        expert_span = None
        if experts is not None:
            expert_span = even_split(
                experts.intermediate_size, size, rank, f"{spec.model_id}'s expert intermediate size"
            )
        return cls(
            rank=rank,
            size=size,
            heads=head_split(spec.num_heads, spec.num_kv_heads, size, rank),
            intermediate=even_split(
                spec.intermediate_size, size, rank, f"{spec.model_id}'s intermediate size"
            ),
            expert_intermediate=expert_span,
            vocab=vocab_split(spec.vocab_size, size, rank),
        )

    def describe(self) -> str:
        """One line for the start-up log."""
        heads = self.heads
        text = (
            f"tp rank {self.rank}/{self.size}: q heads {heads.q.start}..{heads.q.stop - 1} "
            f"of {heads.total_q}, kv heads {heads.kv.start}..{heads.kv.stop - 1} of "
            f"{heads.total_kv}, intermediate {self.intermediate.start}..{self.intermediate.stop - 1}"
            f", vocab rows {self.vocab.real.start}..{self.vocab.real.stop - 1}"
        )
        if heads.kv_replicated:
            text += f" (KV heads replicated: {heads.total_kv} KV heads over {self.size} ranks)"
        return text
