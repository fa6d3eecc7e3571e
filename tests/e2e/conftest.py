"""Fixtures for the transformers end-to-end tests: one random Llama (no download), a pure-sdpa
twin with the same weights as the reference, and fresh in-process engines per test."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch

pytest.importorskip("transformers")

from transformers import LlamaForCausalLM  # noqa: E402

from pagedkv.cache_node.engine import CacheEngine, EngineConfig  # noqa: E402
from pagedkv.client.transformers import EngineBackend, demo_model, node_spec  # noqa: E402

torch.set_num_threads(2)


@pytest.fixture(scope="session")
def model() -> LlamaForCausalLM:
    return demo_model(seed=0)[0]


@pytest.fixture(scope="session")
def ref_model(model: LlamaForCausalLM) -> LlamaForCausalLM:
    """The same weights under transformers' own sdpa attention: the reference."""
    config = model.config.__class__.from_dict(model.config.to_dict())
    config._attn_implementation = "sdpa"
    ref = LlamaForCausalLM(config).eval()
    ref.load_state_dict(model.state_dict())
    return ref


@pytest.fixture
def make_backend(model: LlamaForCausalLM) -> Iterator[Callable[..., EngineBackend]]:
    """Fresh in-process engines; each is checked clean (no used blocks, integrity) at teardown."""
    engines: list[CacheEngine] = []

    def make(block_size: int = 16, num_blocks: int = 512) -> EngineBackend:
        engine = CacheEngine(EngineConfig(node_spec(model.config, block_size), num_blocks, device="cpu"))
        engines.append(engine)
        return EngineBackend(engine)

    yield make
    for engine in engines:
        engine.check_integrity()
        assert engine.stats()["used_blocks"] == 0
        assert engine.stats()["num_sequences"] == 0
