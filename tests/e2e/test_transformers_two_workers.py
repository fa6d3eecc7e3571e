"""Two worker processes share a system prompt through a real node server (gRPC): the second
process finds the first one's blocks cached, prefills only its suffix and matches recompute."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from hf_helpers import LOGIT_TOL, prompt_ids
from transformers import DynamicCache

from pagedkv.cache_node.engine import CacheEngine, EngineConfig
from pagedkv.cache_node.server import create_server
from pagedkv.client.transformers import GrpcBackend, PagedKVCache, generate_with_prefix_cache, node_spec

WORKER = Path(__file__).with_name("hf_worker.py")
SYSTEM = prompt_ids(20, 50)  # 3 full blocks of 16 + 2 tokens
NEW_TOKENS = 10


def test_second_process_reuses_the_first_ones_prefix(model, ref_model, tmp_path):
    engine = CacheEngine(EngineConfig(node_spec(model.config, 16), 256, device="cpu"))
    server, port = create_server(engine, "127.0.0.1:0")
    server.start()
    address = f"127.0.0.1:{port}"
    try:
        model.save_pretrained(tmp_path)
        kw = {"max_new_tokens": NEW_TOKENS, "do_sample": False}
        # Worker 1: this process.
        first = torch.cat([SYSTEM, prompt_ids(21, 6)])[None]
        with GrpcBackend(address) as backend, PagedKVCache(model, backend) as cache, torch.no_grad():
            _, hit = generate_with_prefix_cache(model, cache, first, **kw)
            assert hit.num_cached_tokens == [0]

        # Worker 2: another Python process, loading the saved model.
        second = torch.cat([SYSTEM, prompt_ids(22, 8)])  # 58 tokens
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        argv = [
            sys.executable,
            str(WORKER),
            address,
            str(tmp_path),
            json.dumps(second.tolist()),
            str(NEW_TOKENS),
        ]
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env)
        assert proc.returncode == 0, proc.stderr[-3000:]
        got = json.loads(proc.stdout.strip().splitlines()[-1])
        assert got["num_cached_tokens"] == [48]
        assert got["fed_lengths"][0] == 58 - 48  # only the suffix was fed to the model

        with torch.no_grad():
            ref = ref_model.generate(
                second[None],
                cache=DynamicCache(config=ref_model.config),
                max_new_tokens=NEW_TOKENS,
                min_new_tokens=NEW_TOKENS,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
            )
        assert got["sequences"] == ref.sequences.tolist()
        err = (torch.tensor(got["logits"]) - torch.stack(ref.logits)).abs().max().item()
        assert err < LOGIT_TOL, err

        stats = engine.stats()
        assert stats["used_blocks"] == 0 and stats["num_sequences"] == 0
        assert stats["cached_blocks"] > 0  # the shared prefix stays cached for the next request
        engine.check_integrity()
    finally:
        server.stop(0)
