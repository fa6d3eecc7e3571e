"""How long a node's lease runs: the configured lease, doubled as the fleet grows so that
the fleet's beats stay within a budget.

A node beats every quarter lease, so N nodes on a fixed lease cost the coordinators N / (lease/4)
beats a second: 1,333 at 1,000 nodes on the default 3 s lease, ~0.1 of a coordinator core on
the hosts bench.scale ran on, spent whatever the open rate. Chubby's master lengthens its
sessions' leases when it is overloaded; here the lease doubles whenever the beats would pass
`max_beats_per_s` (and halves again once they would stay under three quarters of it), so a
small cluster keeps the short lease and its fast detection, and a large one pays a bounded
number of beats for a lease that grows with it (detection time grows the same way: a dead node
is declared dead about 1.75 leases after its last beat, liveness.py). Steps are powers of two
of the configured lease, so the handed-out value changes rarely. It never passes `max_lease_s`:
past that many nodes the beats pass the budget instead.

Every renewal is granted for at least the lease its node believes it holds (the beat says it,
bounded by max_lease_s): a lease that shortens is taken up by a node from the next reply on, and
never ends in the store before it ends at the node (gate.py fences from the node's belief).
"""

from __future__ import annotations

import math

SHRINK_AT = 0.75  # halve once the beats at half the lease would stay under this share of the budget


def scaled_lease(
    base_s: float, max_beats_per_s: float, max_lease_s: float, num_nodes: int, current_s: float
) -> float:
    """The lease to hand out for `num_nodes` live nodes, from `current_s` (the one handed out
    until now): base_s * 2^k, the fleet's beats (a beat each quarter lease) within
    max_beats_per_s, at most max_lease_s; base_s when max_beats_per_s is 0."""
    if max_beats_per_s <= 0 or num_nodes <= 0:
        return base_s
    top = base_s * 2 ** max(0, math.floor(math.log2(max_lease_s / base_s)))  # the largest step allowed
    lease = min(max(base_s, current_s), top)
    while lease < top and 4 * num_nodes / lease > max_beats_per_s:
        lease *= 2
    while lease > base_s and 4 * num_nodes / (lease / 2) <= SHRINK_AT * max_beats_per_s:
        lease /= 2
    return lease


def granted_lease(lease_s: float, held_s: float, max_lease_s: float) -> float:
    """The TTL of a renewal: the lease handed out now, or the one its node holds when that is
    longer (a lease that shortened), bounded by max_lease_s; a held value that is not a positive
    finite number (an older node sends 0) counts for nothing."""
    if not (held_s > 0 and math.isfinite(held_s)):
        return lease_s
    return max(lease_s, min(held_s, max_lease_s))
