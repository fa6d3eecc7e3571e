"""A separate worker process for the cross-process prefix test: load the model saved by the test,
talk gRPC to the node, generate with prefix reuse, print the results as one JSON line.

    python tests/e2e/hf_worker.py ADDRESS MODEL_DIR TOKEN_IDS_JSON NEW_TOKENS

ADDRESS is a node's host:port, or coordinator=host:port for a cluster.
"""

from __future__ import annotations

import json
import sys

import torch

from pagedkv.client.transformers import GrpcBackend, PagedKVCache, generate_with_prefix_cache, load_model
from pagedkv.process_env import freeze_at_exit


def main(address: str, model_dir: str, token_ids: str, new_tokens: str) -> None:
    torch.set_num_threads(1)
    model = load_model(model_dir)
    ids = torch.tensor(json.loads(token_ids))[None]
    n = int(new_tokens)
    if address.startswith("coordinator="):
        backend = GrpcBackend(coordinator=address.removeprefix("coordinator="))
    else:
        backend = GrpcBackend(address)
    with backend, PagedKVCache(model, backend) as cache, torch.no_grad():
        out, hit = generate_with_prefix_cache(
            model,
            cache,
            ids,
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
        fed = cache.fed_lengths
    print(
        json.dumps(
            {
                "num_cached_tokens": hit.num_cached_tokens,
                "fed_lengths": fed,
                "sequences": out.sequences.tolist(),
                "logits": torch.stack(out.logits).tolist(),
            }
        )
    )


if __name__ == "__main__":
    freeze_at_exit()  # exits in a fraction of a second, not seconds, with torch loaded
    main(*sys.argv[1:])
