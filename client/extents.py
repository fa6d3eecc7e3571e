"""Attention over a sequence sharded across nodes: one call per node, merged by LSE.

A sequence's extents each hold a contiguous run of its tokens on one node (the
coordinator's page table; coordinator/extents.py); the last, the tail, takes appends.
Each node attends over its own blocks and returns out + lse; the partial results over
disjoint key sets merge exactly by their log-sum-exp (protos/merge.py, the node's own
merge)::

    keys        [ extent 0: node A ][ extent 1: node B ][ tail: node C  | new ]
    decode      attend (no append)   attend (no append)  append + attend
    prefill     full (widened q)     full (widened q)    causal (append + attend)

Decode: every earlier extent is attended without an append; the new token's K/V goes to
the tail only. Prefill of n new tokens: the tail attends causally over its own tokens and
the new ones; an earlier extent sees every query attend to ALL its keys, which is a
decode over that extent with the n queries laid out as extra query heads of one row
(`widen`): a single call, no causal mask, GQA groups kept.

Calls to different nodes overlap: every node's request is sent first, then every reply
read, the last sent first (`exchange`, on the caller's thread), so a step costs about the
slowest node's call, not their sum, with no thread hand-off (a pool's wake-ups cost more
than the sends on a busy host: bench/README). A decode batch is one call per node it spans, even where a node
holds one sequence's tail (append) and another's earlier extent (attend only): the call
flags the rows that append (AttendRequest.appends).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from ..protos.errors import CapacityExceeded
from ..protos.merge import merge_partials
from . import budget as budgets
from . import codec
from .extent_masks import PAST, SKIP, WHOLE, extent_view, layer_of, pad_rows, query_split
from .transport.base import Reply
from .types import AttentionResult

if TYPE_CHECKING:
    from .sequence import Sequence as Seq
    from .sync import CacheClient

T = TypeVar("T")


def run_parallel(pool: Executor, calls: Sequence[Callable[[], T]]) -> list[T]:
    """Every call's result, in order: the first on this thread, the others on the pool at
    the same time. The first error raised (in call order) is raised, after all finished."""
    if len(calls) == 1:
        return [calls[0]()]
    futures = [pool.submit(c) for c in calls[1:]]
    first: BaseException | None = None
    results: list[T] = []
    try:
        results.append(calls[0]())
    except BaseException as exc:  # noqa: BLE001 - re-raised below, once the others finished
        first = exc
    for f in futures:
        try:
            results.append(f.result())
        except BaseException as exc:  # noqa: BLE001 - the first one in call order wins
            first = first or exc
    if first is not None:
        raise first
    return results


def exchange(starts: Sequence[Callable[[], Reply]]) -> list[Any]:
    """Every call's request sent, in order, then every answer read, the last sent first:
    the nodes work at once while this thread waits. Linux runs the node a socket send
    wakes on the sender's core when the sender blocks right after (a sync wakeup), so the
    last node sent to starts at once there while the earlier ones had longer to finish:
    waiting on it first wakes this thread once a step, not once per node (reading in
    send order was slower where a core was busy: bench/README). A send that fails stops
    the later ones; the first error in call order is raised once every request sent has
    its answer (so no connection is left holding one)."""
    results, errors = exchange_each(starts)
    first = next((e for e in errors if e is not None), None)
    if first is not None:
        raise first
    return results


def exchange_each(starts: Sequence[Callable[[], Reply]]) -> tuple[list[Any], list[BaseException | None]]:
    """`exchange` without raising: each call's result or error (None where it answered).
    A send that fails gives its error, and the calls after it (never sent) get it too."""
    replies: list[Reply] = []
    failed: BaseException | None = None
    for start in starts:
        try:
            replies.append(start())
        except BaseException as exc:  # noqa: BLE001 - handed back, once the sent ones are answered
            failed = exc
            break
    results: list[Any] = [None] * len(starts)
    errors: list[BaseException | None] = [failed] * len(starts)
    for i in reversed(range(len(replies))):
        try:
            results[i], errors[i] = replies[i].result(), None
        except BaseException as exc:  # noqa: BLE001 - handed back
            errors[i] = exc
    return results, errors


class Then:
    """A Reply whose answer goes through `then` (a widened prefill narrowed back)."""

    __slots__ = ("_reply", "_then")

    def __init__(self, reply: Reply, then: Callable[[AttentionResult], AttentionResult]) -> None:
        self._reply, self._then = reply, then

    def result(self) -> AttentionResult:
        return self._then(self._reply.result())


def widen(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """n queries [n, Hq, D] as ONE decode row [1, n * Hq, D] whose query heads keep their KV
    head: head h of row i lands in KV head h // G's group (G = Hq / kv_heads)."""
    n, hq, d = q.shape
    g = hq // kv_heads
    return q.reshape(n, kv_heads, g, d).permute(1, 0, 2, 3).reshape(1, kv_heads * n * g, d)


