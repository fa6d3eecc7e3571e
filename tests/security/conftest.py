"""One secured cluster for the whole security suite (starting one is most of its time),
with the victim's sequence open on it and its clients; checked intact after every test."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from hostile import Q_HEADS, SPEC, Secured, Victim, kv, start


@pytest.fixture(scope="session")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Secured]:
    s = start(tmp_path_factory.mktemp("secured"))
    try:
        s.clients = {"alpha": s.client("alpha"), "beta": s.client("beta")}
        prompt = list(range(50_000, 50_000 + 100))  # nobody else's: no prefix shared
        seq = s.clients["alpha"].open("victim", prompt)
        k, v = kv(prompt, seed=1)
        seq.append(prompt, k, v)
        seq.attend(0, torch.zeros(Q_HEADS, SPEC.head_dim))  # its ticket in use on every path
        s.victim = Victim(seq, seq.route.address, seq.route.node_seq_id, seq.route.ticket, k, v)
        yield s
    finally:
        for c in s.clients.values():
            c.close()
        s.cluster.stop()


@pytest.fixture
def cluster(secured: Secured) -> Iterator[Secured]:
    """The secured cluster, checked after the test: the victim intact, no node broken."""
    yield secured
    secured.assert_intact()
