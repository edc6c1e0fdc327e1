"""What `pdserve bench serve` sends: sessions of one or more turns, lengths in exact tokens.

A workload is an iterator of `Session`s. Most sessions are one request; a multi-turn
session is a conversation whose later turns resend the growing history with the
server's actual replies, so those turns are built while the run goes (see
`conversation_body`). Every prompt's token count is the count the server will see,
taken with the model's tokenizer before the measured interval starts.

Kinds:
  random         words (or token ids with --token-ids) of --prompt-len tokens
  jsonl          one {"prompt": ...} or {"messages": [...]} per line, optional "output_len"
  sharegpt       the common ShareGPT JSON (a list of {"conversations": [...]}): the first
                 human turn is the prompt, the reply's token count the output length
  shared-prefix  --num-groups system prompts of --prefix-len tokens, each request one of
                 them plus a unique question of --question-len tokens
  multi-turn     conversations of --turns user turns of --prompt-len tokens each
"""

from __future__ import annotations

import itertools
import json
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from bench.lengths import LengthSpec
from bench.prompt_text import PromptMaker, chat_messages

KINDS = ("random", "jsonl", "sharegpt", "shared-prefix", "multi-turn")
ENDPOINTS = ("completions", "chat")


@dataclass(frozen=True)
class WorkloadSpec:
    """Everything that decides what is sent; stored in the JSON header of every run."""

    kind: str = "random"
    endpoint: str = "completions"
    prompt_len: str = "256"
    output_len: str | None = None
    """None: 64 for synthetic kinds, the dataset's own lengths for jsonl/sharegpt."""
    dataset: str | None = None
    num_groups: int = 4
    prefix_len: int = 512
    question_len: int = 64
    turns: int = 3
    token_ids: bool = False
    max_context: int = 2048
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"workload must be one of {KINDS}, got {self.kind!r}")
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"endpoint must be one of {ENDPOINTS}, got {self.endpoint!r}")
        if self.kind in ("jsonl", "sharegpt") and not self.dataset:
            raise ValueError(f"workload {self.kind} needs --dataset PATH")
        if self.token_ids and (self.kind != "random" or self.endpoint != "completions"):
            raise ValueError("--token-ids works with the random workload on completions only")
        if min(self.num_groups, self.prefix_len, self.question_len, self.turns) < 1:
            raise ValueError("groups, prefix/question lengths and turns must be positive")
        LengthSpec.parse(self.prompt_len)
        if self.output_len is not None:
            LengthSpec.parse(self.output_len)

    @property
    def output_spec(self) -> LengthSpec:
        return LengthSpec.parse(self.output_len or "64")


@dataclass(frozen=True)
class Turn:
    content: str | list[int]
    """Completions: the whole prompt. Chat: the last user message."""
    output_len: int
    prompt_tokens: int | None
    """Exact, when known before sending (a conversation's later turns: from the server)."""
    messages: tuple[dict, ...] | None = None
    """Chat: the whole message list (None in conversations, built from the history)."""


@dataclass(frozen=True)
class Session:
    index: int
    turns: tuple[Turn, ...]
    group: int | None = None
    conversation: bool = False
    history: list[dict] = field(default_factory=list, compare=False)


def iter_sessions(spec: WorkloadSpec, maker: PromptMaker, seed: int) -> Iterator[Session]:
    """Sessions without end for synthetic kinds; a dataset's are cycled when exhausted."""
    rng = random.Random(seed)
    makers = {
        "random": _random_turns,
        "shared-prefix": _shared_prefix_turns,
        "multi-turn": _conversation,
        "jsonl": _dataset_turns,
        "sharegpt": _dataset_turns,
    }
    source = makers[spec.kind](spec, maker, rng)
    for index, (group, turns) in enumerate(source):
        yield Session(index, tuple(turns), group, conversation=spec.kind == "multi-turn")


def build_sessions(spec: WorkloadSpec, maker: PromptMaker, count: int, seed: int):
    """The first `count` sessions (what --num-prompts runs), generated up front."""
    return list(itertools.islice(iter_sessions(spec, maker, seed), count))


def _single(spec: WorkloadSpec, maker: PromptMaker, rng, target: int, output_len: int) -> Turn:
    if spec.token_ids:
        return Turn(maker.random_ids(target, rng), output_len, target)
    if spec.endpoint == "chat":
        text, actual = maker.chat_user(target, rng)
        return Turn(text, output_len, actual, tuple(chat_messages(text)))
    text, actual = maker.completion_prompt(target, rng)
    return Turn(text, output_len, actual)