def narrow(res: AttentionResult, n: int, kv_heads: int) -> AttentionResult:
    """The inverse of widen on a decode result: out [n, Hq, D], lse [n, Hq] (no block mass:
    a prefill asks for none across extents)."""
    _, wide, d = res.out.shape
    g = wide // (kv_heads * n)
    out = res.out.reshape(kv_heads, n, g, d).permute(1, 0, 2, 3).reshape(n, kv_heads * g, d)
    lse = res.lse.reshape(kv_heads, n, g).permute(1, 0, 2).reshape(n, kv_heads * g)
    return AttentionResult(out, lse)


def merge(parts: Sequence[AttentionResult]) -> AttentionResult:
    """Partial results over disjoint key sets (in extent order) as one. Block mass, when every
    part has it, is each part's mass rescaled to the merged softmax (weight exp(lse_part -
    lse)), per row summed over heads as the node reports it, concatenated in extent order: an
    estimate (the heads' weights averaged), which the decode paths replace by exact_mass
    where the nodes can compute it (no window or chunks)."""
    if len(parts) == 1:
        return parts[0]
    out, lse = merge_partials([p.out for p in parts], [p.lse for p in parts])
    masses = [p.block_mass for p in parts]
    if any(m is None for m in masses):
        return AttentionResult(out, lse)
    scaled = []
    for p, m in zip(parts, masses, strict=True):
        assert m is not None
        # the node's mass is a softmax share summed over heads: rescale by the heads' mean weight
        w = torch.exp(p.lse.float() - lse.float()).mean(dim=-1, keepdim=True)
        scaled.append(m.float() * w)
    return AttentionResult(out, lse, torch.cat(scaled, dim=-1))


def exact_mass(
    seq: Seq, layer: int, q: Any, lse: Any, timeout_s: float | None, pending: int = 0
) -> torch.Tensor:
    """The block mass of one decode query (q [1, Hq, D], merged lse [1, Hq]) over every
    extent of seq, each node's blocks under the merged softmax (BlockMass: the mass one node
    holding every key computes), in extent order; `pending`: tail tokens landed, not yet
    counted. One more parallel round: only when the caller asks for block mass."""
    norms = lse.float().reshape(-1).tolist()
    last = len(seq.extents) - 1
    held = [seq._held_tokens(i) or 0 for i in range(last + 1)]
    held[last] += pending
    replies = [
        (i, seq._nodes[i].data.start_block_mass(seq.seq_id, [(layer, q, norms, [n])], timeout_s))
        for i, n in enumerate(held)
        if n > 0
    ]
    return torch.tensor([m for _, reply in replies for m in reply.result()], dtype=torch.float32)[None]


def rows_of(res: AttentionResult, rows: Sequence[int]) -> AttentionResult:
    idx = list(rows)
    mass = None if res.block_mass is None else res.block_mass[idx]
    return AttentionResult(res.out[idx], res.lse[idx], mass)


def stack_rows(parts: Sequence[AttentionResult]) -> AttentionResult:
    """Row results (each [1, ...]) back into one batch; block mass padded to the widest."""
    out = torch.cat([p.out for p in parts])
    lse = torch.cat([p.lse for p in parts])
    if any(p.block_mass is None for p in parts):
        return AttentionResult(out, lse)
    width = max(p.block_mass.shape[-1] for p in parts if p.block_mass is not None)
    mass = torch.zeros((len(parts), width), dtype=torch.float32)
    for i, p in enumerate(parts):
        assert p.block_mass is not None
        mass[i, : p.block_mass.shape[-1]] = p.block_mass[0]
    return AttentionResult(out, lse, mass)


