"""The client's budget over several extents (client/budget.py) chooses what one node's budget
(cache_node/kv/budget.py) chooses over the same blocks laid end to end."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv.cache_node.kv.budget import drop_plan
from pagedkv.cache_node.kv.sequence import Budget
from pagedkv.cache_node.kv.sequence import Sequence as NodeSequence
from pagedkv.client.budget import SpreadBudget


@st.composite
def layouts(draw: st.DrawFn) -> tuple[int, list[int], list[float], tuple[int, int, int], int]:
    bs = draw(st.sampled_from([1, 2, 4, 16]))
    extents = draw(st.lists(st.integers(0, 6), min_size=1, max_size=4))  # full blocks per sealed extent
    tail = draw(st.integers(0, 5 * bs))  # tokens in the tail
    blocks = sum(extents) + -(-tail // bs)
    # few distinct scores: ties, broken by position on both sides
    scores = draw(st.lists(st.sampled_from([0.0, 0.5, 1.0, 2.0]), min_size=blocks, max_size=blocks))
    sink, recent = draw(st.integers(0, 3)), draw(st.integers(1, 3))
    held = sum(extents) * bs + tail
    max_tokens = draw(st.integers((sink + recent) * bs, max((sink + recent) * bs, held + bs)))
    incoming = draw(st.integers(0, 3 * bs))
    return bs, [*extents, tail], scores, (max_tokens, sink, recent), incoming


@settings(max_examples=3000, deadline=None)
@given(layouts())
def test_the_spread_plan_is_one_nodes_plan(layout) -> None:
    bs, extents, scores, (max_tokens, sink, recent), incoming = layout
    *sealed, tail = extents
    appended = [n * bs for n in sealed] + [tail]
    budget = SpreadBudget(max_tokens, sink, recent, bs)
    budget.sync(appended)
    at = 0
    for held in budget.scores:  # the same scores, extent by extent
        held[:] = scores[at : at + len(held)]
        at += len(held)
    node = NodeSequence(
        "s", b"", list(range(sum(appended))), table=list(range(len(scores))), scores=list(scores)
    )
    node.budget = Budget(max_tokens, sink, recent)
    want = drop_plan(node, incoming, bs)
    plan = budget.plan(incoming)
    firsts = [0]
    for held in budget.scores:
        firsts.append(firsts[-1] + len(held))
    got = sorted(firsts[e] + i for e, indices in plan.items() for i in indices)
    assert got == want
    for e, indices in plan.items():
        assert indices == sorted(set(indices)) and all(0 <= i < len(budget.scores[e]) for i in indices)
        budget.lost(e, indices)
    assert sum(len(h) for h in budget.scores) == len(scores) - len(want)
    assert sum(budget.dropped) == len(want) * bs
