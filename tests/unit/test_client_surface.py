"""CacheClient and AsyncCacheClient have one public surface in both modes: a client of one node
and a cluster client answer the same attributes; `control` / `data` (one node's calls) refuse a
cluster client with an error naming what to use instead. Nothing is contacted."""

from __future__ import annotations

import asyncio

import pytest

from pagedkv.client import AsyncCacheClient, CacheClient
from pagedkv.client.control import NodeControl
from pagedkv.client.data import NodeData
from pagedkv.protos.errors import InvalidArgument

ADDRESS = "127.0.0.1:9"  # discard: never dialled by these tests


def public(obj: object) -> set[str]:
    return {name for name in dir(type(obj)) if not name.startswith("_")} | {
        name for name in vars(obj) if not name.startswith("_")
    }


def test_sync_surface_is_the_same_in_both_modes() -> None:
    with CacheClient(ADDRESS) as direct, CacheClient(coordinator=ADDRESS) as cluster:
        assert public(direct) == public(cluster)
        assert {"control", "data", "node", "open", "attend_batch"} <= public(direct)
        assert isinstance(direct.control, NodeControl) and isinstance(direct.data, NodeData)
        assert direct.data is direct.node(ADDRESS).data
        for what in ("control", "data"):
            with pytest.raises(InvalidArgument, match=rf"use client\.node\(address\)\.{what}"):
                getattr(cluster, what)
        assert isinstance(cluster.node(ADDRESS).data, NodeData)


def test_async_surface_is_the_same_in_both_modes() -> None:
    async def body() -> None:
        direct, cluster = AsyncCacheClient(ADDRESS), AsyncCacheClient(coordinator=ADDRESS)
        try:
            assert public(direct) == public(cluster)
            assert direct.data is direct.data  # one face, made once
            assert callable(direct.data.attend)
            with pytest.raises(InvalidArgument, match=r"use client\.node\(address\)\.control"):
                cluster.control  # noqa: B018 - the attribute access is the call under test
        finally:
            await direct.close()
            await cluster.close()

    asyncio.run(body())
