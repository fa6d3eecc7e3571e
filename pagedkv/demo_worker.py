"""One demo worker process: a transformers model (loaded from a local directory)
serving requests whose prompts share system prompts. Each request runs twice --
through the pagedkv cluster (attention on the cache node, the shared prefix
reused) and with transformers' own DynamicCache (full recompute) -- and one
JSON line per request reports tokens and time to first token for both. Before
the first request, untimed, the model runs once and the client opens its
connections to every node (CacheClient.connect), so that neither path's first
request pays the process's one-time set-up.

    python -m pagedkv.demo_worker COORDINATOR MODEL_DIR REQUESTS_JSON NEW_TOKENS
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import torch

from .process_env import freeze_at_exit


class FirstTokenTimer:
    """A generate() streamer that timestamps the first generated token."""

    def __init__(self) -> None:
        self.calls = 0
        self.first_token_s = 0.0
        self.start = time.perf_counter()

    def put(self, value: Any) -> None:
        self.calls += 1
        if self.calls == 2:  # call 1 is the prompt
            self.first_token_s = time.perf_counter() - self.start

    def end(self) -> None:
        pass


def main(coordinator: str, model_dir: str, requests_json: str, new_tokens: str) -> None:
    from transformers import DynamicCache
    from transformers.utils import logging as hf_logging

    from pagedkv.client.config import ClientConfig
    from pagedkv.client.transformers import GrpcBackend, PagedKVCache, generate_with_prefix_cache, load_model
    from pagedkv.protos.tls import TlsConfig

    torch.set_num_threads(1)
    hf_logging.disable_progress_bar()
    model = load_model(model_dir)
    n = int(new_tokens)
    kw = {"max_new_tokens": n, "min_new_tokens": n, "do_sample": False}
    with torch.no_grad():  # untimed: the model's first forward pays one-time set-up, not a path's cost
        model.generate(torch.zeros(1, 8, dtype=torch.long), cache=DynamicCache(config=model.config), **kw)
    # the cluster's PAGEDKV_TLS_* (None: plaintext); workers starting on one system prompt
    # compute it once: the second waits up to 2 s for the first's blocks
    config = ClientConfig(tls=TlsConfig.from_env(), await_in_flight_s=2.0)
    with GrpcBackend(coordinator=coordinator, config=config) as backend:
        backend.client.connect()  # every node's connections opened before the first request, untimed
        for request in json.loads(requests_json):
            ids = torch.tensor(request["prompt"])[None]
            with PagedKVCache(model, backend) as cache, torch.no_grad():
                timer = FirstTokenTimer()
                out, hit = generate_with_prefix_cache(model, cache, ids, streamer=timer, **kw)
                fed = cache.fed_lengths[0]
            with torch.no_grad():
                local = FirstTokenTimer()
                ref = model.generate(ids, cache=DynamicCache(config=model.config), streamer=local, **kw)
            print(
                json.dumps(
                    {
                        "request": request["id"],
                        "system": request["system"],
                        "prompt_tokens": ids.shape[1],
                        "cached_tokens": hit.num_cached_tokens[0],
                        "fed_tokens": fed,
                        "ttft_s": timer.first_token_s,
                        "ttft_local_s": local.first_token_s,
                        "same_tokens": out.tolist() == ref.tolist(),
                    }
                ),
                flush=True,
            )


if __name__ == "__main__":
    freeze_at_exit()  # exits in a fraction of a second, not seconds, with torch loaded
    main(*sys.argv[1:])