def attend_batch(
    client: CacheClient,
    handles: list[Seq],
    layer: int,
    q: Any,
    k: Any,
    v: Any,
    token_ids: codec.TokenIds | None,
    return_block_mass: bool,
    timeout_s: float | None,
    appended: frozenset[int] = frozenset(),
) -> AttentionResult:
    """A decode step over sequences of which some span several nodes: one call per node for
    every row it holds an extent of (the rows whose tail it holds append the new token when
    k is given), all nodes in parallel; each row merges its parts by LSE in extent order.
    appended: rows whose token already landed (a step retried after a spill): they only
    attend. A node that cannot take its rows' tokens makes those sequences spill, and the
    step is retried without appending again what the other nodes took."""
    tokens = None if token_ids is None else codec.token_list(token_ids)
    if k is not None and layer == 0:
        for row, s in enumerate(handles):
            if row not in appended and s._tail_room() == 0:  # the new token starts an extent
                s.extend(timeout_s=timeout_s)
            if row not in appended and s._budget_on:
                budgets.make_room(s, 1, timeout_s)
    # address -> [(row, extent index, appends)]
    groups: dict[str, list[tuple[int, int, bool]]] = {}
    past: list[tuple[int, int, Callable[[], Reply]]] = []  # a window's edge inside: its own call
    skipped: set[int] = set()  # rows with an extent outside the window: their masses would not line up
    for row, s in enumerate(handles):
        last = len(s.extents) - 1
        spec = layer_of(s.attention, layer)
        pos = s._query_position(layer, k) if spec.masks and last else 0
        for i, ext in enumerate(s.extents):
            if (i < last or k is None) and s._held_tokens(i) == 0:
                continue  # an empty new tail, or an extent a budget emptied: nothing to attend to
            view = WHOLE
            if spec.masks and i < last:
                view = extent_view(spec, ext.first_token, s.extents[i + 1].first_token, pos)
            if view == SKIP:
                skipped.add(row)
                client.counters["window_skipped_attends"] += 1
            elif view == PAST:
                data = client.node(ext.route.address).data
                past.append((row, i, _past_call(data, s.seq_id, layer, q[row : row + 1], pos, timeout_s)))
            else:
                appends = i == last and k is not None and row not in appended
                groups.setdefault(ext.route.address, []).append((row, i, appends))
    calls = [
        _node_call(client, address, members, handles, layer, q, k, v, tokens, return_block_mass, timeout_s)
        for address, members in groups.items()
    ]
    calls += [call for _, _, call in past]
    results, errors = exchange_each(calls)
    if any(e is not None for e in errors):
        writers = [[row for row, _, appends in members if appends] for members in groups.values()]
        step = (layer, q, k, v, token_ids, return_block_mass, timeout_s)
        return spill_and_retry(client, handles, step, writers, errors[: len(groups)], errors, appended)
    if any(s.is_sharded for s in handles):
        client.counters["sharded_steps"] += 1
        client.counters["sharded_attends"] += len(calls)
    per_row: list[dict[int, AttentionResult]] = [{} for _ in handles]
    for members, res in zip(groups.values(), results[: len(groups)], strict=True):
        for j, (row, index, _) in enumerate(members):
            part = rows_of(res, [j])
            per_row[row][index] = AttentionResult(part.out, part.lse) if row in skipped else part
    for (row, index, _), res in zip(past, results[len(groups) :], strict=True):
        per_row[row][index] = res
    if k is not None and layer == 0:
        for s in handles:
            if s.num_tokens is not None:
                s.num_tokens += 1
    merged = [merge([parts[i] for i in sorted(parts)]) for parts in per_row]
    for row, s in enumerate(handles):  # over several extents the exact mass (one more round)
        if return_block_mass and len(per_row[row]) > 1 and not layer_of(s.attention, layer).masks:
            res = merged[row]
            mass = exact_mass(s, layer, q[row : row + 1], res.lse, timeout_s)
            merged[row] = AttentionResult(res.out, res.lse, mass)
    for row, s in enumerate(handles):
        if s._budget_on:
            budgets.record(s, layer, q[row : row + 1], merged[row].lse, len(s.extents) - 1, timeout_s)
    return stack_rows(merged)


def spill_and_retry(
    client: CacheClient,
    handles: list[Seq],
    step: tuple[Any, ...],
    writers: list[list[int]],
    errors: list[BaseException | None],
    all_errors: list[BaseException | None],
    appended: frozenset[int] = frozenset(),
) -> AttentionResult:
    """A decode step's node calls failed (all_errors: every call's, in call order; errors
    and writers: the calls that append, and the rows each appends). Unless the first error
    is a refused token at layer 0, it is raised. Else the sequences of the refusing nodes'
    rows spill, and the step runs again (attend_batch) with the rows the other nodes took
    marked appended: a node's refusal is the whole call's, so those rows hold their token."""
    layer, q, k, v, token_ids, return_block_mass, timeout_s = step
    failure = next(e for e in all_errors if e is not None)
    if not isinstance(failure, CapacityExceeded) or layer != 0 or k is None:
        raise failure
    landed, refused = set(appended), []
    for rows, error in zip(writers, errors, strict=True):
        if error is None:
            landed.update(rows)
        elif isinstance(error, CapacityExceeded):
            refused += [handles[row] for row in rows]
    if not client._spill_full(refused, failure, timeout_s):
        raise failure
    return attend_batch(
        client, handles, layer, q, k, v, token_ids, return_block_mass, timeout_s, frozenset(landed)
    )


