"""Prefix reuse across two worker processes through a real cluster: redis-server,
a coordinator and two cache nodes as processes; each worker is its own Python
process running a transformers model whose attention runs on the node the
coordinator placed its sequence on."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
from hf_helpers import LOGIT_TOL, prompt_ids
from transformers import DynamicCache

from pagedkv.client import CacheClient
from pagedkv.client.transformers import node_spec
from pagedkv.cluster import LocalCluster, NodeOptions

WORKER = Path(__file__).with_name("hf_worker.py")
SYSTEM = prompt_ids(30, 50)  # 3 full blocks of 16 + 2 tokens
NEW_TOKENS = 8


def run_worker(coordinator: str, model_dir: Path, ids: torch.Tensor) -> dict:
    ids_json = json.dumps(ids.tolist())
    where = f"coordinator={coordinator}"
    argv = [sys.executable, str(WORKER), where, str(model_dir), ids_json, str(NEW_TOKENS)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=180, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_second_worker_prefills_only_its_suffix_through_the_cluster(model, ref_model, tmp_path):
    spec = node_spec(model.config, 16)
    model.save_pretrained(tmp_path / "model")
    options = NodeOptions(
        spec.num_layers,
        spec.num_kv_heads,
        spec.head_dim,
        spec.dtype,
        spec.block_size,
        num_blocks=256,
        host_blocks=0,
    )
    with LocalCluster(2, options, log_dir=str(tmp_path)) as cluster:
        model_dir = tmp_path / "model"
        first = run_worker(cluster.coordinator_address, model_dir, torch.cat([SYSTEM, prompt_ids(31, 6)]))
        assert first["num_cached_tokens"] == [0]
        second_ids = torch.cat([SYSTEM, prompt_ids(32, 8)])  # 58 tokens
        time.sleep(0.3)  # the node reports stored blocks to the coordinator within ~10 ms
        second = run_worker(cluster.coordinator_address, model_dir, second_ids)
        assert second["num_cached_tokens"] == [48]
        assert second["fed_lengths"][0] == 58 - 48  # only the suffix went through the model

        with torch.no_grad():
            ref = ref_model.generate(
                second_ids[None],
                cache=DynamicCache(config=ref_model.config),
                max_new_tokens=NEW_TOKENS,
                min_new_tokens=NEW_TOKENS,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
            )
        assert second["sequences"] == ref.sequences.tolist()
        err = (torch.tensor(second["logits"]) - torch.stack(ref.logits)).abs().max().item()
        assert err < LOGIT_TOL, err

        with CacheClient(coordinator=cluster.coordinator_address) as client:
            client.check_integrity()
            for node in client.cluster_stats().nodes:
                # A close answers before the coordinator's node Free lands: await it, bounded.
                deadline = time.monotonic() + 5.0
                counters = client.node_stats(node.address).counters
                while counters["num_sequences"] and time.monotonic() < deadline:
                    time.sleep(0.05)
                    counters = client.node_stats(node.address).counters
                assert counters["used_blocks"] == 0 and counters["num_sequences"] == 0
