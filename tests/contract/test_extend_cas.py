"""An Extend's compare-and-set on every backend (issue 20): update_sequence(expect_tail=...)
applies only while the last extent is the one the caller saw, else raises TailMoved with
the record as it is and changes nothing -- two coordinators extending one sequence at once
make one extent."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import test_store_contract
from test_store_contract import register, seq

from pagedkv.coordinator.records import Extent
from pagedkv.coordinator.store import Store, TailMoved

store, store_url = test_store_contract.store, test_store_contract.store_url  # the contract's fixtures


def test_an_update_expecting_a_tail_that_moved_changes_nothing(store: Store) -> None:
    register(store, "n1", "n2", "n3")
    store.create_sequence(seq("s", ("n1", 0, 5), num_tokens=17))
    grown = store.update_sequence("s", extents=[("n1", 0, 4), ("n2", 4, 0)], expect_tail=("n1", 0))
    assert grown.extents == (Extent("n1", 0, 4), Extent("n2", 4, 0))
    # a second coordinator saw the old tail: refused, the record and the node links unchanged
    with pytest.raises(TailMoved, match="tail is on n2 from block 4, not on n1 from block 0") as info:
        store.update_sequence("s", extents=[("n1", 0, 4), ("n3", 4, 0)], num_tokens=99, expect_tail=("n1", 0))
    assert info.value.record == grown
    assert store.get_sequence("s") == grown
    assert store.sequences_of_node("n3") == []
    # the same node, another first block: not the tail either
    with pytest.raises(TailMoved):
        store.update_sequence("s", num_tokens=5, expect_tail=("n2", 5))
    # the tail it has: applied (the grown tail's own fields too)
    again = store.update_sequence("s", extents=[("n1", 0, 4), ("n2", 4, 2)], expect_tail=("n2", 4))
    assert again.extents[-1] == Extent("n2", 4, 2)
    assert store.update_sequence("s", num_tokens=3).num_tokens == 3  # no expectation: as before


def test_racing_extends_of_one_tail_make_one_extent(store: Store) -> None:
    register(store, "n1", "n2", "n3", "n4")
    for i in range(10):
        store.create_sequence(seq(f"s{i}", ("n1", 0, 3)))
    won = 0
    with ThreadPoolExecutor(3) as pool:
        for i in range(10):
            calls = [
                pool.submit(
                    store.update_sequence,
                    f"s{i}",
                    extents=[("n1", 0, 2), (node, 2, 0)],
                    expect_tail=("n1", 0),
                )
                for node in ("n2", "n3", "n4")
            ]
            errors = [f.exception() for f in calls]
            assert sum(e is None for e in errors) == 1, errors  # exactly one wins
            assert all(isinstance(e, TailMoved) for e in errors if e is not None)
            record = store.get_sequence(f"s{i}")
            assert len(record.extents) == 2
            holders = [
                n for n in ("n2", "n3", "n4") if f"s{i}" in {r.seq_id for r in store.sequences_of_node(n)}
            ]
            assert holders == [record.extents[1].node_id]  # only the winner's node is linked
            won += 1
    assert won == 10
