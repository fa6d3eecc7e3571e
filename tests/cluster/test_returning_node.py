"""A node that comes back empty gets work (issues 18 and 19), with real processes: redis-server,
a coordinator and two nodes, one of them SIGKILLed mid-workload and restarted on the same id and
address, while one worker keeps opening conversations that share two hot system prompts.

The rule (coordinator/placement.py): a node that re-registers keeps its count of recent opens
(decayed), its load starts from nothing, and the balance bound sends it every open the other
node may no longer take; hot prefixes are recomputed there by those opens. So it must take a
fair share of new opens within a few hundred of them, while the busiest node stays near the
mean, instead of none while the other node holds every hot prefix (0 of ~1,000 in 23 s before).
"""

from __future__ import annotations

import random
import signal
import time
from collections import deque

import torch
from conftest import TOKENS, make_cluster
from test_cluster import all_nodes_clean, wait_until
from worker import SPEC

from pagedkv.client import CacheClient, OpenFailed, SequenceLost, SequenceNotFound

RETRIES: list[tuple[str, int, str, str]] = []
SYSTEMS = [list(range(5000 * s, 5000 * s + 256)) for s in (1, 2)]  # two hot 16-block prompts


class Conversations:
    """Conversations under the hot system prompts: each open extends one of them by a turn."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.histories: list[list[int]] = []
        self.next_token = 100_000

    def next_prompt(self) -> list[int]:
        if len(self.histories) < 24 or self.rng.random() < 0.25:  # a new conversation
            self.histories.append(list(self.rng.choice(SYSTEMS)))
            history = self.histories[-1]
        else:
            history = self.rng.choice(self.histories)
        history += range(self.next_token, self.next_token + 24)  # the turn (user + answer)
        self.next_token += 24
        return list(history)


def run(c: CacheClient, conversations: Conversations, num_opens: int, tag: str) -> list[str]:
    """Eight open at once (the oldest closed as the next opens), each appended what was not
    cached: the node each open went to, in order."""
    nodes: list[str] = []
    running: deque = deque()
    for i in range(num_opens):
        prompt = conversations.next_prompt()[-960:]  # at most 60 blocks
        if len(running) == 8:
            running.popleft().close()
        for attempt in range(4):
            seq = c.open(f"{tag}{i}.{attempt}", prompt)
            rest = prompt[seq.num_cached_tokens :]
            kv = torch.zeros(SPEC.num_layers, len(rest), SPEC.num_kv_heads, SPEC.head_dim)
            try:
                seq.append(rest, kv, kv)
                break
            except (
                OpenFailed,
                SequenceLost,
                SequenceNotFound,
            ) as exc:  # its node Open failed or never landed
                RETRIES.append((tag, i, seq.route.node_id, type(exc).__name__))
                continue  # (the coordinator dropped its page table; nothing to close)
        running.append(seq)
        nodes.append(seq.route.node_id)
    for seq in running:
        seq.close()
    return nodes


def test_a_restarted_node_takes_a_fair_share_of_new_opens(tmp_path, redis_url):
    with make_cluster(tmp_path, redis_url=redis_url, num_nodes=2) as cluster:
        c = CacheClient(coordinator=cluster.coordinator_address, token=TOKENS["alpha"], spec=SPEC)
        conversations = Conversations(seed=0)
        before = run(c, conversations, 120, "warm")
        assert min(before.count(n) for n in ("node-0", "node-1")) >= 40  # both served, both hold the prompts
        cluster.kill("node-1", signal.SIGKILL)
        wait_until(lambda: len(c.cluster_stats().nodes) == 1, 10.0, "node-1 declared dead")
        cluster.start_node(1)  # same id, same address: it registers again, empty
        wait_until(lambda: len(c.cluster_stats().nodes) == 2, 15.0, "node-1 back")
        started = time.monotonic()
        after = run(c, conversations, 200, "after")
        seconds = time.monotonic() - started
        # Its fair share is half. It gets at least 8 of the first 50 opens, 40% of the 200, and the
        # busiest node stays within 1.2x the mean. Recorded: 12 of the first 25 and 108 of 200 in
        # three runs (load 5-11); once 0 of the first 25, 84 of 200 (a full-suite run at load 12,
        # not diagnosed). Keeping its count from before it died: 0 of the first 50, 73 of 200.
        windows = [after[i : i + 25].count("node-1") for i in range(0, 200, 25)]
        print(f"node-1 opens per 25 after its restart: {windows} ({seconds:.1f} s); retries {RETRIES}")
        assert windows[0] + windows[1] >= 8, (windows, RETRIES)
        assert sum(windows) >= 80, (windows, RETRIES)
        assert max(after.count(n) for n in ("node-0", "node-1")) <= 1.2 * len(after) / 2, windows
        c.close()
        with CacheClient(coordinator=cluster.coordinator_address, token=TOKENS["alpha"], spec=SPEC) as c2:
            all_nodes_clean(c2)
