"""The engine is called from a multi-threaded gRPC server: many threads mixing
operations on shared prefixes must leave it consistent and leak nothing."""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch
from engine_helpers import Q_HEADS, SPEC, fill, make_engine

from pagedkv.protos.errors import CapacityExceeded, FailedPrecondition

PREFIXES = [[p] * 12 for p in range(3)]


def worker(engine, wid: int, steps: int, errors: list) -> None:
    rng = random.Random(wid)
    mine: list[str] = []
    z = torch.zeros(1, SPEC.num_kv_heads, SPEC.head_dim)
    try:
        for step in range(steps):
            op = rng.random()
            try:
                if op < 0.3 or not mine:
                    sid = f"w{wid}-{step}"
                    mine.append(sid)  # open succeeds even when the append after it does not
                    fill(engine, sid, rng.choice(PREFIXES) + [wid, step], seed=0)
                elif op < 0.6:
                    sid = rng.choice(mine)
                    for layer in range(SPEC.num_layers):
                        engine.attend_decode(
                            [sid],
                            layer,
                            torch.randn(1, Q_HEADS, SPEC.head_dim),
                            z,
                            z,
                            [1] if layer == 0 else None,
                        )
                elif op < 0.7:
                    child = f"w{wid}-{step}-f"
                    engine.fork(rng.choice(mine), child)
                    mine.append(child)
                elif op < 0.8:
                    sid = rng.choice(mine)
                    if engine.manager.seqs[sid].is_swapped:
                        engine.swap_in(sid)
                    else:
                        engine.swap_out(sid)
                else:
                    engine.free(mine.pop(rng.randrange(len(mine))))
            except (CapacityExceeded, FailedPrecondition):
                pass  # expected under pressure; the engine must stay consistent
        for sid in mine:
            engine.free(sid)
    except Exception as exc:  # noqa: BLE001 - any other error fails the test
        errors.append(exc)


@pytest.mark.parametrize("compute_thread", [False, True], ids=["caller-threads", "compute-thread"])
def test_many_threads_keep_integrity_and_return_every_block(compute_thread: bool):
    engine = make_engine(num_blocks=48, num_host_blocks=16, compute_thread=compute_thread)
    errors: list = []
    threads = [threading.Thread(target=worker, args=(engine, w, 150, errors)) for w in range(8)]
    checker_stop = threading.Event()

    def checker() -> None:
        while not checker_stop.is_set():
            try:
                engine.check_integrity()
            except Exception as exc:  # noqa: BLE001
                errors.append(exc)
                return
            # let a waiting thread take the GIL (a busy loop would hand it over only every
            # 5 ms switch interval: each compute-thread hand-off would wait that long)
            time.sleep(0)

    check_thread = threading.Thread(target=checker)
    check_thread.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    checker_stop.set()
    check_thread.join()
    assert not errors, errors[:3]
    engine.check_integrity()
    stats = engine.stats()
    assert (stats["num_sequences"], stats["used_blocks"], stats["host_used_blocks"]) == (0, 0, 0)
    assert stats["prefix_hit_tokens"] > 0  # the shared prefixes really were shared
    engine.close()
