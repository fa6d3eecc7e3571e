"""The asyncio client over a real server: the same rpcs and checks as the sync suite."""

from __future__ import annotations

import asyncio

import pytest
import torch
from kvref import SPEC, assert_attention, rand_kv, rand_q

from pagedkv.client import (
    AsyncCacheClient,
    CapacityExceeded,
    ClientConfig,
    FailedPrecondition,
    InvalidArgument,
    SequenceNotFound,
)


def test_async_every_rpc(node) -> None:
    async def scenario() -> None:
        async with AsyncCacheClient(node.address, ClientConfig(chunk_bytes=777)) as client:
            await client.ping()
            assert (await client.stats()).spec == SPEC
            prompt = list(range(10))
            k, v = rand_kv(10, seed=1)
            async with client.open("a", prompt) as seq:
                assert await seq.append(prompt, k, v) == 10
                assert await client.lookup(prompt) == 8
                k1, v1 = rand_kv(1, seed=2)
                for layer in range(SPEC.num_layers):
                    q = rand_q(1, seed=3 + layer)
                    res = await seq.attend(layer, q, k1[layer], v1[layer], 5 if layer == 0 else None)
                    assert_attention(
                        res, q, torch.cat([k[layer], k1[layer]]), torch.cat([v[layer], v1[layer]])
                    )
                rk, rv = await seq.read_kv()  # 11 tokens in 777-byte chunks
                assert torch.equal(rk, torch.cat([k, k1], 1)) and torch.equal(rv, torch.cat([v, v1], 1))
                # fork + copy-on-write
                child = await seq.fork("child")
                kc, vc = rand_kv(1, seed=4)
                await child.append([9], kc, vc)
                assert (await client.stats()).counters["cow_copies"] == 1
                assert torch.equal((await seq.read_kv())[0], rk)
                res = await client.attend_batch([seq, child], 1, rand_q(2, seed=5))
                assert res.out.shape == (2, 4, SPEC.head_dim)
                await child.close()
                # swap
                assert await seq.swap_out() == 3
                with pytest.raises(FailedPrecondition):
                    await seq.read_kv()
                await seq.swap_in()
                assert torch.equal((await seq.read_kv())[1], rv)
                # pins, budgets
                assert await client.pin(prompt) == 8
                assert await client.unpin(prompt) == 8
                await seq.set_budget(None)
                await client.check_integrity()
                # errors come back as the same classes
                with pytest.raises(InvalidArgument, match="dtype"):
                    await seq.attend(1, rand_q(1, 1).double())
                with pytest.raises(SequenceNotFound):
                    await (await client.sequence("nope")).swap_out()
                with pytest.raises(CapacityExceeded):
                    await seq.append(list(range(1000)), *rand_kv(1000, 1))
            counters = (await client.stats()).counters
            assert counters["used_blocks"] == 0 and counters["num_sequences"] == 0
            await client.check_integrity()

    asyncio.run(scenario())
    assert node.health() == "SERVING"


def test_async_concurrent_sequences(node) -> None:
    async def one(client: AsyncCacheClient, i: int) -> None:
        toks = list(range(i, i + 12))
        seq = await client.open(f"c{i}", toks)
        await seq.append(
            toks[seq.num_cached_tokens :], *(t[:, seq.num_cached_tokens :] for t in rand_kv(12, i))
        )
        await seq.attend(0, rand_q(1, i))
        await seq.close()

    async def scenario() -> None:
        async with AsyncCacheClient(node.address) as client:
            await asyncio.gather(*(one(client, i) for i in range(16)))
            await client.check_integrity()
            assert (await client.stats()).counters["used_blocks"] == 0

    asyncio.run(scenario())
