"""Small real objects for tests: tiny random-weight models with a real BPE tokenizer,
engines over them, and the leak check every engine scenario ends with.

Every tiny model is a genuine HF checkpoint (config.json + safetensors + tokenizer)
written by transformers itself, so our loader reads exactly what it would read from
a downloaded model, and transformers is the reference for the same weights.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
)

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
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
    raise ValueError(family)


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
