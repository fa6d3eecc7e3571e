"""Store.expire_lost, on every backend: lost records are garbage-collected (issue 18), others
are never touched."""

from __future__ import annotations

import pytest
import test_store_contract
from test_store_contract import register, seq, wait_until

from pagedkv.coordinator.store import Store
from pagedkv.protos.errors import InvalidArgument, SequenceNotFound

store, store_url = test_store_contract.store, test_store_contract.store_url  # the contract's fixtures


def test_lost_records_expire_and_nothing_else_does(store: Store) -> None:
    register(store, "n1", "n2")
    store.create_sequence(seq("a", ("n1", 0, 2)))
    store.create_sequence(seq("b", ("n1", 0, 1)))
    store.create_sequence(seq("c", ("n2", 0, 1)))
    store.remove_node("n1")  # a and b are lost
    assert store.expire_lost(["a", "c", "nobody"], 0.3) == 1  # c is active, nobody unknown
    assert store.get_sequence("a").state == "lost"
    wait_until(lambda: _gone(store, "a"))
    assert store.get_sequence("b").state == "lost"  # not given an expiry: kept until closed
    assert store.get_sequence("c").state == "active"
    assert [r.seq_id for r in store.sequences_of_node("n2")] == ["c"]
    assert store.expire_lost([], 1.0) == 0


def test_expire_lost_refuses_bad_input(store: Store) -> None:
    with pytest.raises(InvalidArgument, match="ttl_s"):
        store.expire_lost(["a"], 0)
    with pytest.raises(InvalidArgument, match="seq_id"):
        store.expire_lost([""], 1.0)


def _gone(s: Store, seq_id: str) -> bool:
    try:
        s.get_sequence(seq_id)
    except SequenceNotFound:
        return True
    return False
