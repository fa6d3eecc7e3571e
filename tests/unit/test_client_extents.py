"""The client's pieces for sharded sequences (client/extents.py), against float64 dense attention."""

from __future__ import annotations

import math
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from pagedkv.client.extents import Then, exchange, merge, narrow, run_parallel, widen
from pagedkv.client.types import AttentionResult


def dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> AttentionResult:
    """q [n, Hq, D] over every key of k, v [L, Hk, D] (no mask), float64."""
    group = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    scores = torch.einsum("nhd,lhd->nhl", q.double(), k) / math.sqrt(q.shape[-1])
    return AttentionResult(torch.einsum("nhl,lhd->nhd", scores.softmax(-1), v), scores.logsumexp(-1))


@pytest.mark.parametrize(("n", "q_heads", "kv_heads"), [(1, 4, 4), (5, 8, 2), (3, 6, 1)])
def test_widened_queries_keep_their_kv_head(n, q_heads, kv_heads):
    """A decode row of n * Hq heads over the keys is the n queries' full attention, once narrowed."""
    g = torch.Generator().manual_seed(n)
    q = torch.randn(n, q_heads, 8, generator=g)
    k, v = torch.randn(11, kv_heads, 8, generator=g), torch.randn(11, kv_heads, 8, generator=g)
    wide = widen(q, kv_heads)
    assert wide.shape == (1, n * q_heads, 8)
    row = dense(wide[0][None].reshape(1, n * q_heads, 8), k, v)  # the node's decode of one row
    got = narrow(AttentionResult(row.out, row.lse), n, kv_heads)
    want = dense(q, k, v)
    torch.testing.assert_close(got.out, want.out)
    torch.testing.assert_close(got.lse, want.lse)


def test_merge_of_disjoint_key_sets_is_attention_over_all_of_them():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 8, generator=g)
    k, v = torch.randn(20, 2, 8, generator=g), torch.randn(20, 2, 8, generator=g)
    parts = [dense(q, k[a:b], v[a:b]) for a, b in [(0, 7), (7, 8), (8, 20)]]
    got = merge(parts)
    want = dense(q, k, v)
    torch.testing.assert_close(got.out.double(), want.out)
    torch.testing.assert_close(got.lse.double(), want.lse)
    assert got.block_mass is None


def test_merged_block_mass_is_rescaled_to_the_whole_softmax():
    """One head: each part's mass (its own softmax, summing to 1) scaled by its share."""
    lses = [torch.tensor([[0.0]]), torch.tensor([[math.log(3.0)]])]  # shares 1/4 and 3/4
    parts = [
        AttentionResult(torch.zeros(1, 1, 2), lses[0], torch.tensor([[0.5, 0.5]])),
        AttentionResult(torch.zeros(1, 1, 2), lses[1], torch.tensor([[1.0]])),
    ]
    mass = merge(parts).block_mass
    assert mass is not None
    torch.testing.assert_close(mass, torch.tensor([[0.125, 0.125, 0.75]]))


def test_run_parallel_runs_at_once_keeps_order_and_raises_the_first_error():
    barrier = threading.Barrier(3, timeout=30)  # only passes if all three run at the same time
    with ThreadPoolExecutor(4) as pool:
        assert run_parallel(pool, [lambda i=i: (barrier.wait(), i)[1] for i in range(3)]) == [0, 1, 2]

        def fail(msg: str) -> int:
            raise ValueError(msg)

        done = []
        with pytest.raises(ValueError, match="second"):
            run_parallel(pool, [lambda: done.append(1), lambda: fail("second"), lambda: fail("third")])
        assert done == [1]


class Pending:
    """A Reply that logs when it was sent and read."""

    def __init__(self, log: list[str], name: str, error: Exception | None = None) -> None:
        self.log, self.name, self.error = log, name, error
        log.append(f"send {name}")

    def result(self) -> str:
        self.log.append(f"read {self.name}")
        if self.error is not None:
            raise self.error
        return self.name


def test_exchange_sends_every_request_before_reading_any_reply_the_last_sent_first():
    log: list[str] = []
    assert exchange([lambda n=n: Pending(log, n) for n in "abc"]) == ["a", "b", "c"]
    assert log == ["send a", "send b", "send c", "read c", "read b", "read a"]
    assert exchange([lambda: Then(Pending(log, "d"), str.upper)]) == ["D"]  # type: ignore[arg-type]


def test_exchange_reads_every_sent_reply_and_raises_the_first_error_in_call_order():
    log: list[str] = []

    def refused(name: str) -> Pending:
        log.append(f"refused {name}")
        raise ValueError(name)

    # a send that fails stops the later ones; the replies already out are still read
    with pytest.raises(ValueError, match="b"):
        exchange([lambda: Pending(log, "a"), lambda: refused("b"), lambda: Pending(log, "c")])
    assert log == ["send a", "refused b", "read a"]
    log.clear()
    # an earlier reply's error comes before a later send's
    with pytest.raises(KeyError, match="a"):
        exchange([lambda: Pending(log, "a", KeyError("a")), lambda: refused("b")])
    assert log == ["send a", "refused b", "read a"]
    log.clear()
    with pytest.raises(KeyError, match="b"):  # every reply read, the first failure in call order raised
        exchange(
            [
                lambda n=n, e=e: Pending(log, n, e)
                for n, e in (("a", None), ("b", KeyError("b")), ("c", KeyError("c")))
            ]
        )
    assert log == ["send a", "send b", "send c", "read c", "read b", "read a"]
