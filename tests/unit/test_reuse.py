"""ReuseClasses (coordinator/reuse.py): which sizes of uncached run are scans, learned from
whether later opens continue them. Scenarios with exact masks, and the positional lookup of
marks checked against a lookup of every cached key; no store, no network."""

from __future__ import annotations

import random
from collections import OrderedDict

import pytest

from pagedkv.coordinator.reuse import ReuseClasses, ReuseConfig
from pagedkv.protos.errors import InvalidArgument


def key(i: int) -> bytes:
    return i.to_bytes(16, "big")


def chain(*ids: int) -> bytes:
    """A prompt's packed keys: key(ids[0]) at block 0, key(ids[1]) at block 1, ..."""
    return b"".join(key(i) for i in ids)


def chat_with_documents(classes: ReuseClasses, rounds: int, start: int = 0) -> None:
    """Each round: a 20-block chat turn that the next round's turn continues (the conversation's
    earlier turns are its cached prefix), and a 200-block document nobody asks for again."""
    for r in range(start, start + rounds):
        turns = [2 * t for t in range(start, r + 1)]
        classes.observe(chain(*turns), len(turns) - 1, 20)  # class 5 (16-31 blocks)
        classes.observe(chain(2 * r + 1), 0, 200)  # class 8 (128-255 blocks)


def test_long_runs_nobody_continues_become_a_scan_class() -> None:
    classes = ReuseClasses(ReuseConfig(min_opens=8))
    chat_with_documents(classes, 40)
    assert classes.scan_classes() == 1 << 8
    opens, reuses = classes.stats()[5]
    assert reuses > 0.9 * opens * 39 / 40  # every turn but the last was continued


def test_short_one_shot_runs_are_never_scans() -> None:
    # Long runs that are continued (an agent's growing context) and short ones nobody continues:
    # the short ones are rarely reused but not long enough to flush a cache, so no scan class.
    classes = ReuseClasses(ReuseConfig(min_opens=8))
    for r in range(60):
        classes.observe(chain(*range(1000, 1001 + r)), r, 500)
        classes.observe(chain(r), 0, 3)
    assert classes.scan_classes() == 0


def test_a_class_needs_min_opens_before_it_is_a_scan() -> None:
    classes = ReuseClasses(ReuseConfig(min_opens=32))
    chat_with_documents(classes, 20)
    assert classes.scan_classes() == 0
    chat_with_documents(classes, 20, start=20)
    assert classes.scan_classes() == 1 << 8


def test_counts_decay_so_a_change_of_workload_is_followed() -> None:
    classes = ReuseClasses(ReuseConfig(min_opens=8, half_life_opens=16))
    chat_with_documents(classes, 40)
    assert classes.scan_classes() == 1 << 8
    # Now the 200-block runs are continued every time: within a few half-lives no scan class.
    for r in range(160):
        classes.observe(chain(*range(5000, 5001 + r)), r, 200)
        classes.observe(chain(*range(9000, 9001 + r)), r, 20)
    assert classes.scan_classes() == 0


def test_memory_is_bounded_and_forgets_the_oldest_runs() -> None:
    classes = ReuseClasses(ReuseConfig(memory=4))
    for i in range(10):
        classes.observe(chain(i), 0, 100)
    classes.observe(chain(0), 1, 0)  # key 0 was forgotten
    classes.observe(chain(9), 1, 0)  # key 9 was not
    assert sum(r for _, r in classes.stats().values()) == pytest.approx(1.0, rel=0.01)


class EveryKey:
    """The reference: each cached key looked up, wherever marks lie."""

    def __init__(self, memory: int) -> None:
        self.memory = memory
        self.marks: OrderedDict[bytes, int] = OrderedDict()
        self.reused: list[int] = []

    def observe(self, keys: bytes, cached: int, cls: int) -> None:
        for p in range(cached):
            if (c := self.marks.pop(keys[16 * p : 16 * p + 16], None)) is not None:
                self.reused.append(c)
        first = keys[16 * cached : 16 * cached + 16]
        if first:
            self.marks[first] = cls
            self.marks.move_to_end(first)
            if len(self.marks) > self.memory:
                self.marks.popitem(last=False)


@pytest.mark.parametrize("seed", range(4))
def test_marks_found_by_position_as_by_every_cached_key(seed: int) -> None:
    """Random prompts sharing prefixes of a few trees (chain keys: a key names its position),
    random cached lengths, a small memory: the same runs counted reused as a lookup of every
    cached key counts, whether the marked positions are fewer than the cached blocks or not."""
    rnd = random.Random(seed)
    memory = rnd.choice([3, 8, 64])
    classes, reference = ReuseClasses(ReuseConfig(memory=memory, half_life_opens=1e9)), EveryKey(memory)
    trees = [[rnd.randrange(1 << 60) for _ in range(40)] for _ in range(3)]
    for _ in range(600):
        tree = rnd.choice(trees)
        length = rnd.randrange(1, 40)
        ids = tree[:length] if rnd.random() < 0.8 else [rnd.randrange(1 << 60) for _ in range(length)]
        cached = rnd.randrange(0, length + 1)
        run = 1 << rnd.randrange(0, 8)  # its class: run.bit_length()
        classes.observe(chain(*ids), cached, run)
        reference.observe(chain(*ids), cached, run.bit_length())
    reuses = {c: round(r) for c, (_, r) in classes.stats().items() if round(r)}
    expected: dict[int, int] = {}
    for c in reference.reused:
        expected[c] = expected.get(c, 0) + 1
    assert reuses == expected and sum(expected.values()) > 10


def test_bad_config_is_invalid_argument() -> None:
    with pytest.raises(InvalidArgument, match="half_life_opens"):
        ReuseConfig(half_life_opens=0)
    with pytest.raises(InvalidArgument, match="scan_ratio"):
        ReuseConfig(scan_ratio=-1)
    with pytest.raises(InvalidArgument, match="memory"):
        ReuseConfig(memory=0)


def test_a_key_seen_again_at_another_position_moves_its_mark() -> None:
    """Keys that are not a chain's (the same key at two positions): the mark moves with its key,
    so it is found where it lies now and forgetting it later takes it from there."""
    classes = ReuseClasses(ReuseConfig(memory=2))
    classes.observe(chain(7), 0, 100)  # key 7 marked at block 0
    classes.observe(chain(1, 7), 1, 100)  # key 7 again, at block 1
    classes.observe(chain(1, 7), 2, 0)  # a hit through block 1 continues key 7's run
    assert sum(r for _, r in classes.stats().values()) == pytest.approx(1.0, rel=0.01)
    classes = ReuseClasses(ReuseConfig(memory=1))
    classes.observe(chain(7), 0, 100)
    classes.observe(chain(1, 7), 1, 100)  # moved to block 1
    classes.observe(chain(8), 0, 100)  # memory 1: key 7 forgotten, from block 1
    classes.observe(chain(8, 9), 1, 5)  # key 8 (block 0) continued; key 9 marked
    assert sum(r for _, r in classes.stats().values()) == pytest.approx(1.0, rel=0.01)
    assert classes._marked_at == {1: 1} and list(classes._marks) == [key(9)]  # key 9 at block 1
