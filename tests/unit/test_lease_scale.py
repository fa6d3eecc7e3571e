"""The lease a coordinator hands out against the fleet's size (coordinator/lease_scale.py):
doubled while the fleet's beats would pass the budget, halved again with hysteresis, never past
the cap; a renewal never shorter than the lease its node holds, whatever a node claims."""

from __future__ import annotations

import math

import pytest

from pagedkv.coordinator.core import CoordinatorConfig
from pagedkv.coordinator.lease_scale import granted_lease, scaled_lease
from pagedkv.coordinator.liveness import Liveness, LivenessConfig
from pagedkv.protos.errors import InvalidArgument


def grow(num_nodes: int, current: float = 3.0, budget: float = 500.0, cap: float = 48.0) -> float:
    return scaled_lease(3.0, budget, cap, num_nodes, current)


def test_the_lease_doubles_while_the_beats_would_pass_the_budget() -> None:
    assert grow(2) == 3.0
    assert grow(375) == 3.0  # 4 x 375 / 3 = 500 beats a second: within
    assert grow(376) == 6.0
    assert grow(1000) == 12.0  # 333 a second
    assert grow(1000, current=12.0) == 12.0
    assert all(4 * n / grow(n) <= 500 for n in range(1, 6000, 7))


def test_it_halves_only_well_under_the_budget_and_never_passes_the_cap() -> None:
    assert grow(700, current=12.0) == 12.0  # at 6 s it would be 467 a second: over 3/4 of the budget
    assert grow(600, current=12.0) == 12.0  # 400 a second at 6 s: still over 375
    assert grow(500, current=12.0) == 6.0  # 333 at 6 s
    assert grow(370, current=12.0) == 6.0  # 247 at 6, 493 at 3 (over 375): stops at 6
    assert grow(2, current=48.0) == 3.0
    assert grow(10**6) == 48.0  # the cap: the beats pass the budget instead
    assert grow(10**6, cap=40.0) == 24.0  # (a power-of-two step of the configured lease)
    assert grow(10**6, budget=0.0) == 3.0 and grow(0) == 3.0


def test_a_renewal_runs_at_least_the_lease_its_node_holds_up_to_the_cap() -> None:
    assert granted_lease(3.0, 12.0, 48.0) == 12.0  # a lease that shortened: the node's still holds
    assert granted_lease(12.0, 3.0, 48.0) == 12.0
    assert granted_lease(3.0, 1e9, 48.0) == 48.0  # a node cannot buy itself a longer one
    for nonsense in (0.0, -5.0, math.nan, math.inf, -math.inf):
        assert granted_lease(3.0, nonsense, 48.0) == 3.0


def test_the_config_refuses_a_budget_or_cap_that_makes_no_sense() -> None:
    for bad in ({"max_beats_per_s": -1.0}, {"max_beats_per_s": math.nan}, {"max_beats_per_s": math.inf}):
        with pytest.raises(InvalidArgument, match="max_beats_per_s"):
            CoordinatorConfig(**bad)  # type: ignore[arg-type]
    for cap in (1.0, math.inf, math.nan):
        with pytest.raises(InvalidArgument, match="max_lease_s"):
            CoordinatorConfig(lease_ttl_s=3.0, max_lease_s=cap)
    assert CoordinatorConfig(lease_ttl_s=2.0).lease_cap_s == 32.0


def test_the_reapers_verdicts_follow_the_lease_handed_out() -> None:
    """After the lease grew to 4 s, a lapsed node is declared dead only once the store has
    answered for a whole 4 s lease and the node has been a suspect for half of one (2 s)."""
    now = [0.0]
    liveness = Liveness(LivenessConfig(1.0), probe=lambda node, timeout: None, clock=lambda: now[0])
    liveness.store_answered()
    liveness.set_lease(4.0)
    for at, dead in ((3.0, []), (4.0, []), (5.9, []), (6.0, ["n1"])):
        now[0] = at
        assert liveness.dead(["n1"]) == dead, at
