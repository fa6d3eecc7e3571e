"""Last: once every sequence of the suite is closed, nothing is left behind -- no block
held on any node, no sequence, no quota charged to either tenant -- after every
attack and fuzz case above ran against the same cluster."""

from __future__ import annotations

import re
import time
import urllib.request

from hostile import Secured


def _tenant_used(cluster: Secured) -> dict[str, float]:
    port = cluster.cluster.coordinator_metrics_port
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    found = re.findall(r'pagedkv_coordinator_tenant_used_blocks\{tenant="(\w+)"\} ([0-9.e+]+)', text)
    return {tenant: float(value) for tenant, value in found}


def test_nothing_is_left_behind(secured: Secured) -> None:
    secured.assert_intact()
    assert secured.victim is not None
    secured.victim.seq.close()
    alpha = secured.clients["alpha"]
    deadline = time.monotonic() + 10
    while True:
        counters = [alpha.node_stats(a).counters for a in secured.node_addresses()]
        if all(c["used_blocks"] == 0 and c["num_sequences"] == 0 for c in counters):
            break
        assert time.monotonic() < deadline, counters  # (a close's node Free follows its reply)
        time.sleep(0.1)
    for address in secured.node_addresses():
        alpha.node(address).control.check_integrity()
        assert secured.health(address) == "SERVING"
    assert _tenant_used(secured) == {"alpha": 0.0, "beta": 0.0}