def _past_call(
    data: Any, seq_id: str, layer: int, q: Any, pos: int, timeout_s: float | None
) -> Callable[[], Reply]:
    """A decode row's query at `pos` over an earlier extent its window's edge cuts (extent_masks.py)."""

    def call() -> Reply:
        reply: Reply = data.start_attend_prefill(seq_id, layer, q, timeout_s=timeout_s, query_position=pos)
        return reply

    return call


def _node_call(
    client: CacheClient,
    address: str,
    members: list[tuple[int, int, bool]],
    handles: list[Seq],
    layer: int,
    q: Any,
    k: Any,
    v: Any,
    tokens: list[int] | None,
    return_block_mass: bool,
    timeout_s: float | None,
) -> Callable[[], Reply]:
    """The one call of a sharded decode step to the node at `address`: q of every row it
    holds; k, v, token ids of the rows that append there (flagged when not all do)."""
    rows = [r for r, _, _ in members]
    ids = [handles[r].seq_id for r in rows]
    writers = [r for r, _, appends in members if appends]
    flags = None if len(writers) in (0, len(rows)) else [appends for _, _, appends in members]
    pick, write = torch.tensor(rows), torch.tensor(writers, dtype=torch.long)
    data = client.node(address).data

    def call() -> Reply:
        reply: Reply = data.start_attend(
            ids,
            layer,
            q[pick],
            k[write] if writers else None,
            v[write] if writers else None,
            [tokens[r] for r in writers] if writers and tokens is not None else None,
            return_block_mass=return_block_mass,
            timeout_s=timeout_s,
            appends=flags,
        )
        return reply

    return call


def prefill_part(
    seq: Seq,
    layer: int,
    ext: int,
    q: Any,
    k: Any,
    v: Any,
    tokens: list[int] | None,
    first: int | None,
    timeout_s: float | None,
) -> AttentionResult:
    """Queries (at positions first..) whose own tokens go to extent `ext` of `seq`: causal
    there, every earlier extent whole, or as much of it as their window or chunk sees (an
    extent none of them sees is not attended; extent_masks.py)."""
    node, seq_id, client = seq._nodes[ext], seq.seq_id, seq.client
    calls: list[Callable[[], Reply]] = [
        lambda: node.data.start_attend_prefill(seq_id, layer, q, k, v, tokens, timeout_s=timeout_s)
    ]
    kv_heads = node.model_spec(timeout_s).num_kv_heads
    n = len(q)
    spec = layer_of(seq.attention, layer)
    if spec.masks and first is None:
        first = seq._query_position(layer, None)  # raises: the length is unknown
    skipped = 0
    for i in range(ext):
        if seq._held_tokens(i) == 0:
            continue  # a budget dropped every block there
        data = seq._nodes[i].data
        whole = seen = n
        if spec.masks:
            assert first is not None
            whole, seen = query_split(
                spec, seq.extents[i].first_token, seq.extents[i + 1].first_token, first, n
            )
        if seen == 0:
            skipped += 1
        elif whole == seen:  # one usual call: the queries as one row's heads (widen)
            wide = widen(torch.as_tensor(q[:seen]), kv_heads)
            calls.append(
                lambda data=data, wide=wide, seen=seen: Then(  # type: ignore[misc]
                    data.start_attend([seq_id], layer, wide, timeout_s=timeout_s),
                    lambda res: pad_rows(narrow(res, seen, kv_heads), n),
                )
            )
        else:  # a window's edge inside it: the node masks from the queries' positions
            calls.append(
                lambda data=data, seen=seen: Then(  # type: ignore[misc]
                    data.start_attend_prefill(
                        seq_id, layer, q[:seen], timeout_s=timeout_s, query_position=first
                    ),
                    lambda res: pad_rows(res, n),
                )
            )
    client.counters["window_skipped_attends"] += skipped
    results = exchange(calls)
    if len(calls) > 1:
        client.counters["sharded_steps"] += 1
        client.counters["sharded_attends"] += len(calls)
    res = merge([*results[1:], results[0]])
    if seq._budget_on:  # at layer 0 the part's tokens landed before the length counts them
        budgets.record(seq, layer, q, res.lse, ext, timeout_s, pending=n if tokens is not None else 0)
    return res


def cat_rows(parts: list[AttentionResult]) -> AttentionResult:
    if len(parts) == 1:
        return parts[0]
    return AttentionResult(torch.cat([p.out for p in parts]), torch.cat([p.lse for p in parts]))
