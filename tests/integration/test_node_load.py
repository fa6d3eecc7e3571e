"""Concurrency and metrics: many client threads on shared prefixes, then /metrics."""

from __future__ import annotations

import random
import shutil
import subprocess
import threading
import time
import urllib.request

import pytest
from kvref import rand_kv, rand_q

from pagedkv.client import CacheClient, CapacityExceeded

PREFIXES = [list(range(1000 * p, 1000 * p + 16)) for p in range(3)]  # 4 full blocks each


def _worker(address: str, wid: int, stop_at: float, errors: list[BaseException], counts: dict) -> None:
    rng = random.Random(wid)
    with CacheClient(address) as client:
        i = 0
        while time.monotonic() < stop_at:
            i += 1
            prompt = rng.choice(PREFIXES) + [rng.randrange(10**6) for _ in range(rng.randrange(1, 9))]
            try:
                with client.open(f"w{wid}-{i}", prompt) as seq:
                    cached = seq.num_cached_tokens
                    k, v = rand_kv(len(prompt), seed=wid * 1000 + i)
                    seq.append(prompt[cached:], k[:, cached:], v[:, cached:])
                    op = rng.randrange(4)
                    if op == 0:
                        with seq.fork(f"w{wid}-{i}-child") as child:
                            child.attend(0, rand_q(1, i)[0], k[0, :1, :, :][0], v[0, :1][0], token_id=7)
                    elif op == 1:
                        seq.swap_out()
                        seq.swap_in()
                    elif op == 2:
                        seq.read_kv()
                    else:
                        client.lookup(prompt)
                    seq.attend(1, rand_q(1, i)[0])
                counts["ok"] += 1
            except CapacityExceeded:
                counts["exhausted"] += 1
            except BaseException as exc:  # noqa: BLE001 - collected and asserted on below
                errors.append(exc)
                return


def test_sixteen_threads_mixed_operations_on_shared_prefixes(make_node) -> None:
    node = make_node(num_blocks=48, num_host_blocks=24)
    errors: list[BaseException] = []
    counts = {"ok": 0, "exhausted": 0}
    stop_at = time.monotonic() + 3.0
    threads = [
        threading.Thread(target=_worker, args=(node.address, w, stop_at, errors, counts)) for w in range(16)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not errors, errors[:3]
    assert counts["ok"] > 16
    with CacheClient(node.address) as client:
        client.check_integrity()
        c = client.stats().counters
        assert c["used_blocks"] == 0 and c["num_sequences"] == 0 and c["host_used_blocks"] == 0
        assert c["prefix_hit_tokens"] > 0
    assert node.health() == "SERVING"


def _scrape(node) -> str:
    http, _thread = node.metrics.serve(0, "127.0.0.1")
    try:
        port = http.server_address[1]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
            return resp.read().decode()
    finally:
        http.shutdown()
        http.server_close()


def test_metrics_after_a_workload(make_node, tmp_path) -> None:
    node = make_node(num_blocks=8, num_host_blocks=4, policy="lfu")
    with CacheClient(node.address) as client:
        prompt = list(range(12))
        with client.open("a", prompt) as seq:
            seq.append(prompt, *rand_kv(12, 1))
            seq.swap_out()
            seq.swap_in()
        with client.open("b", prompt) as seq:  # 8 tokens hit (max_cached = len - 1 -> 2 blocks)
            seq.append(prompt[8:], *(t[:, 8:] for t in rand_kv(12, 1)))
            with pytest.raises(CapacityExceeded):
                seq.append(list(range(100, 132)), *rand_kv(32, 2))
        for i in range(3):  # evict: 3 x 3 blocks into an 8-block pool, host tier 4
            toks = list(range(100 * (i + 1), 100 * (i + 1) + 12))
            with client.open(f"e{i}", toks) as seq:
                seq.append(toks, *rand_kv(12, i))
        stats = client.stats().counters
    text = _scrape(node)
    get = node.metrics.registry.get_sample_value
    assert get("pagedkv_prefix_cache_queries_tokens_total") == 12 + 12 + 3 * 12
    assert get("pagedkv_prefix_cache_hits_tokens_total") == 8
    assert get("pagedkv_swaps_total", {"direction": "out"}) == 3
    assert get("pagedkv_swaps_total", {"direction": "in"}) == stats["swap_in_blocks"]
    assert get("pagedkv_blocks", {"state": "used"}) == 0
    assert get("pagedkv_blocks", {"state": "cached"}) == stats["cached_blocks"]
    assert get("pagedkv_kv_usage_ratio") == 0.0
    assert get("pagedkv_sequences") == 0
    assert (
        get("pagedkv_evictions_total", {"policy": "lfu", "tier": "device_to_host"})
        == stats["evicted_to_host"]
    )
    assert stats["evicted_to_host"] > 0
    assert get("pagedkv_rpc_errors_total", {"method": "Append", "code": "RESOURCE_EXHAUSTED"}) == 1
    assert get("pagedkv_rpc_latency_seconds_count", {"method": "Open"}) == 5
    assert 'pagedkv_blocks{state="host_cached"}' in text
    assert "# TYPE pagedkv_rpc_latency_seconds histogram" in text

    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not on PATH (apt-get install prometheus) - exposition format unchecked")
    result = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
