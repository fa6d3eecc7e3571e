"""LocalCluster's ports: one it picked free but found taken when its process started (another
connection's ephemeral port in between) is picked again; one the caller gave is not."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
from conftest import make_cluster

from pagedkv import cluster as cluster_module
from pagedkv.cluster import PortTaken


def test_a_picked_port_taken_before_the_bind_is_picked_again(
    tmp_path: Path, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        real = cluster_module.free_port
        picks = iter([taken, taken, taken])  # the coordinator's, its metrics', the first node's
        monkeypatch.setattr(
            cluster_module, "free_port", lambda host="127.0.0.1": next(picks, None) or real(host)
        )
        with make_cluster(tmp_path, redis_url=redis_url, num_nodes=1) as cluster:
            assert len(cluster.stats().nodes) == 1
            ports = [int(cluster.coordinator_address.rsplit(":", 1)[1]), cluster.coordinator_metrics_port]
            ports += [int(cluster.node_addresses[0].rsplit(":", 1)[1]), cluster.node_metrics_ports[0]]
            assert taken not in ports


def test_a_port_the_caller_gave_that_is_taken_fails_with_the_reason(tmp_path: Path, redis_url: str) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        local = make_cluster(tmp_path, redis_url=redis_url, num_nodes=1)
        local.coordinator_metrics_port = held.getsockname()[1]
        with pytest.raises(PortTaken, match="already in use"):
            local.start()
        local.stop()
