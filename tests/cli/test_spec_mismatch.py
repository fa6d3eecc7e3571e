"""A worker asking for a KV shape no node serves learns which shapes are served (the README's
first failure for a newcomer whose spec did not match `pagedkv up`)."""

from __future__ import annotations

import pytest

from pagedkv.coordinator.core import Coordinator
from pagedkv.coordinator.store import open_store
from pagedkv.protos.errors import Unavailable

SERVED = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 32, "dtype": "float32", "block_size": 16}


def test_unserved_spec_lists_the_served_ones() -> None:
    coordinator = Coordinator(open_store("memory://"))
    coordinator.register("node-0", "127.0.0.1:1", SERVED, 64)
    wanted = {**SERVED, "num_layers": 32, "dtype": "bfloat16"}
    with pytest.raises(Unavailable) as caught:
        coordinator.open("default", list(range(20)), seq_id="s", spec=wanted)
    message = str(caught.value)
    assert f"no live cache node serves model spec {wanted}" in message
    assert f"live nodes serve [{SERVED}]" in message


def test_no_node_at_all_says_so() -> None:
    with pytest.raises(Unavailable, match=r"^no live cache node serves model spec \{[^;]*$"):
        Coordinator(open_store("memory://")).open("default", list(range(20)), seq_id="s", spec=SERVED)
