"""An open whose order names its prompt (OpenRequest.prompt_key): the engine takes the carried
cached prefix only if the keys it computes end at the named key, else refuses and changes
nothing but the failed open's tombstone; the hit statistics count the whole prompt."""

from __future__ import annotations

import pytest
from engine_helpers import SPEC, fill, make_engine, snapshot

from pagedkv.protos.errors import InvalidArgument
from pagedkv.protos.keys import chain_keys, root_key

SALT = b"s" * 16
BS = SPEC.block_size
NAMED = list(range(100, 100 + 3 * BS))
OTHER = NAMED[:BS] + list(range(500, 500 + 2 * BS))  # its first block shared, the others not


def _key(tokens: list[int]) -> bytes:
    return chain_keys(root_key(SALT), tokens, BS)[-1]


def test_the_named_prefix_opens_and_another_cached_one_is_refused() -> None:
    engine = make_engine()
    fill(engine, "named-src", NAMED + [1], salt=SALT)
    fill(engine, "other-src", OTHER + [1], salt=SALT)  # both prompts' blocks held on this engine
    for seq_id in ("named-src", "other-src"):
        engine.free(seq_id)
    want = 2 * BS
    key = _key(NAMED[:want])
    assert _key(OTHER[:want]) != key
    before = snapshot(engine)
    with pytest.raises(InvalidArgument, match="not the one the coordinator placed"):
        engine.open("x", OTHER[:want], SALT, None, want, named=(len(NAMED) + 1, key))
    assert "x" not in engine.manager.seqs
    after = snapshot(engine)
    assert after[1:4] == before[1:4]  # sequences and every block's references as they were
    assert all(a.equal(b) for a, b in zip(after[5:], before[5:], strict=True))  # the pools' bytes
    engine.manager.check_integrity()
    queried = engine.manager.counters.prefix_query_tokens
    res = engine.open("x", NAMED[:want], SALT, None, want, named=(len(NAMED) + 1, key))
    assert res.num_cached_tokens == want and engine.sequence_length("x") == want
    assert engine.manager.counters.prefix_query_tokens == queried + len(NAMED) + 1
    engine.manager.check_integrity()


def test_a_named_prompt_with_nothing_cached_needs_no_tokens() -> None:
    engine = make_engine()
    assert engine.open("empty", [], SALT, None, 0, named=(40, b"")).num_cached_tokens == 0
    with pytest.raises(InvalidArgument, match="hashes to another key"):
        engine.open("keyed", [], SALT, None, 0, named=(40, b"k" * 16))  # a key, yet no cached block
    assert "keyed" not in engine.manager.seqs