def _random_turns(spec, maker, rng):
    prompt_len, output_len = LengthSpec.parse(spec.prompt_len), spec.output_spec
    while True:
        yield None, [_single(spec, maker, rng, prompt_len.sample(rng), output_len.sample(rng))]


def _shared_prefix_turns(spec, maker, rng):
    systems = [maker.word_text(spec.prefix_len, rng) for _ in range(spec.num_groups)]
    for index in itertools.count():
        group = index % spec.num_groups
        question = maker.word_text(spec.question_len, rng)
        output_len = spec.output_spec.sample(rng)
        if spec.endpoint == "chat":
            messages = chat_messages(question, systems[group])
            turn = Turn(question, output_len, maker.count_chat(messages), tuple(messages))
        else:
            prompt = systems[group] + question
            turn = Turn(prompt, output_len, maker.count_completion(prompt))
        yield group, [turn]


def _conversation(spec, maker, rng):
    turn_len = LengthSpec.parse(spec.prompt_len)
    while True:
        turns = []
        for number in range(spec.turns):
            user = maker.word_text(turn_len.sample(rng), rng)
            known = maker.count_chat(chat_messages(user)) if number == 0 else None
            turns.append(Turn(user, spec.output_spec.sample(rng), known))
        yield None, turns


def _dataset_turns(spec, maker, rng):
    entries = list(_read_dataset(spec, maker))
    if not entries:
        raise ValueError(f"{spec.dataset}: no usable entries")
    rng.shuffle(entries)
    skipped = 0
    for prompt, messages, reply_len in itertools.cycle(entries):
        output_len = spec.output_spec.sample(rng) if spec.output_len else reply_len or 64
        turn = _dataset_turn(spec, maker, prompt, messages, output_len)
        if turn.prompt_tokens + output_len <= spec.max_context and turn.prompt_tokens >= 2:
            skipped = 0
            yield None, [turn]
        elif (skipped := skipped + 1) > len(entries):
            raise ValueError(f"{spec.dataset}: no entry fits --max-context {spec.max_context}")


def _dataset_turn(spec, maker, prompt, messages, output_len) -> Turn:
    if spec.endpoint == "chat":
        messages = messages or chat_messages(prompt)
        last_user = next((m["content"] for m in reversed(messages) if m["role"] == "user"), "")
        return Turn(last_user, output_len, maker.count_chat(messages), tuple(messages))
    text = prompt if messages is None else maker.chat_text(messages)
    return Turn(text, output_len, maker.count_completion(text))


def _read_dataset(spec: WorkloadSpec, maker: PromptMaker) -> Iterator[tuple]:
    """(prompt text, message list, output length) per entry; exactly one of the first two."""
    path = Path(spec.dataset)
    if spec.kind == "jsonl":
        for line_number, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            entry = json.loads(line)
            if not isinstance(entry, dict) or not ("prompt" in entry or "messages" in entry):
                raise ValueError(f"{path}:{line_number}: expected a 'prompt' or 'messages' key")
            yield entry.get("prompt"), entry.get("messages"), entry.get("output_len")
        return
    for entry in json.loads(path.read_text()):
        pair = _sharegpt_pair(entry.get("conversations") or [])
        if pair is not None:
            prompt, reply = pair
            yield prompt, None, max(1, len(maker.hf.encode(reply, add_special_tokens=False)))


def _sharegpt_pair(conversation: list[dict]) -> tuple[str, str] | None:
    """The first human turn and the reply that follows it."""
    for first, second in itertools.pairwise(conversation):
        if first.get("from") in ("human", "user") and second.get("from") in ("gpt", "assistant"):
            return first.get("value") or "", second.get("value") or ""
    return None


def conversation_body(session: Session, number: int, maker: PromptMaker, endpoint: str) -> dict:
    """The request body fields of turn `number`: the history so far plus this user turn."""
    messages = [*session.history, {"role": "user", "content": session.turns[number].content}]
    if endpoint == "chat":
        return {"messages": messages}
    return {"prompt": maker.chat_text(messages)}


def turn_body(session: Session, number: int, maker: PromptMaker, endpoint: str) -> dict:
    """Called by the runner right before sending turn `number` of `session`."""
    if session.conversation:
        return conversation_body(session, number, maker, endpoint)
    turn = session.turns[number]
    if endpoint == "chat":
        return {"messages": list(turn.messages)}
    return {"prompt": turn.content}
