"""Why an open's prompt was not all served from the device of the node it went to.

For each open the coordinator names the reason for its first block that the chosen node does
not serve from its device (`explain`), counts it (pagedkv_coordinator_open_misses{reason}) and,
when the worker asks (CoordOpenRequest.explain_miss), returns it in the open's reply:

    reason      the first such block                         node_id           policy
    ---------------------------------------------------------------------------------------
    none        (there is none: every block hit the device)   ""                ""
    host_tier   is on the chosen node's host tier (copied      the chosen node   ""
                back, not recomputed)
    in_flight   is being computed there by an open in flight   the chosen node   ""
    other_node  is cached on another live node, which was not  that node         ""
                chosen (load, the balance bound, a scan)
    evicted     was evicted lately by a node's policy          the evicting one  its policy
    not_cached  was never cached (or evicted before the        ""                ""
                coordinator's memory of evictions: RemovedKeys)

Only the open's own keys are looked at, and keys are salted per tenant, so the answer is about
the tenant's own prompts only: nothing says whether another tenant's prompt is cached.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from pagedkv.protos import pagedkv_pb2 as pb
from pagedkv.protos.keys import KEY_BYTES

from .placement import Placement

REASONS = ("none", "host_tier", "in_flight", "other_node", "evicted", "not_cached")


@dataclass(frozen=True)
class MissExplanation:
    """The reason (one of REASONS) for the first prompt block of an open not served from the
    chosen node's device, that block's index, and the node and policy the reason names."""

    reason: str
    first_block: int = 0
    node_id: str = ""
    policy: str = ""
    cached_elsewhere_blocks: int = 0  # other_node: leading blocks that node holds


class RemovedKeys:
    """The keys nodes reported removed (evicted for good) lately, with the node that removed
    each: a bounded memory (the oldest forgotten first), what tells "evicted" from "never
    cached". Not thread-safe: the caller holds its lock."""

    def __init__(self, capacity: int = 1 << 18) -> None:  # 16-byte keys and a node id: ~30 MB
        self.capacity = capacity
        self._by_key: OrderedDict[bytes, str] = OrderedDict()

    def add(self, node_id: str, keys: Iterable[bytes]) -> None:
        memory = self._by_key
        for key in keys:
            memory[key] = node_id
            memory.move_to_end(key)
        while len(memory) > self.capacity:
            memory.popitem(last=False)

    def discard(self, keys: Iterable[bytes]) -> None:
        """Keys stored again (on any node) are no longer evicted."""
        memory = self._by_key
        if memory:
            for key in keys:
                memory.pop(key, None)

    def remover(self, key: bytes) -> str | None:
        return self._by_key.get(key)

    def __len__(self) -> int:
        return len(self._by_key)


class NodePolicies(Mapping[str, str]):
    """node id -> eviction policy, read through a node table (NodeInfo values) when asked:
    an open explains its miss without copying every node's policy."""

    def __init__(self, nodes: Mapping[str, Any]) -> None:
        self._nodes = nodes

    def __getitem__(self, node_id: str) -> str:
        return str(self._nodes[node_id].policy)

    def __iter__(self) -> Iterator[str]:
        return iter(self._nodes)

    def __len__(self) -> int:
        return len(self._nodes)


def explain(
    placement: Placement, keys: bytes, removed: RemovedKeys, policies: Mapping[str, str]
) -> MissExplanation:
    """The reason for `placement`'s first block not served from its node's device. `keys` is the
    prompt's block keys joined (the blocks that may be cached: the prompt's last token is always
    computed, so a prompt whose keys all hit is `none`); `policies`: node id -> eviction policy."""
    device = placement.cached_blocks - placement.host_blocks
    if placement.host_blocks:
        return MissExplanation("host_tier", device, placement.node_id)
    first = placement.cached_blocks
    if first * KEY_BYTES >= len(keys):
        return MissExplanation("none", first)
    if placement.pending_blocks:
        return MissExplanation("in_flight", first, placement.node_id)
    if placement.cached_elsewhere_blocks > first:
        node = placement.cached_elsewhere_node_id
        return MissExplanation(
            "other_node", first, node, cached_elsewhere_blocks=placement.cached_elsewhere_blocks
        )
    remover = removed.remover(keys[first * KEY_BYTES : (first + 1) * KEY_BYTES])
    if remover is not None:
        return MissExplanation("evicted", first, remover, policies.get(remover, ""))
    return MissExplanation("not_cached", first)


def miss_message(miss: MissExplanation) -> pb.MissExplanation:
    """The explanation as the open's reply carries it (CoordOpenResponse.miss)."""
    return pb.MissExplanation(
        reason=pb.MissExplanation.Reason.Value(miss.reason.upper()),
        first_block=miss.first_block,
        node_id=miss.node_id,
        policy=miss.policy,
        cached_elsewhere_blocks=miss.cached_elsewhere_blocks,
    )
