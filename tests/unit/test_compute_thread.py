"""The node's compute thread: every engine call runs on it, whichever thread makes
the call, with results and errors handed back unchanged; the engine's answers are
the same as without it."""

from __future__ import annotations

import threading

import pytest
import torch
from engine_helpers import (
    Q_HEADS,
    SPEC,
    assert_unchanged,
    dense_attention,
    fill,
    kv_for,
    make_engine,
    snapshot,
)

from pagedkv.cache_node.compute_thread import ComputeThread
from pagedkv.protos.errors import InvalidArgument, SequenceNotFound


def test_call_runs_on_the_thread_and_returns_results_and_errors():
    worker = ComputeThread(name="t-compute")
    try:
        assert worker.call(lambda: threading.current_thread().name) == "t-compute"
        assert worker.call(lambda a, b=0: a + b, 2, b=3) == 5
        with pytest.raises(KeyError, match="missing"):
            worker.call(lambda: {}["missing"])
        # a nested call runs inline (no deadlock), still on the compute thread
        assert worker.call(lambda: worker.call(lambda: threading.current_thread().name)) == "t-compute"
        assert not worker.is_current()
    finally:
        worker.close()
    worker.close()  # idempotent
    assert worker.call(lambda: threading.current_thread().name) == threading.current_thread().name


def test_calls_from_many_threads_run_one_at_a_time_in_order_per_caller():
    worker = ComputeThread()
    seen: list[tuple[int, int]] = []
    running = [0]

    def job(caller: int, i: int) -> None:
        running[0] += 1
        assert running[0] == 1, "two jobs ran at once"
        seen.append((caller, i))
        running[0] -= 1

    def caller(c: int) -> None:
        for i in range(200):
            worker.call(job, c, i)

    callers = [threading.Thread(target=caller, args=(c,)) for c in range(8)]
    for t in callers:
        t.start()
    for t in callers:
        t.join(timeout=60)
    worker.close()
    assert len(seen) == 8 * 200
    for c in range(8):
        assert [i for cc, i in seen if cc == c] == list(range(200))


def test_engine_work_runs_on_its_compute_thread():
    engine = make_engine(compute_thread=True)
    ran_on: list[str] = []
    manager_free = engine.manager.free
    engine.manager.free = lambda sid, keep=None: (  # type: ignore[method-assign]
        ran_on.append(threading.current_thread().name),
        manager_free(sid, keep),
    )[1]
    try:
        assert engine.run(lambda: threading.current_thread().name) == "pagedkv-compute"
        fill(engine, "a", list(range(9)))
        callers = [threading.Thread(target=engine.free, args=("a",))]
        callers[0].start()
        callers[0].join(timeout=30)
        assert ran_on == ["pagedkv-compute"]
        engine.check_integrity()
        assert engine.stats()["num_sequences"] == 0
    finally:
        engine.close()


def test_engine_answers_match_and_errors_leave_it_unchanged():
    plain, threaded = make_engine(), make_engine(compute_thread=True)
    try:
        tokens = list(range(10))
        for engine in (plain, threaded):
            fill(engine, "s", tokens, seed=3)
        q = torch.randn(3, Q_HEADS, SPEC.head_dim, generator=torch.Generator().manual_seed(1))
        outs = [e.attend_prefill("s", 1, q).out for e in (plain, threaded)]
        assert torch.equal(outs[0], outs[1])
        k, v = kv_for(10, 3)
        ref, _ = dense_attention(q, k[1], v[1], first_pos=7)
        torch.testing.assert_close(outs[1].double(), ref, atol=1e-5, rtol=1e-5)
        before = snapshot(threaded)
        with pytest.raises(SequenceNotFound, match="nope"):
            threaded.attend_prefill("nope", 0, q)
        with pytest.raises(InvalidArgument, match="layer"):
            threaded.attend_prefill("s", 9, q)
        assert_unchanged(before, threaded)
    finally:
        threaded.close()
