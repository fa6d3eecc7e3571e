"""Lost records on every backend (issue 18): expire_lost and mark_lost garbage-collect them
(others are never touched), mark_lost unlinks them from their node, and a close that
requires a live node keeps the record of a suspect's sequence."""

from __future__ import annotations

import pytest
import test_store_contract
from test_store_contract import register, seq, wait_until

from pagedkv.coordinator.records import NodeNotLive
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


def test_mark_lost_unlinks_and_expires_once(store: Store) -> None:
    register(store, "n1")
    a, b = seq("a", ("n1", 0, 2)), seq("b", ("n1", 0, 1))
    store.create_sequence(a)
    store.create_sequence(b)
    assert store.mark_lost("a", "node n1 does not hold it", 0.3) == a  # what it was
    lost = store.get_sequence("a")
    assert (lost.state, lost.lost_reason) == ("lost", "node n1 does not hold it")
    assert [r.seq_id for r in store.sequences_of_node("n1")] == ["b"]  # unlinked at once
    assert store.mark_lost("a", "again", 30.0) is None  # lost already: nothing changes
    assert store.mark_lost("nobody", "x", 1.0) is None
    wait_until(lambda: _gone(store, "a"))  # its first expiry holds
    assert store.sequences_of_node("n1") == [b]
    with pytest.raises(InvalidArgument, match="ttl_s"):
        store.mark_lost("b", "x", 0)
    with pytest.raises(InvalidArgument, match="reason"):
        store.mark_lost("b", None, 1.0)  # type: ignore[arg-type]
    assert store.get_sequence("b") == b


def test_a_close_that_requires_a_live_node_keeps_a_suspects_record(store: Store) -> None:
    register(store, "n1")
    register(store, "n2", ttl_s=0.3)
    store.create_sequence(seq("a", ("n1", 0, 1)))
    store.create_sequence(seq("b", ("n2", 0, 1)))
    store.create_sequence(seq("c", ("n2", 0, 1)))
    wait_until(lambda: not any(n.node_id == "n2" for n in store.live_nodes()))
    with pytest.raises(NodeNotLive, match="n2") as info:
        store.delete_sequence("b", tenant="acme", require_live=True)
    assert info.value.node_id == "n2"
    assert [r.seq_id for r in store.sequences_of_node("n2")] == ["b", "c"]  # kept, linked
    assert store.delete_sequence("b").seq_id == "b"  # without the requirement: deleted
    assert store.delete_sequence("a", require_live=True).seq_id == "a"  # a live node's
    store.remove_node("n2")  # declared dead: c is lost, and a lost record is closed at once
    assert store.delete_sequence("c", require_live=True).state == "lost"
    assert store.sequences_of_node("n2") == []


def _gone(s: Store, seq_id: str) -> bool:
    try:
        s.get_sequence(seq_id)
    except SequenceNotFound:
        return True
    return False
