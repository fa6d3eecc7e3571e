"""Two coordinator processes extending one sequence at once (issue 20): a real cluster
(redis-server, three `pagedkv node` processes, a coordinator) plus a second coordinator
process on the same Redis; one worker's client talks to each. Both Extend the same
sequence at the same token at the same moment: the page table's compare-and-set lets one
write its extent and open it on its node, and the other answers with that extent. No node
holds an extent the page table does not list (an orphan), and both handles attend alike."""

from __future__ import annotations

import threading

import torch
from conftest import TOKENS, tenants_file

from pagedkv.client import CacheClient
from pagedkv.cluster import LocalCluster, NodeOptions, free_port
from pagedkv.protos.spec import ModelSpec

NODE = NodeOptions(num_layers=2, num_kv_heads=2, head_dim=16, block_size=4, num_blocks=64, host_blocks=0)
SPEC = ModelSpec(2, 2, 16, "float32", 4)
ROUNDS = 8


def start_second_coordinator(cluster: LocalCluster) -> str:
    address = f"{cluster.host}:{free_port(cluster.host)}"
    args = ["coordinator", f"--listen={address}", f"--lease-ttl-s={cluster.lease_ttl_s}"]
    args += [f"--redis={cluster.redis_url}", f"--tenants={cluster.tenants_file}"]
    cluster._pagedkv("coordinator-2", args)
    cluster._wait_healthy("coordinator-2", address)
    return address


def test_two_coordinators_extending_one_sequence_make_one_extent(tmp_path, redis_url):
    cluster = LocalCluster(
        3, NODE, redis_url=redis_url, log_dir=str(tmp_path), tenants_file=tenants_file(tmp_path)
    )
    with cluster:
        second = start_second_coordinator(cluster)
        with (
            CacheClient(coordinator=cluster.coordinator_address, token=TOKENS["alpha"], spec=SPEC) as one,
            CacheClient(coordinator=second, token=TOKENS["alpha"], spec=SPEC) as two,
        ):
            g = torch.Generator().manual_seed(0)
            seqs = []
            for i in range(ROUNDS):
                a = one.open(f"race-{i}", [1])
                k, v = torch.randn(2, 2, 8, 2, 16, generator=g)
                a.append(list(range(8)), k, v)
                b = two.sequence(f"race-{i}")
                b.num_tokens = a.num_tokens  # (a handle found by id learns it at its first append)
                start = threading.Barrier(2)
                errors: list[BaseException] = []

                def extend(seq, start=start, errors=errors) -> None:
                    start.wait()
                    try:
                        seq.extend()
                    except BaseException as exc:  # noqa: BLE001 - asserted below
                        errors.append(exc)

                threads = [threading.Thread(target=extend, args=(s,)) for s in (a, b)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                assert errors == []
                assert len(a.extents) == 2 and a.extents == b.extents  # both answered with one extent
                assert a.extents[1].first_token == 8
                b.num_tokens = None  # the other worker appends from here: unknown to this handle
                seqs.append((a, b))
            held = sum(one.node_stats(addr).counters["num_sequences"] for addr in cluster.node_addresses)
            assert held == 2 * ROUNDS  # every extent listed, none orphaned
            for a, b in seqs:  # the new tail takes appends from one worker, the other attends over both
                k, v = torch.randn(2, 2, 1, 2, 16, generator=g)
                a.append([9], k, v)
                q = torch.randn(4, 16, generator=g)
                torch.testing.assert_close(b.attend(1, q).out, a.attend(1, q).out, rtol=0, atol=0)
            one.check_integrity()
            for a, _ in seqs:
                a.close()
