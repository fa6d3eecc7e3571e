"""A block written layer by layer becomes a prefix hit only once its last layer is written.

The transformers integration sends each layer's new K/V with that layer's attention
(attend_prefill / attend_decode): the tokens are reserved at layer 0 and the later layers
arrive one call at a time. Until the last layer lands, another sequence that matched those
blocks would read unwritten K/V for the later layers, so the blocks stay unfindable (no hit,
no STORED event for the coordinator's index) until then. Found through the demo: a worker
whose prompt matched another worker's in-flight prefill generated different tokens.
"""

from __future__ import annotations

import torch
from engine_helpers import Q_HEADS, SPEC, kv_for, make_engine

PROMPT = list(range(200, 210))  # 10 tokens, block size 4: two full blocks + 2 tokens
FULL = 8


def stored_keys(engine) -> list[bytes]:
    return [e.key for e in engine.take_events() if e.kind == "stored"]


def prefill_layer(engine, seq_id: str, layer: int, tokens: list[int], k, v) -> None:
    q = torch.randn(len(tokens), Q_HEADS, SPEC.head_dim)
    engine.attend_prefill(seq_id, layer, q, k[layer], v[layer], tokens if layer == 0 else None)


def test_prefill_blocks_are_found_only_after_the_last_layer():
    e = make_engine()
    k, v = kv_for(len(PROMPT), seed=3)
    e.open("a", PROMPT)
    stored_keys(e)
    prefill_layer(e, "a", 0, PROMPT, k, v)
    assert e.lookup(PROMPT) == 0  # layer 1 of both full blocks is not written yet
    assert stored_keys(e) == []  # nor does the coordinator hear of them
    assert e.open("b", PROMPT).num_cached_tokens == 0
    e.free("b")
    e.check_integrity()
    prefill_layer(e, "a", 1, PROMPT, k, v)
    assert e.lookup(PROMPT) == FULL
    assert len(stored_keys(e)) == 2
    assert e.open("c", PROMPT).num_cached_tokens == FULL
    kc, vc = e.read_kv("c", 0, FULL)
    assert torch.equal(kc, k[:, :FULL]) and torch.equal(vc, v[:, :FULL])  # every layer, as written
    e.check_integrity()


def test_an_unfinished_prefill_is_never_cached():
    e = make_engine()
    k, v = kv_for(len(PROMPT), seed=4)
    e.open("a", PROMPT)
    prefill_layer(e, "a", 0, PROMPT, k, v)
    e.free("a")  # the worker gave up before layer 1
    assert e.lookup(PROMPT) == 0
    assert e.stats()["cached_blocks"] == 0 and e.stats()["used_blocks"] == 0
    assert stored_keys(e) == []
    e.check_integrity()
    # A new layer 0 before the last layer of the previous step drops that step's blocks too.
    e.open("b", PROMPT[:FULL])
    prefill_layer(e, "b", 0, PROMPT[:4], k[:, :4], v[:, :4])
    prefill_layer(e, "b", 0, PROMPT[4:8], k[:, 4:8], v[:, 4:8])
    prefill_layer(e, "b", 1, PROMPT[4:8], k[:, 4:8], v[:, 4:8])
    assert e.lookup(PROMPT) == 0  # block 0 never got its layer 1; block 1 hangs off it
    e.check_integrity()


def test_a_decode_step_that_fills_a_block_publishes_it_after_the_last_layer():
    e = make_engine()
    prompt = PROMPT[:7]  # one full block + 3 tokens: the next token fills block 1
    k, v = kv_for(len(prompt), seed=5)
    e.open("a", prompt)
    e.append("a", prompt, k, v)
    assert e.lookup(PROMPT[:8] + [1]) == 4
    stored_keys(e)
    kn, vn = kv_for(1, seed=6)
    q = torch.randn(1, Q_HEADS, SPEC.head_dim)
    e.attend_decode(["a"], 0, q, kn[0], vn[0], [PROMPT[7]])
    assert e.lookup(PROMPT[:8] + [1]) == 4 and stored_keys(e) == []
    e.attend_decode(["a"], 1, q, kn[1], vn[1])
    assert e.lookup(PROMPT[:8] + [1]) == FULL and len(stored_keys(e)) == 1
    e.check_integrity()
