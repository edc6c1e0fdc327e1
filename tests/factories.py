"""Small real objects for tests: tiny random-weight models with a real BPE tokenizer,
engines over them, and the leak check every engine scenario ends with.

Every tiny model is a genuine HF checkpoint (config.json + safetensors + tokenizer)
written by transformers itself, so our loader reads exactly what it would read from
a downloaded model, and transformers is the reference for the same weights.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from pathlib import Path

import torch
import torch.distributed as dist
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    Phi3Config,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
)

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.parallel.follower import FollowerEngine
from engine.parallel.group import TPGroup
from engine.sampling_params import SamplingParams

TINY_VOCAB = 384
CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)
_CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 4,
    "Paged attention stores keys and values in fixed-size blocks. " * 4,
    "Prefill builds the cache; decode reads it one token at a time. " * 4,
    "Grüße aus Köln! Ça va? 東京は晴れです。 🙂🚀 naïve café",
    "def main():\n    return 42\n",
]


TINY_WINDOW = 24
"""The sliding window of the tiny windowed models: shorter than the long test prompts
and than one prefill chunk of them, three 8-token blocks."""

NEW_FAMILIES = ("qwen3", "gemma2", "gemma3", "phi3", "mixtral", "qwen3_moe", "mistral_window")
"""The tiny models of the families served after Llama/Qwen2/Mistral (and Mistral with a
window shorter than the prompts), each as its transformers config defines it."""


TP_FAMILIES = ("llama_kv2", "qwen2", "mistral_kv1")
"""Tiny models whose heads split over 2 ranks: Llama with 2 KV heads (one per rank),
Qwen2 (2 KV heads, q/k/v biases, tied embeddings), Mistral with 1 KV head (replicated
on both ranks)."""


def tiny_config(family: str):
    """Odd head counts and GQA on purpose: shapes that catch layout bugs."""
    common = dict(
        vocab_size=TINY_VOCAB,
        num_hidden_layers=3,
        max_position_embeddings=512,
        bos_token_id=0,
        eos_token_id=1,
        tie_word_embeddings=False,
    )
    if family == "llama":
        return LlamaConfig(
            hidden_size=144,
            intermediate_size=256,
            num_attention_heads=9,
            num_key_value_heads=3,
            rope_theta=10000.0,
            **common,
        )
    if family == "qwen2":
        return Qwen2Config(
            hidden_size=96,
            intermediate_size=192,
            num_attention_heads=6,
            num_key_value_heads=2,
            rope_theta=1000000.0,
            use_sliding_window=False,
            **{**common, "tie_word_embeddings": True},
        )
    if family == "mistral":
        return MistralConfig(
            hidden_size=80,
            intermediate_size=160,
            num_attention_heads=5,
            num_key_value_heads=1,
            sliding_window=512,
            **common,
        )
    if family in ("llama_kv2", "mistral_kv1"):
        return _tp_family_config(family, common)
    return _new_family_config(family, common)


def _tp_family_config(family: str, common: dict):
    """Head counts even, as a 2-way split needs; the vocabulary (385, past the
    tokenizer's 384 as many checkpoints pad theirs) is odd, so the LM head's last rank
    holds a padding row."""
    common = {**common, "vocab_size": TINY_VOCAB + 1}
    if family == "llama_kv2":
        return LlamaConfig(
            hidden_size=128,
            intermediate_size=224,
            num_attention_heads=8,
            num_key_value_heads=2,
            rope_theta=10000.0,
            **common,
        )
    return MistralConfig(
        hidden_size=96,
        intermediate_size=160,
        num_attention_heads=4,
        num_key_value_heads=1,
        sliding_window=512,
        **common,
    )


def _new_family_config(family: str, common: dict):
    layers = {**common, "num_hidden_layers": 4}
    if family == "mistral_window":
        return MistralConfig(
            hidden_size=80,
            intermediate_size=160,
            num_attention_heads=5,
            num_key_value_heads=1,
            sliding_window=TINY_WINDOW,
            **layers,
        )
    if family == "qwen3":
        # head_dim * heads (6 x 24) differs from hidden (96); layers 1+ slide.
        return Qwen3Config(
            hidden_size=96,
            intermediate_size=192,
            num_attention_heads=6,
            num_key_value_heads=2,
            head_dim=24,
            use_sliding_window=True,
            sliding_window=TINY_WINDOW,
            max_window_layers=1,
            **layers,
        )
    if family in ("gemma2", "gemma3"):
        gemma = dict(
            hidden_size=64,
            intermediate_size=128,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            query_pre_attn_scalar=24,
            sliding_window=TINY_WINDOW,
            pad_token_id=0,
            **{**layers, "tie_word_embeddings": True},
        )
        if family == "gemma2":  # sliding and global layers alternate
            return Gemma2Config(attn_logit_softcapping=50.0, final_logit_softcapping=30.0, **gemma)
        return Gemma3TextConfig(
            layer_types=[
                "sliding_attention",
                "sliding_attention",
                "full_attention",
                "sliding_attention",
            ],
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
            **gemma,
        )
    if family == "phi3":
        # LongRoPE with an original context shorter than the long prompts.
        return Phi3Config(
            hidden_size=96,
            intermediate_size=160,
            num_attention_heads=6,
            num_key_value_heads=2,
            pad_token_id=0,
            original_max_position_embeddings=PHI3_ORIGINAL_CONTEXT,
            rope_parameters={
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "short_factor": [1.0, 1.0, 1.1, 1.1, 1.2, 1.2, 1.3, 1.3],
                "long_factor": [1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0],
            },
            **layers,
        )
    if family == "mixtral":  # every layer a mixture, every layer windowed
        return MixtralConfig(
            hidden_size=64,
            intermediate_size=96,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=TINY_WINDOW,
            **layers,
        )
    if family == "qwen3_moe":  # layer 1 keeps a dense MLP; no renormalisation
        return Qwen3MoeConfig(
            hidden_size=64,
            intermediate_size=112,
            moe_intermediate_size=48,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            num_experts=6,
            num_experts_per_tok=2,
            mlp_only_layers=[1],
            norm_topk_prob=False,
            **layers,
        )
    raise ValueError(family)


PHI3_ORIGINAL_CONTEXT = 32


@cache
def tiny_tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_VOCAB,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def make_tiny_model(directory: Path, family: str = "llama", seed: int = 0) -> Path:
    """Write a random-weight model of `family` into `directory`; returns it."""
    directory.mkdir(parents=True, exist_ok=True)
    if (directory / "config.json").is_file():
        return directory
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family), dtype=torch.float32)
    # Random init gives near-uniform logits; widen them so greedy choices are robust.
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1:
                param.mul_(4.0)
    model.save_pretrained(directory, safe_serialization=True)
    tiny_tokenizer().save_pretrained(directory)
    return directory


def hf_greedy(model_dir: Path, prompt: list[int], max_new_tokens: int, device: str = "cpu"):
    """Reference: transformers forward, greedy, KV cache, no stopping. Returns (tokens, logits),
    the logits on `device`."""
    model = _hf_model(str(model_dir), device)
    tokens, step_logits = [], []
    with torch.no_grad():
        out = model(torch.tensor([prompt], device=device), use_cache=True)
        for _ in range(max_new_tokens):
            logits = out.logits[0, -1].float()
            step_logits.append(logits)
            token = int(logits.argmax())
            tokens.append(token)
            next_ids = torch.tensor([[token]], device=device)
            out = model(next_ids, **_cache_of(out), use_cache=True)
    return tokens, torch.stack(step_logits)


def _cache_of(out) -> dict:
    """The forward's KV cache as the next call takes it: `cache` in recent transformers,
    `past_key_values` before the rename (a GPU machine's own transformers may be older)."""
    cache = getattr(out, "cache", None)
    return {"cache": cache} if cache is not None else {"past_key_values": out.past_key_values}


@cache
def _hf_model(model_dir: str, device: str = "cpu", dtype: torch.dtype = torch.float32):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()


def make_engine(model_dir, **overrides) -> LLMEngine:
    settings = dict(
        model=str(model_dir), dtype="float32", block_size=8, num_kv_blocks=256, num_threads=1
    )
    settings.update(overrides)
    return LLMEngine(EngineConfig(**settings))


@contextmanager
def tp_engine(model_dir, size: int = 2, **overrides) -> Iterator[LLMEngine]:
    """Rank 0's engine of a `size`-rank tensor-parallel worker whose followers run as
    threads of this process (one torch thread each), over gloo on a `HashStore`. The
    followers stop when the block ends (their threads are joined)."""
    settings = dict(
        model=str(model_dir), dtype="float32", block_size=8, num_kv_blocks=256, num_threads=1
    )
    config = EngineConfig(**{**settings, **overrides})
    store = dist.PrefixStore(f"tp-{next(_TP_GROUPS)}", dist.HashStore())
    followers: dict[int, FollowerEngine] = {}
    failures: list[BaseException] = []

    def follow(rank: int) -> None:
        torch.set_num_threads(1)
        try:
            followers[rank] = FollowerEngine(config, TPGroup.join(store, rank, size))
            followers[rank].serve()
        except BaseException as exc:  # the test reads it after the join
            failures.append(exc)

    threads = [threading.Thread(target=follow, args=(r,)) for r in range(1, size)]
    for thread in threads:
        thread.start()
    engine = None
    try:
        engine = LLMEngine(config, TPGroup.join(store, 0, size))
        engine.followers = followers
        yield engine
    finally:
        if engine is not None:
            engine.stop_followers()
        for thread in threads:
            thread.join(timeout=60)
    if failures:
        raise failures[0]


_TP_GROUPS = itertools.count()


def assert_no_leaks(engine: LLMEngine) -> None:
    """Every scenario ends here: no sequence left, every KV block back in the pool."""
    assert not engine.has_unfinished()
    engine.allocator.assert_all_free()


def prompt_of(length: int, salt: int = 0) -> list[int]:
    generator = torch.Generator().manual_seed(1000 + 17 * length + salt)
    return torch.randint(2, 300, (length,), generator=generator).tolist()


def our_greedy_with_logits(engine, prompt: list[int], max_new_tokens: int):
    """Step our engine by hand to capture the logits it sampled from."""
    engine.add_request(
        "logits",
        prompt,
        SamplingParams(max_tokens=max_new_tokens, temperature=0.0, ignore_eos=True),
    )
    step_logits = []
    while engine.has_unfinished():
        chunks = engine.scheduler.schedule()
        result = engine.runner.run(chunks)
        for chunk in chunks:
            chunk.seq.num_computed_tokens += chunk.num_new_tokens
        if result.sampling_seqs:
            step_logits.append(result.logits[0].clone())  # valid until the next step
            engine._append_token(result.sampling_seqs[0], int(result.logits[0].argmax()))
    return torch.stack(step_logits)


class LazyModelDirs(dict):
    """Family -> tiny model directory, each written on first use (a session that tests
    one family does not pay for the others)."""

    def __init__(self, root):
        super().__init__()
        self.root = root

    def __missing__(self, family: str):
        self[family] = make_tiny_model(self.root / family, family)
        return self[family]
