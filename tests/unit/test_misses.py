"""explain() (coordinator/misses.py): each reason for an open's first block not served from
its node's device, with the node and policy it names; RemovedKeys stays bounded."""

from __future__ import annotations

from pagedkv.coordinator.misses import MissExplanation, RemovedKeys, explain, miss_message
from pagedkv.coordinator.placement import Placement
from pagedkv.protos import pagedkv_pb2 as pb

KEYS = b"".join(i.to_bytes(16, "big") for i in range(1, 5))  # 4 cacheable blocks
POLICIES = {"n1": "lru", "n2": "slru"}


def why(placement: Placement, removed: RemovedKeys | None = None) -> MissExplanation:
    return explain(placement, KEYS, removed or RemovedKeys(), POLICIES)


def test_every_reason_names_its_block_node_and_policy() -> None:
    assert why(Placement("n1", 4, 64, 1)) == MissExplanation("none", 4)
    # 3 cached, the last 2 of them on n1's host tier: the first block off the device is block 1.
    assert why(Placement("n1", 3, 48, 2, host_blocks=2)) == MissExplanation("host_tier", 1, "n1")
    assert why(Placement("n1", 1, 16, 4, pending_blocks=3)) == MissExplanation("in_flight", 1, "n1")
    other = Placement("n1", 1, 16, 4, cached_elsewhere_blocks=3, cached_elsewhere_node_id="n2")
    assert why(other) == MissExplanation("other_node", 1, "n2", cached_elsewhere_blocks=3)
    # Another node holding no more than the chosen one is not the reason.
    assert why(Placement("n1", 1, 16, 4, cached_elsewhere_blocks=1)).reason == "not_cached"
    removed = RemovedKeys()
    removed.add("n2", [KEYS[16:32]])
    assert why(Placement("n1", 1, 16, 4), removed) == MissExplanation("evicted", 1, "n2", "slru")
    assert why(Placement("n1", 0, 0, 5), removed) == MissExplanation("not_cached", 0)
    removed.discard([KEYS[16:32]])  # stored again somewhere: no longer "evicted"
    assert why(Placement("n1", 1, 16, 4), removed).reason == "not_cached"


def test_removed_keys_forget_the_oldest_beyond_their_capacity() -> None:
    removed = RemovedKeys(capacity=2)
    removed.add("n1", [b"a" * 16, b"b" * 16])
    removed.add("n2", [b"c" * 16, b"a" * 16])  # a again: now the newest, evicted by n2
    assert len(removed) == 2
    assert (removed.remover(b"a" * 16), removed.remover(b"b" * 16), removed.remover(b"c" * 16)) == (
        "n2",
        None,
        "n2",
    )


def test_the_reply_carries_the_explanation() -> None:
    msg = miss_message(MissExplanation("evicted", 7, "n2", "slru"))
    assert (msg.reason, msg.first_block, msg.node_id, msg.policy) == (
        pb.MissExplanation.EVICTED,
        7,
        "n2",
        "slru",
    )
