"""The node's compute thread (cache_node/compute.py): a CPU engine's tensor work runs on
one OS thread whatever thread calls it, nested calls run inline, errors come back as
raised, a waiting awaiting_open does not hold the thread, and a forked child gets its own."""

from __future__ import annotations

import multiprocessing as mp
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from pagedkv.cache_node import compute
from pagedkv.cache_node.engine import CacheEngine, EngineConfig
from pagedkv.protos.errors import InvalidArgument, SequenceNotFound
from pagedkv.protos.spec import ModelSpec

SPEC = ModelSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float32", block_size=4)


def test_tensor_work_runs_on_one_thread_whoever_calls(monkeypatch):
    engine = CacheEngine(EngineConfig(SPEC, 64, device="cpu"))
    seen: set[str] = set()
    real = engine.manager.reserve

    def spy(*args, **kwargs):
        seen.add(threading.current_thread().name)
        return real(*args, **kwargs)

    monkeypatch.setattr(engine.manager, "reserve", spy)

    def work(i: int) -> None:
        sid, tokens = f"s{i}", list(range(100 * i, 100 * i + 6))
        engine.open(sid, tokens)
        engine.append(sid, tokens, torch.randn(2, 6, 2, 8), torch.randn(2, 6, 2, 8))
        engine.attend_decode([sid], 1, torch.randn(1, 4, 8))
        engine.free(sid)

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(work, range(16)))
    assert len(seen) == 1 and next(iter(seen)).startswith("pagedkv-compute"), seen
    engine.check_integrity()
    assert engine.stats()["used_blocks"] == 0


def test_nested_calls_run_inline_and_errors_come_back_as_raised():
    depth = []
    assert compute.run(lambda: compute.run(lambda: depth.append(threading.current_thread().name) or 7)) == 7
    assert depth[0].startswith("pagedkv-compute")
    engine = CacheEngine(EngineConfig(SPEC, 64, device="cpu"))
    with pytest.raises(SequenceNotFound):
        engine.attend_decode(["nobody"], 0, torch.randn(1, 4, 8))
    with pytest.raises(InvalidArgument, match="layer 5 out of range"):
        engine.open("x", [1, 2, 3])
        engine.attend_decode(["x"], 5, torch.randn(1, 4, 8))
    engine.free("x")
    engine.check_integrity()


def test_a_data_call_waiting_for_its_open_does_not_hold_the_compute_thread():
    """awaiting_open waits on the caller's thread: the Open it waits for still gets
    through the compute thread (a wait there would deadlock until the grace ran out)."""
    engine = CacheEngine(EngineConfig(SPEC, 64, device="cpu", unknown_seq_grace_s=10.0))
    result: list[object] = []
    waiter = threading.Thread(
        target=lambda: result.append(engine.awaiting_open(lambda: engine.sequence_length("late")))
    )
    waiter.start()
    opener = threading.Timer(0.2, lambda: engine.open("late", [1, 2, 3]))
    opener.start()
    waiter.join(5)
    assert result == [0]
    engine.free("late")
    engine.check_integrity()


def _child(queue) -> None:
    engine = CacheEngine(EngineConfig(SPEC, 16, device="cpu"))
    engine.open("c", [1, 2])
    queue.put(engine.stats()["num_sequences"])


def test_a_forked_child_gets_its_own_compute_thread():
    compute.run(lambda: None)  # the parent's thread exists before the fork
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_child, args=(queue,))
    child.start()
    assert queue.get(timeout=20) == 1
    child.join(20)
    assert child.exitcode == 0
