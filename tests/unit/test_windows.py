"""Attention specs kept per sequence on the node (cache_node/windows.py): every attend follows
the sequence's per-layer spec, exactly (float64 reference over the whole history, released
blocks included), and windows release the blocks no later query sees, with prefix caching,
forks, swaps and the integrity check all still right."""

from __future__ import annotations

import math

import pytest
import torch
from engine_helpers import assert_unchanged, make_engine, snapshot

from pagedkv.cache_node.attention.spec import AttentionSpec
from pagedkv.protos.attention import LayerAttention, check_layers, from_messages, to_messages
from pagedkv.protos.errors import IntegrityError, InvalidArgument
from pagedkv.protos.spec import ModelSpec

SPEC = ModelSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float32", block_size=4)
HQ = 4
TOL = 2e-5


def dense(q, keys, values, pos: int, layer: LayerAttention):
    """Float64 reference for one query [Hq, D] at `pos` over keys [pos + 1, Hk, D]."""
    spec = AttentionSpec(layer.scale, layer.window, layer.chunk, layer.softcap)
    k64 = keys.double().repeat_interleave(HQ // keys.shape[1], 1)
    v64 = values.double().repeat_interleave(HQ // keys.shape[1], 1)
    scale = layer.scale if layer.scale is not None else q.shape[-1] ** -0.5
    scores = torch.einsum("hd,lhd->hl", q.double(), k64) * scale
    if layer.softcap:
        scores = layer.softcap * torch.tanh(scores / layer.softcap)
    hidden = spec.hidden(torch.tensor(pos), torch.arange(keys.shape[0]))
    scores = scores.masked_fill(hidden, -math.inf)
    lse = torch.logsumexp(scores, -1)
    return torch.einsum("hl,lhd->hd", torch.softmax(scores, -1), v64), lse


class Decoder:
    """Drives sequences of one engine step by step and keeps their whole K/V history."""

    def __init__(self, engine, seed: int = 0) -> None:
        self.engine = engine
        self.g = torch.Generator().manual_seed(seed)
        self.hist: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}  # per layer (k, v)
        self.specs: dict[str, tuple[LayerAttention, ...]] = {}
        self.next_token = 100

    def open(self, sid: str, n: int, layers=None, tokens=None) -> None:
        s = self.engine.spec
        if tokens is None:  # distinct prompts: no prefix hit between the test's sequences
            tokens = list(range(self.next_token, self.next_token + n))
            self.next_token += n
        cached = self.engine.open(sid, tokens, attention=layers).num_cached_tokens
        assert cached == 0
        self.specs[sid] = tuple(layers) if layers else (LayerAttention(),) * s.num_layers
        k = torch.randn(s.num_layers, n, s.num_kv_heads, s.head_dim, generator=self.g)
        v = torch.randn(k.shape, generator=self.g)
        self.hist[sid] = [(k[layer], v[layer]) for layer in range(s.num_layers)]
        for layer in range(s.num_layers):
            q = torch.randn(n, HQ, s.head_dim, generator=self.g)
            out = self.engine.attend_prefill(
                sid, layer, q, k[layer], v[layer], tokens if layer == 0 else None
            )
            for i in (0, n - 1):
                self.check(sid, layer, q[i], out.out[i], out.lse[i], i)

    def fork(self, parent: str, child: str) -> None:
        self.engine.fork(parent, child)
        self.hist[child] = list(self.hist[parent])
        self.specs[child] = self.specs[parent]

    def step(self, sids: list[str], token: int = 7) -> None:
        s = self.engine.spec
        for layer in range(s.num_layers):
            q = torch.randn(len(sids), HQ, s.head_dim, generator=self.g)
            k = torch.randn(len(sids), s.num_kv_heads, s.head_dim, generator=self.g)
            v = torch.randn(k.shape, generator=self.g)
            res = self.engine.attend_decode(sids, layer, q, k, v, [token] * len(sids) if layer == 0 else None)
            for b, sid in enumerate(sids):
                hk, hv = self.hist[sid][layer]
                self.hist[sid][layer] = (torch.cat([hk, k[b : b + 1]]), torch.cat([hv, v[b : b + 1]]))
                self.check(sid, layer, q[b], res.out[b], res.lse[b], hk.shape[0])
        self.engine.check_integrity()

    def check(self, sid, layer, q, out, lse, pos) -> None:
        k, v = self.hist[sid][layer]
        want, want_lse = dense(q, k[: pos + 1], v[: pos + 1], pos, self.specs[sid][layer])
        assert (out.double() - want).abs().max() < TOL, (sid, layer, pos)
        assert (lse.double() - want_lse).abs().max() < TOL, (sid, layer, pos)

    def num_blocks(self, sid: str) -> int:
        return len(self.engine.block_table(sid))


def windowed(w0: int, w1: int) -> list[LayerAttention]:
    return [LayerAttention(window=w0), LayerAttention(window=w1)]


def test_a_window_decodes_exactly_past_it_with_the_blocks_it_holds_flat():
    engine = make_engine(num_blocks=32, spec=SPEC)
    d = Decoder(engine)
    d.open("s", 10, windowed(8, 5))
    held = []
    for _ in range(40):
        d.step(["s"])
        held.append(d.num_blocks("s"))
    # a query at p sees p-7..p: at most 3 blocks of 4, plus the block being filled
    assert max(held) <= 4, held
    assert engine.sequence_length("s") == 50
    assert engine.cache_length("s") < 16
    assert engine.stats()["window_released_blocks"] == (50 - engine.cache_length("s")) // 4


def test_chunks_release_whole_chunks_and_stay_exact():
    engine = make_engine(num_blocks=32, spec=SPEC)
    d = Decoder(engine)
    layers = [LayerAttention(chunk=8), LayerAttention(chunk=8, softcap=5.0, scale=0.5)]
    d.open("c", 6, layers)
    released = set()
    for _ in range(30):
        d.step(["c"])
        dropped = engine.sequence_length("c") - engine.cache_length("c")
        assert dropped % 8 == 0
        released.add(dropped)
    assert released == {0, 8, 16, 24, 32}


def test_one_full_layer_keeps_every_block_and_softcap_scale_need_no_window():
    engine = make_engine(num_blocks=32, spec=SPEC)
    d = Decoder(engine)
    d.open("mixed", 5, [LayerAttention(window=4), LayerAttention(softcap=3.0)])
    d.open("capped", 3, [LayerAttention(softcap=2.0, scale=0.9), LayerAttention(scale=1.3)])
    d.open("plain", 7)
    for _ in range(20):
        d.step(["mixed", "plain", "capped"])  # one batch, three specs per layer
    assert d.num_blocks("mixed") == math.ceil(25 / 4)
    assert engine.stats()["window_released_blocks"] == 0


def test_a_fork_inherits_the_spec_and_shared_released_blocks_stay_right():
    engine = make_engine(num_blocks=48, spec=SPEC)
    d = Decoder(engine)
    d.open("p", 9, windowed(6, 6))
    for _ in range(12):
        d.step(["p"])
    d.fork("p", "c")
    for i in range(14):
        d.step(["p", "c"], token=i)
    assert engine.sequence_length("c") == engine.sequence_length("p") == 35
    assert d.num_blocks("c") <= 3 and d.num_blocks("p") <= 3
    engine.free("p")
    d.step(["c"])
    engine.free("c")
    engine.check_integrity()
    assert engine.stats()["used_blocks"] == 0


def test_released_prompt_blocks_stay_cached_for_the_next_prompt():
    engine = make_engine(num_blocks=32, spec=SPEC)
    d = Decoder(engine)
    prompt = list(range(200, 216))  # four full blocks, keyed at prefill
    d.open("a", 16, windowed(4, 4), tokens=prompt)
    for _ in range(10):
        d.step(["a"])
    assert engine.cache_length("a") < 16  # the prompt's first blocks left the table...
    assert engine.lookup(prompt) == 16  # ...and are still cached, whole
    assert engine.open("b", prompt + [5], attention=windowed(4, 4)).num_cached_tokens == 16
    engine.free("a")
    engine.free("b")
    engine.check_integrity()


def test_swapping_a_released_sequence_out_and_in_keeps_it_exact():
    engine = make_engine(num_blocks=32, num_host_blocks=16, spec=SPEC)
    d = Decoder(engine)
    d.open("s", 7, windowed(5, 9))
    for _ in range(15):
        d.step(["s"])
    engine.swap_out("s")
    engine.swap_in("s")
    for _ in range(6):
        d.step(["s"])


def test_a_spec_the_node_cannot_honour_is_refused_at_open_and_changes_nothing():
    engine = make_engine(num_blocks=16, spec=SPEC)
    before = snapshot(engine)
    with pytest.raises(InvalidArgument, match="attention lists 3 layers; the model has 2"):
        engine.open("x", [1, 2, 3], attention=[LayerAttention(window=4)] * 3)
    with pytest.raises(InvalidArgument, match="attention layer 1: a LayerAttention, got dict"):
        engine.open("x", [1, 2, 3], attention=[LayerAttention(), {"window": 4}])
    with pytest.raises(InvalidArgument, match="expect_cached_tokens"):
        engine.open("x", [1, 2, 3], expect_cached_tokens=9, attention=windowed(4, 4))
    assert_unchanged(before, engine)
    assert engine.specs.get("x") is None
    for bad, match in (
        ({"window": -1}, "window must be an int >= 0"),
        ({"chunk": 2.0}, "chunk must be an int >= 0"),
        ({"softcap": float("nan")}, "softcap must be a finite number >= 0"),
        ({"scale": 0.0}, "scale must be a finite number > 0"),
    ):
        with pytest.raises(InvalidArgument, match=match):
            LayerAttention(**bad)


def test_the_wire_form_round_trips_and_names_the_bad_layer():
    layers = [LayerAttention(window=4096), LayerAttention(chunk=8192, softcap=50.0, scale=0.125)]
    assert from_messages(to_messages(layers), 2) == tuple(layers)
    assert from_messages(to_messages([LayerAttention()] * 2), 2) == ()  # all plain: nothing kept
    msgs = to_messages(layers)
    msgs[1].softcap = -1.0
    with pytest.raises(InvalidArgument, match="layer 1: attention: softcap"):
        from_messages(msgs, 2)
    assert check_layers(None, 2) == () and check_layers([], 2) == ()


def test_queries_that_would_reach_released_blocks_are_refused():
    engine = make_engine(num_blocks=32, spec=SPEC)
    d = Decoder(engine)
    d.open("s", 6, windowed(4, 4))
    for _ in range(12):
        d.step(["s"])
    assert (engine.sequence_length("s"), engine.cache_length("s")) == (18, 6)  # 12 released
    q = torch.randn(5, HQ, SPEC.head_dim)
    before = snapshot(engine)
    with pytest.raises(InvalidArgument, match="were released"):
        engine.attend_prefill("s", 1, q)  # positions 13..17: 13 sees from 10
    assert_unchanged(before, engine)
    one = engine.attend_prefill("s", 1, q[:1])  # the last position is always answerable
    assert one.out.shape == (1, HQ, SPEC.head_dim)


def test_a_budget_is_refused_on_a_windowed_sequence():
    engine = make_engine(num_blocks=32, spec=SPEC)
    engine.open("w", [1, 2, 3], attention=windowed(4, 4))
    with pytest.raises(InvalidArgument, match="token budget would"):
        engine.set_budget("w", 16, 1, 1)
    engine.open("c", [1, 2, 3], attention=[LayerAttention(softcap=2.0)] * 2)
    engine.set_budget("c", 16, 1, 1)  # no window: a budget is as before
    engine.free("w")
    engine.free("c")


def test_the_integrity_check_sees_a_block_released_too_early():
    engine = make_engine(num_blocks=32, spec=SPEC)
    d = Decoder(engine)
    d.open("s", 14, windowed(8, 8))  # position 13 sees 6..13: the prefill released block 0
    assert engine.cache_length("s") == 10
    engine.manager.release_leading("s", 2)  # blocks 1 and 2, which it still sees
    with pytest.raises(IntegrityError, match="sequence 's' released 12 tokens; 1 blocks of 4"):
        engine.check_integrity()
    engine.free("s")
    engine.check_integrity()
