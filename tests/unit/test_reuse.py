"""ReuseClasses (coordinator/reuse.py): which sizes of uncached run are scans, learned from
whether later opens continue them. Scenarios with exact masks; no store, no network."""

from __future__ import annotations

import pytest

from pagedkv.coordinator.reuse import ReuseClasses, ReuseConfig
from pagedkv.protos.errors import InvalidArgument


def key(i: int) -> bytes:
    return i.to_bytes(16, "big")


def chat_with_documents(classes: ReuseClasses, rounds: int, start: int = 0) -> None:
    """Each round: a 20-block chat turn that the next round's turn continues (its first key is
    hit), and a 200-block document nobody asks for again."""
    for r in range(start, start + rounds):
        turn, document = key(2 * r), key(2 * r + 1)
        previous = [key(2 * (r - 1))] if r > start else []
        classes.observe(previous, turn, 20)  # class 5 (16-31 blocks)
        classes.observe([], document, 200)  # class 8 (128-255 blocks)


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
        classes.observe([key(1000 + r - 1)] if r else [], key(1000 + r), 500)
        classes.observe([], key(r), 3)
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
        classes.observe([key(5000 + r - 1)] if r else [], key(5000 + r), 200)
        classes.observe([key(9000 + r - 1)] if r else [], key(9000 + r), 20)
    assert classes.scan_classes() == 0


def test_memory_is_bounded_and_forgets_the_oldest_runs() -> None:
    classes = ReuseClasses(ReuseConfig(memory=4))
    for i in range(10):
        classes.observe([], key(i), 100)
    classes.observe([key(0), key(9)], None, 0)  # key 0 was forgotten, key 9 was not
    assert sum(r for _, r in classes.stats().values()) == pytest.approx(1.0, rel=0.01)


def test_bad_config_is_invalid_argument() -> None:
    with pytest.raises(InvalidArgument, match="half_life_opens"):
        ReuseConfig(half_life_opens=0)
    with pytest.raises(InvalidArgument, match="scan_ratio"):
        ReuseConfig(scan_ratio=-1)
    with pytest.raises(InvalidArgument, match="memory"):
        ReuseConfig(memory=0)
