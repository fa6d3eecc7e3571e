"""A lost sharded sequence names the node it was lost with, whichever extent that node held:
data calls (Describe after a failed call) and close answer the same node."""

from __future__ import annotations

import pytest

from pagedkv.coordinator.core import Coordinator
from pagedkv.coordinator.memory_store import MemoryStore
from pagedkv.coordinator.records import Extent, SequenceRecord
from pagedkv.protos.errors import SequenceLost

EXTENTS = (Extent("n1", 0, 6), Extent("n2", 6, 3))


@pytest.mark.parametrize(("reason", "named"), [("node n2 died", "n2"), ("node n1 died", "n1"), ("", "n1")])
def test_the_lost_extent_is_named(reason: str, named: str) -> None:
    coordinator = Coordinator(MemoryStore())
    record = SequenceRecord("s", "t", EXTENTS, num_tokens=36, state="lost", lost_reason=reason)
    with pytest.raises(SequenceLost) as caught:
        coordinator._live_node_of(record)
    assert caught.value.node_id == named
    assert coordinator.lost_node_of(record) == named  # what close names
    coordinator.stop()
