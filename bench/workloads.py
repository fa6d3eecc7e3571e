"""Request streams for the cache benchmarks (bench.hitrate, bench.cluster): the public Mooncake
trace (../shared/traces) and a generated multi-turn chat workload. Both are deterministic (seeded).

A request is its prompt's token ids plus a conversation id (None for one-shot prompts), which the
cluster replay uses to follow a conversation's history. Token ids are drawn per content block from
a generator seeded by that block's identity, so equal content gives equal tokens across processes.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
_TRACE_NAME = Path("shared") / "traces" / "mooncake_synthetic_trace.jsonl"
# ../shared beside the checkout (or beside a worktrees folder); PAGEDKV_TRACE overrides.
TRACE = Path(
    os.environ.get(
        "PAGEDKV_TRACE",
        next(
            (p / _TRACE_NAME for p in ROOT.parents if (p / _TRACE_NAME).exists()), ROOT.parent / _TRACE_NAME
        ),
    )
)
TRACE_BLOCK_TOKENS = 512  # one hash id of the trace stands for this many tokens
VOCAB = 32_000


@dataclass(frozen=True)
class Request:
    tokens: list[int]
    conversation: int | None  # requests of one conversation extend each other's prompts


def _block_tokens(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(1, VOCAB, n).tolist()  # type: ignore[no-any-return]


def trace_requests(limit: int | None = None, path: Path = TRACE) -> list[Request]:
    """The trace's requests in order. Hash id h becomes 512 tokens seeded by h; a partial last
    block gets tokens seeded by the request's index (its own content, as the trace's README says).
    The conversation id is the first hash id: requests that share their first block share a prefix."""
    out: list[Request] = []
    memo: dict[int, list[int]] = {}
    with open(path) as f:
        for i, line in enumerate(f):
            if limit is not None and i >= limit:
                break
            r = json.loads(line)
            length, ids = r["input_length"], r["hash_ids"]
            tokens: list[int] = []
            for j, h in enumerate(ids):
                want = min(TRACE_BLOCK_TOKENS, length - j * TRACE_BLOCK_TOKENS)
                if want == TRACE_BLOCK_TOKENS:
                    block = memo.get(h)
                    if block is None:
                        block = memo[h] = _block_tokens(h, TRACE_BLOCK_TOKENS)
                    tokens += block
                elif want > 0:
                    tokens += _block_tokens(1 << 40 | i, want)
            out.append(Request(tokens, ids[0] if ids else None))
    return out


@dataclass(frozen=True)
class ChatShape:
    """The multi-turn chat workload: conversations under one of a few system prompts, whose turns
    extend the previous turn's prompt and answer, interleaved across `active` open conversations,
    with one-shot long documents (a scan that flushes an LRU) mixed in."""

    num_conversations: int = 300
    num_system_prompts: int = 4
    system_tokens: int = 512
    turns: tuple[int, int] = (2, 10)
    user_tokens: tuple[int, int] = (32, 256)
    answer_tokens: tuple[int, int] = (64, 320)
    active: int = 16
    document_every: int = 4  # one long one-shot prompt per this many chat turns (0: none)
    document_tokens: tuple[int, int] = (2_048, 8_192)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_conversations < 1 or self.num_system_prompts < 1 or self.active < 1:
            raise ValueError(
                f"ChatShape needs at least one conversation, system prompt and open slot: {self}"
            )


def chat_requests(shape: ChatShape = ChatShape()) -> list[Request]:
    rng = random.Random(shape.seed)
    systems = [
        _block_tokens(shape.seed << 8 | s, shape.system_tokens) for s in range(shape.num_system_prompts)
    ]
    salt = [shape.seed << 32 | 1 << 30]

    def fresh(span: tuple[int, int]) -> list[int]:
        salt[0] += 1
        return _block_tokens(salt[0], rng.randint(*span))

    started = 0
    open_: list[list] = []  # [conversation id, history tokens, turns left]
    out: list[Request] = []
    num_turns = 0
    while started < shape.num_conversations or open_:
        while len(open_) < shape.active and started < shape.num_conversations:
            open_.append([started, list(rng.choice(systems)), rng.randint(*shape.turns)])
            started += 1
        conv = rng.choice(open_)
        prompt = conv[1] + fresh(shape.user_tokens)
        out.append(Request(prompt, conv[0]))
        conv[1] = prompt + fresh(shape.answer_tokens)
        conv[2] -= 1
        if conv[2] == 0:
            open_.remove(conv)
        num_turns += 1
        if shape.document_every and num_turns % shape.document_every == 0:
            out.append(Request(rng.choice(systems) + fresh(shape.document_tokens), None))
    return out
