"""coordinator/prompt_refs.py and client/sent_prompts.py: a prompt named by a ref keys exactly
as the whole prompt does, and nothing but a ref its own tenant was given is honoured."""

from __future__ import annotations

import random

import numpy as np
import pytest

from pagedkv.client.sent_prompts import KEPT, MIN_REF_TOKENS, SentPrompts
from pagedkv.coordinator.prompt_refs import MIN_REF_BLOCKS, PromptRefs
from pagedkv.protos import pagedkv_pb2 as pb
from pagedkv.protos.errors import InvalidArgument, PrefixUnknown
from pagedkv.protos.keys import KEY_BYTES, chain_keys_packed, root_key

ROOT, OTHER = root_key(b"a" * 16), root_key(b"b" * 16)
BS = 16


def _keys(root: bytes, tokens: np.ndarray, bs: int = BS) -> bytes:
    return chain_keys_packed(root, tokens[: len(tokens) // bs * bs], bs)


def test_a_named_prefix_keys_as_the_whole_prompt() -> None:
    rnd = random.Random(7)
    refs = PromptRefs()
    for trial in range(60):
        first = np.asarray([rnd.randrange(50_000) for _ in range(rnd.randrange(4 * BS, 40 * BS))], np.int32)
        ref = refs.keep(ROOT, BS, _keys(ROOT, first))
        assert ref == _keys(ROOT, first)[-KEY_BYTES:]
        held_blocks = len(first) // BS
        prefix = rnd.randrange(1, held_blocks + 1) * BS
        tail = np.asarray([rnd.randrange(50_000) for _ in range(rnd.randrange(0, 5 * BS))], np.int32)
        whole = np.concatenate((first[:prefix], tail))
        for num_blocks in {len(whole) // BS, max(0, (len(whole) - 1) // BS), prefix // BS - 1}:
            if num_blocks < 0:
                continue
            got = refs.keys(f"s{trial}", ROOT, BS, ref, prefix, tail, num_blocks)
            assert got == _keys(ROOT, whole[: num_blocks * BS]), (trial, prefix, num_blocks)


def test_only_the_root_and_block_size_that_made_a_ref_name_it() -> None:
    refs = PromptRefs()
    tokens = np.arange(1, 8 * BS + 1, dtype=np.int32)
    ref = refs.keep(ROOT, BS, _keys(ROOT, tokens))
    tail = np.asarray([5], np.int32)
    for root, bs, named in (
        (OTHER, BS, ref),
        (ROOT, 32, ref),
        (ROOT, BS, bytes(KEY_BYTES)),
        (ROOT, BS, b"x"),
    ):
        with pytest.raises(PrefixUnknown, match="does not hold: send it whole") as err:
            refs.keys("s1", root, bs, named, 2 * bs, tail, 3)
        assert err.value.seq_id == "s1"
    assert refs.keys("s1", ROOT, BS, ref, 2 * BS, tail, 2) == _keys(ROOT, tokens[: 2 * BS])


@pytest.mark.parametrize(
    ("prefix", "says"),
    [(0, "positive multiple of the block size"), (-16, "positive multiple"),
     (17, "multiple of the block size (16)"), (9 * BS, "more than the 128 tokens its prefix_ref names")],
)  # fmt: skip
def test_a_prefix_that_is_not_whole_blocks_of_the_ref_is_refused_by_name(prefix: int, says: str) -> None:
    refs = PromptRefs()
    ref = refs.keep(ROOT, BS, _keys(ROOT, np.arange(8 * BS, dtype=np.int32)))
    with pytest.raises(InvalidArgument, match=says.replace("(", r"\(").replace(")", r"\)")):
        refs.keys("s", ROOT, BS, ref, prefix, np.zeros(BS, np.int32), 9)


def test_short_prompts_get_no_ref_and_the_held_bytes_are_bounded() -> None:
    refs = PromptRefs(max_key_bytes=10 * 8 * KEY_BYTES)
    assert refs.keep(ROOT, BS, bytes((MIN_REF_BLOCKS - 1) * KEY_BYTES)) == b""
    made = [refs.keep(ROOT, BS, _keys(ROOT, np.arange(i, i + 8 * BS, dtype=np.int32))) for i in range(30)]
    assert refs.num_bytes <= refs.max_key_bytes
    tail = np.zeros(0, np.int32)
    assert refs.keys("s", ROOT, BS, made[-1], BS, tail, 1)  # the newest is held
    with pytest.raises(PrefixUnknown):  # the oldest went first
        refs.keys("s", ROOT, BS, made[0], BS, tail, 1)
    again = refs.keep(ROOT, BS, _keys(ROOT, np.arange(29, 29 + 8 * BS, dtype=np.int32)))
    assert again == made[-1] and refs.num_bytes <= refs.max_key_bytes  # the same prompt: held once


def test_a_tenant_flooding_long_prompts_pushes_out_its_own_refs_first() -> None:
    refs = PromptRefs(max_key_bytes=20 * 8 * KEY_BYTES)
    victims = [refs.keep(OTHER, BS, _keys(OTHER, np.arange(i, i + 8 * BS, dtype=np.int32))) for i in range(5)]
    for i in range(200):  # the flood: 200 prompts of 8 blocks where 20 fit in all
        refs.keep(ROOT, BS, _keys(ROOT, np.arange(10_000 + i, 10_000 + i + 8 * BS, dtype=np.int32)))
    assert refs.num_bytes <= refs.max_key_bytes
    tail = np.zeros(0, np.int32)
    for ref in victims:  # the victim holds its 5: under its fair share, never the largest
        assert refs.keys("s", OTHER, BS, ref, BS, tail, 1)
    assert refs.keep(ROOT, BS, bytes(21 * 8 * KEY_BYTES)) == b""  # larger than the whole bound


def _reply(ref: bytes, tokens: int, bs: int = BS) -> pb.CoordOpenResponse:
    return pb.CoordOpenResponse(prompt_ref=ref, prompt_ref_tokens=tokens, block_size=bs)


def _packed(tokens: list[int]) -> bytes:
    return np.asarray(tokens, "<i4").tobytes()


def test_the_worker_names_the_longest_whole_block_start_it_shares() -> None:
    sent = SentPrompts()
    system = list(range(1000, 1000 + 10 * BS + 5))
    assert sent.name(_packed(system)) == (b"", 0)  # nothing held yet
    sent.learn(_packed(system + [1, 2]), _reply(b"r1", 10 * BS))
    sent.learn(_packed(system[: 6 * BS] + [7] * 50), _reply(b"r2", 6 * BS))
    assert sent.name(_packed(system + [9])) == (b"r1", 10 * BS)
    # shares 7 blocks and 3 tokens with r1 (6 whole blocks with r2): r1's 7 blocks
    assert sent.name(_packed(system[: 7 * BS + 3] + [4] * 40)) == (b"r1", 7 * BS)
    assert sent.name(_packed(system[: MIN_REF_TOKENS - 1] + [0] * 100)) == (b"", 0)  # under the minimum
    assert sent.name(_packed([5] + system)) == (b"", 0)  # the first token differs
    whole = _packed(system + [9])
    request = pb.CoordOpenRequest(packed_token_ids=whole, carries_prompt=True)
    assert sent.fill(request, whole) == 10 * BS  # the request names r1 and sends the rest
    assert (request.prefix_ref, request.prefix_tokens) == (b"r1", 10 * BS)
    assert request.packed_token_ids == whole[4 * 10 * BS :]
    sent.forget()
    assert sent.name(_packed(system)) == (b"", 0)
    untouched = pb.CoordOpenRequest(packed_token_ids=whole)
    assert sent.fill(untouched, whole) == 0
    assert untouched.packed_token_ids == whole and not untouched.prefix_ref


def test_the_worker_holds_its_latest_prompts_and_ignores_replies_that_do_not_fit() -> None:
    sent = SentPrompts()
    prompts = [[i] * (8 * BS) for i in range(KEPT + 2)]
    for i, p in enumerate(prompts):
        sent.learn(_packed(p), _reply(f"r{i}".encode(), 8 * BS))
    assert sent.name(_packed(prompts[-1])) == (f"r{KEPT + 1}".encode(), 8 * BS)
    assert sent.name(_packed(prompts[0])) == (b"", 0)  # pushed out by newer ones
    for bad in (_reply(b"", 8 * BS), _reply(b"x", 0), _reply(b"x", 8 * BS + 1), _reply(b"x", 8 * BS, 0),
                _reply(b"x", 9 * BS)):  # fmt: skip
        fresh = SentPrompts()
        fresh.learn(_packed([3] * (8 * BS)), bad)
        assert fresh.name(_packed([3] * (8 * BS))) == (b"", 0), bad


def test_the_named_start_is_the_longest_any_held_prompt_shares() -> None:
    """Against a brute force over random prompts sharing random starts (block sizes mixed)."""
    rnd = random.Random(3)
    for trial in range(200):
        base = [rnd.randrange(9) for _ in range(400)]
        sent, held = SentPrompts(), []
        for i in range(rnd.randrange(1, KEPT + 1)):
            bs = rnd.choice((4, 16))
            cut = rnd.randrange(0, 400)
            prompt = base[:cut] + [rnd.randrange(9) for _ in range(rnd.randrange(0, 200))]
            ref_tokens = len(prompt) // bs * bs
            if ref_tokens:
                sent.learn(_packed(prompt), _reply(b"r%d" % i, ref_tokens, bs))
                held.append((b"r%d" % i, prompt[:ref_tokens], bs))
        new = base[: rnd.randrange(0, 400)] + [rnd.randrange(9) for _ in range(50)]
        best = 0
        for _, tokens, bs in held:
            shared = next((j for j, (a, b) in enumerate(zip(tokens, new, strict=False)) if a != b), None)
            shared = min(len(tokens), len(new)) if shared is None else shared
            best = max(best, shared - shared % bs)
        ref, named = sent.name(_packed(new))
        assert named == (best if best >= MIN_REF_TOKENS else 0), trial
        if named:
            tokens, bs = next((t, b) for r, t, b in held if r == ref)
            assert tokens[:named] == new[:named] and named % bs == 0
