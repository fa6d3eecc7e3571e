"""A cache over a node that names its model refuses a model of the same shape with another
name (its config's name_or_path), naming both and the fix; the named model runs."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from pagedkv.cache_node.engine import CacheEngine, EngineConfig
from pagedkv.client.transformers import EngineBackend, PagedKVCache, node_spec
from pagedkv.protos.errors import SpecMismatch


def test_a_node_of_another_model_is_refused(model) -> None:
    spec = replace(node_spec(model.config, 16), model="org/tuned@1")
    engine = CacheEngine(EngineConfig(spec, 64, device="cpu"))
    backend = EngineBackend(engine)
    assert not model.config._name_or_path  # a model built from a config is not named
    with pytest.raises(SpecMismatch, match=r"serves the KV of model 'org/tuned@1'.*--model-id"):
        PagedKVCache(model, backend)
    model.config._name_or_path = "org/base@1"
    try:
        with pytest.raises(SpecMismatch, match="this model is 'org/base@1'"):
            PagedKVCache(model, backend)
        model.config._name_or_path = "org/tuned@1"
        with PagedKVCache(model, backend) as cache, torch.no_grad():
            model(torch.arange(20)[None], cache=cache)
            assert cache.get_seq_length() == 20
    finally:
        model.config._name_or_path = ""
    assert engine.stats()["used_blocks"] == 0 and engine.stats()["num_sequences"] == 0
