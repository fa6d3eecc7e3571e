"""A turn's opens placed together (Coordinator.open_many: one pipelined round trip on Redis)
land where the same opens one after the other would: each open's script weighs what the
batch's earlier opens placed, and a longer shortlist the later it comes, so a burst of cold
prompts spreads over the nodes instead of piling onto the one that looked emptiest when the
batch began. On every store; below and above shortlist.WEIGH_ALL candidates."""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Iterator

import pytest

from pagedkv.coordinator.core import Coordinator, CoordinatorConfig, OpenArgs
from pagedkv.coordinator.shortlist import WEIGH_ALL
from pagedkv.coordinator.store import open_store

pytestmark = pytest.mark.timeout(120)
SPEC = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 8, "dtype": "float32", "block_size": 16}


@pytest.fixture(params=["memory", "redis", "cluster"])
def url(request: pytest.FixtureRequest) -> Iterator[str]:
    fixtures = {"redis": "redis_url", "cluster": "redis_cluster_url"}
    yield "memory://" if request.param == "memory" else str(request.getfixturevalue(fixtures[request.param]))


@pytest.mark.parametrize("num_nodes", [4, WEIGH_ALL + 24])
def test_a_batch_of_cold_opens_spreads_as_one_by_one(url: str, num_nodes: int) -> None:
    coordinator = Coordinator(open_store(url), CoordinatorConfig(lease_ttl_s=30))
    try:
        for i in range(num_nodes):
            coordinator.register(f"n{i:02d}", "127.0.0.1:1", SPEC, 100_000, 1)
        rnd = random.Random(num_nodes)
        spread = {}
        for way in ("one by one", "together"):
            worst = []
            for r in range(6):
                opens = [
                    OpenArgs(
                        "t",
                        [rnd.randrange(1, 30_000) for _ in range(256)],
                        f"{way[0]}{r}-{k}",
                        worker_opens=True,
                    )
                    for k in range(8)
                ]
                if way == "together":
                    placed = coordinator.open_many(opens)
                else:
                    placed = [
                        coordinator.open(o.tenant, o.token_ids, seq_id=o.seq_id, worker_opens=True)
                        for o in opens
                    ]
                per_node = Counter(p.node_id for p in placed)  # type: ignore[union-attr]
                worst.append((max(per_node.values()), len(per_node)))
            spread[way] = worst
        fair = (math.ceil(8 / num_nodes), min(8, num_nodes))
        assert spread["one by one"] == [fair] * 6  # the reference: each open sees the last
        assert spread["together"] == [fair] * 6
    finally:
        coordinator.stop()
        coordinator.store.close()
