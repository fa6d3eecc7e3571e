"""Numbered event runs cut into script parts, for the Redis stores' apply_event_runs.

A run's keys go to Redis in parts of at most MAX_KEYS_PER_SCRIPT keys, one script each, so no
script holds Redis for long (a purge-sized run of 100k keys would block it ~10 ms in one):

    run 7..9, 10,000 keys   stored ......................... offloaded ... removed ...
    parts                   [ 0, 4096 )  [ 4096, 8192 )  [ 8192, 10000 )
                            starts=1     -               ends=1 (records last_seq 9)

The rule that keeps parts consistent (a crash between them, replicas racing) is in
event_run_scripts.py. MemoryStore applies a run under its lock and needs no parts.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import NamedTuple

from .records import EventRun

MAX_KEYS_PER_SCRIPT = 4096


class RunPart(NamedTuple):
    """One script of a run: its keys and its ARGV from the epoch on (event_run_scripts.py)."""

    run: EventRun
    stored: Sequence[bytes]
    offloaded: Sequence[bytes]
    removed: Sequence[bytes]
    ends: bool  # the run's last part: its reply is the run's answer
    args: list[str | bytes]


def run_parts(runs: Sequence[EventRun], max_keys: int = MAX_KEYS_PER_SCRIPT) -> list[RunPart]:
    """Every part of every run (checked runs, records.check_runs), in order."""
    parts: list[RunPart] = []
    for run in runs:
        stored, offloaded, removed = lists = (run.stored, run.offloaded, run.removed)
        total = len(stored) + len(offloaded) + len(removed)
        # (a base at or past first_seq - 1 vouches for what came before: no gap to check)
        before = 0 if run.base_seq >= run.first_seq - 1 else run.first_seq - 1
        if total <= max_keys:  # the whole run in one script (nearly every one): nothing to cut
            n_stored, n_offloaded = str(len(stored)), str(len(offloaded))
            head = [str(run.epoch), str(before), str(run.last_seq), "", "1", "1", n_stored, n_offloaded]
            args: list[str | bytes] = [*head, *stored, *offloaded, *removed]
            parts.append(RunPart(run, stored, offloaded, removed, True, args))
            continue
        starts = range(0, total, max_keys)
        token = os.urandom(8).hex()  # parts of one run share it: a fence against other writers between them
        head = [str(run.epoch), str(before), str(run.last_seq), token]
        for start in starts:
            end = start + max_keys
            cut: list[Sequence[bytes]] = []
            at = 0
            for keys in lists:  # each list's share of keys [start, end) of the three joined
                cut.append(keys[max(0, start - at) : max(0, end - at)])
                at += len(keys)
            stored, offloaded, removed = cut
            is_first, is_last = start == 0, end >= total
            flags = ["1" if is_first else "0", "1" if is_last else "0", str(len(stored)), str(len(offloaded))]
            cut_args: list[str | bytes] = [*head, *flags, *stored, *offloaded, *removed]
            parts.append(RunPart(run, stored, offloaded, removed, is_last, cut_args))
    return parts


def batch_parts(parts: Sequence[RunPart], max_keys: int = MAX_KEYS_PER_SCRIPT) -> list[list[str | bytes]]:
    """The parts' ARGV for RedisStore's APPLY_EVENT_RUNS (after its prefix): as many parts a
    script, in order, as hold max_keys keys in all (a part counting 2 more: its checks), each
    as its node id, its number of arguments and its arguments. A flush of 1,000 nodes' one-event
    runs is then a few scripts, not 1,000 (each a command to pack, run and answer)."""
    batches: list[list[str | bytes]] = []
    batch: list[str | bytes] = []
    cost = 0
    for part in parts:
        n = len(part.stored) + len(part.offloaded) + len(part.removed) + 2
        if batch and cost + n > max_keys:
            batches.append(batch)
            batch, cost = [], 0
        batch += [part.run.node_id, str(len(part.args)), *part.args]
        cost += n
    if batch:
        batches.append(batch)
    return batches
