"""A cluster sequence's close: the worker frees it on its nodes, then the coordinator
drops its page table.

Why the worker frees and not the coordinator: a close must learn that its sequence was
lost, and only the node can say so before anything else found out (it was killed or cut
off, no data call since, its death not yet declared). The node's Free carries the
sequence's ticket (WRITE), so the node checks it as a data call: fenced answers
Unavailable, a sequence it knows it lost SequenceLost naming it. It also takes one node
rpc per close off the coordinator's CPU. Each extent's node gets its Free at the same
time; then, by what they answered::

    every node OK (or SequenceLost)  Close(freed_extents=n): the coordinator frees only
                                     extents added since this handle learned its n; a
                                     node's SequenceLost is raised after it
    a node NOT_FOUND (or OpenFailed) Close: the coordinator frees as before (a Free that
                                     overtook its node Open, or a retried close); the
                                     open's error is raised after it
    a node refused the ticket        Close: the coordinator frees with its own credential
                                     (an older node; an expired ticket)
    a node Unavailable               the page table is read (routing.explain, as a data
                                     call's Unavailable): recorded lost -> Close drops the
                                     record, SequenceLost naming the node; else Unavailable
                                     and the page table stays: the handle stays open, a
                                     retry gets the verdict

Crash consistency: a worker that dies between its Frees and the Close leaves a record
whose node no longer holds it; reconciliation marks it lost (coordinator/reconcile.py)
and lost records expire. A retried close of it (the node answers NOT_FOUND) answers OK
before that, SequenceLost after.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

from ..protos.errors import (
    NotFound,
    OpenFailed,
    PagedKVError,
    PermissionDenied,
    SequenceLost,
    Unauthenticated,
    Unavailable,
)
from .extents import run_parallel

# Node answers after which the coordinator's Close still runs (all but Unavailable and bad input).
_GO_ON = (NotFound, SequenceLost, OpenFailed, Unauthenticated, PermissionDenied)

if TYPE_CHECKING:
    from .routing import CoordinatorRouting
    from .sequence import Sequence
    from .sync import NodeHandle


def _free(
    node: NodeHandle, seq_id: str, timeout_s: float | None, keep_prefix: int | None
) -> PagedKVError | None:
    """The node's answer to the worker's Free (None: freed), naming the worker's id."""
    try:
        node.control.free(seq_id, timeout_s, keep_prefix)
    except Unavailable as exc:  # named by its node: gRPC's "Stream removed" names none
        if node.address not in str(exc):
            named = PagedKVError.__new__(type(exc))
            Exception.__init__(named, f"node {node.address}: {exc}")
            named.__dict__.update(exc.__dict__)
            exc = named
        return node.wallet.worker_error(exc)
    except PagedKVError as exc:
        return node.wallet.worker_error(exc)
    return None


def close_in_cluster(seq: Sequence, timeout_s: float | None, keep_prefix: int | None) -> None:
    """Free `seq` on every node of its extents, then drop its page table (see the module
    docstring). Raises SequenceLost naming the node that lost it; Unavailable when a node
    cannot be reached and no verdict says it lost the sequence (nothing was dropped)."""
    routing: CoordinatorRouting = seq.client.routing  # type: ignore[assignment]
    nodes = list({node.address: node for node in seq._nodes}.values())
    answers = run_parallel(
        seq.client.pool(),
        [lambda node=node: _free(node, seq.seq_id, timeout_s, keep_prefix) for node in nodes],  # type: ignore[misc]
    )
    errors = [e for e in answers if e is not None]
    down = next((e for e in errors if isinstance(e, Unavailable)), None)
    if down is not None:
        verdict = routing.explain(down, [seq.seq_id])
        if not isinstance(verdict, SequenceLost):
            raise verdict
        # The record is lost: its close drops it (and frees what live nodes hold); it answers
        # SequenceLost, as expected, or nothing when unreachable (a lost record expires).
        with contextlib.suppress(PagedKVError):
            routing.close(seq.seq_id, timeout_s, keep_prefix)
        raise verdict
    for exc in errors:
        if not isinstance(exc, _GO_ON):
            raise exc  # e.g. InvalidArgument: nothing was freed
    is_freed = all(e is None or isinstance(e, SequenceLost) for e in answers)
    freed_extents = len(seq.extents) if is_freed else 0
    routing.close(seq.seq_id, timeout_s, keep_prefix, freed_extents=freed_extents)
    for kind in (SequenceLost, OpenFailed):  # the loss first: it is what the worker must act on
        reported = next((e for e in errors if isinstance(e, kind)), None)
        if reported is not None:
            raise reported
