"""The node's gate: who may call what, asked once per side whatever carries the call.

The gRPC servicer (server.py) builds a call's Credentials from its metadata; the
bulk listener (serve/) builds one per connection and grows it with each AUTH op
(the client presents a sequence's ticket once per connection). Both then ask the
same questions before touching the engine: `require_admin` for the control rpcs,
`require` for the data calls (every sequence named, with the rights needed), so a
refusal reads the same on every transport and never depends on whether the
sequence exists. Checking a presented credential is a dictionary lookup and two
compares (protos/tickets.py remembers the MACs it checked).

Modes (NodeTrust):
- open: nothing asked (a trusted network: one worker and its node, the tests);
- token: a standalone node started with a bearer token: every call but Stats,
  Ping and CheckIntegrity needs it (gRPC `authorization` metadata, or AUTH);
- cluster: a node serving a cluster with the cluster secret: the control rpcs
  need its coordinator's ADMIN ticket for this node's registration (direct mode
  is refused: no worker chooses a salt), data calls a ticket per sequence; Free
  takes either (a worker's close frees its sequence itself: `require_free`).

Fencing (Chubby/etcd leases with fencing tokens): a node in a cluster holds a lease
that its link renews with every heartbeat. Once it cannot prove the lease is live
(no renewal acknowledged within the lease minus a margin, counted from when the
renewal was SENT, so the coordinator's deadline is never earlier) every data call is
refused with Unavailable naming why, before the engine sees it: a node cut off from
its coordinator stops serving before the coordinator may declare it dead. A ticket
for an earlier registration, and a sequence this node knows it lost (it was reset,
or its registration says so), answer SequenceLost naming the node.

Quotas: the coordinator's Open and Fork may give a sequence an allowance (the
most blocks it may hold here, its tenant's quota). An append that would take it
past that asks the coordinator for more (`reserve`, Coordinator.Reserve) before
anything changes, and fails with its QuotaExceeded when the tenant has no room.
"""

from __future__ import annotations

import contextlib
import hmac
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass

from ..protos.errors import (
    FailedPrecondition,
    PagedKVError,
    PermissionDenied,
    SequenceLost,
    SequenceNotFound,
    Unauthenticated,
    Unavailable,
)
from ..protos.tickets import (
    RIGHT_ADMIN,
    RIGHT_WRITE,
    ClusterKeys,
    Ticket,
    Verifier,
    bearer_in,
    check_order,
    tickets_in,
)

OPEN, TOKEN, CLUSTER = "open", "token", "cluster"
MAX_TICKETS_PER_CONNECTION = 4096  # the oldest are forgotten first (the client presents again)
MAX_LOST = 1 << 16  # lost sequence ids remembered (the oldest forgotten first: NOT_FOUND then)
MAX_EXPECTED = 1 << 16  # ticketed ids whose Open may still be on its way
Reserve = Callable[[str, int, int], int]  # (node seq id, min blocks, wanted blocks) -> new allowance


@dataclass(frozen=True)
class NodeTrust:
    """What a node checks. keys: the cluster secret (cluster mode); token: the bearer
    token a standalone node requires; node_id: the id it registers as (tickets must
    name it)."""

    keys: ClusterKeys | None = None
    token: str = ""
    node_id: str = ""

    @property
    def mode(self) -> str:
        return CLUSTER if self.keys is not None else TOKEN if self.token else OPEN


class Credentials:
    """What one gRPC call or one bulk connection presented."""

    __slots__ = ("admin", "is_owner", "tickets")

    def __init__(self, is_owner: bool = False) -> None:
        self.tickets: dict[str, Ticket] = {}  # node seq id -> its ticket
        self.admin: Ticket | None = None  # the coordinator's ticket for this node
        self.is_owner = is_owner  # open mode, or the standalone node's token


_TRUSTED = Credentials(is_owner=True)  # open mode: every call's (never mutated)
_NO_CHARGE = contextlib.nullcontext()


class Gate:
    def __init__(self, trust: NodeTrust | None = None, *, clock: Callable[[], float] = time.time) -> None:
        self.trust = trust or NodeTrust()
        self.mode = self.trust.mode
        self.node_id = self.trust.node_id
        self._verifier = Verifier(self.trust.keys) if self.trust.keys is not None else None
        self._clock = clock
        self.epoch: int | None = None  # this node's registration epoch (cluster mode), once registered
        self.reserve: Reserve | None = None  # asks the coordinator for more quota (set by its link)
        self._allowances: dict[str, int] = {}  # node seq id -> most blocks it may hold
        self._quota_lock = threading.Lock()
        # Monotonic time after which the lease is not provably live (None: no lease kept,
        # a node outside a cluster is never fenced) and what the link last said about it.
        self._lease_deadline: float | None = None
        self.lease_ttl_s = 0.0
        self._fence_reason = "it has not registered with its coordinator yet"
        self._lost: OrderedDict[str, str] = OrderedDict()  # node seq id -> why it was lost
        # Ids a current ticket named: the coordinator placed them here, so their Open is on its
        # way (True), or they were freed since (False: a late call gets NOT_FOUND at once).
        self._expected: OrderedDict[str, bool] = OrderedDict()
        self._lost_lock = threading.Lock()

    @property
    def is_cluster(self) -> bool:
        return self.mode == CLUSTER

    def set_registration(self, node_id: str, epoch: int) -> None:
        """This node's registration (after every Register): tickets must name it."""
        self.node_id, self.epoch = node_id, epoch

    # -- the lease (fencing) -------------------------------------------------------------

    def keep_lease(self, reason: str = "it has not registered with its coordinator yet") -> None:
        """From now on data calls need a live lease (a node joining a cluster): fenced
        until the first renewal."""
        self._fence_reason = reason
        self._lease_deadline = 0.0

    def lease_renewed(self, sent_at: float, ttl_s: float, margin_s: float) -> None:
        """A renewal sent at `sent_at` (time.monotonic) was acknowledged: the lease is
        provably live until sent_at + ttl_s - margin_s."""
        self.lease_ttl_s = ttl_s
        deadline = sent_at + ttl_s - margin_s
        if self._lease_deadline is None or deadline > self._lease_deadline:
            self._lease_deadline = deadline

    def fence(self, reason: str) -> None:
        """Stop serving data calls at once (e.g. the coordinator says this node was declared
        dead, before it is reset)."""
        self._fence_reason = reason
        self._lease_deadline = 0.0

    def lease_failing(self, reason: str) -> None:
        """Why the last renewal failed: what a fenced call will say (the lease itself runs on)."""
        self._fence_reason = reason

    @property
    def is_fenced(self) -> bool:
        deadline = self._lease_deadline
        return deadline is not None and time.monotonic() > deadline

    def check_lease(self) -> None:
        """Unavailable when the lease is not provably live: refused before anything changes,
        so the call may be sent again once the node renews (or answers SequenceLost)."""
        deadline = self._lease_deadline
        if deadline is not None and time.monotonic() > deadline:
            raise Unavailable(
                f"node {self.node_id!r} cannot prove its lease is live ({self._fence_reason}); "
                "it serves no data call until it renews: retry, or expect SequenceLost"
            )

    # -- lost sequences ------------------------------------------------------------------

    def mark_lost(self, seq_ids: Iterable[str], reason: str) -> None:
        """These sequences' KV is gone (reset, or purged by a registration): their data calls
        answer SequenceLost until the id is opened again."""
        with self._lost_lock:
            for seq_id in seq_ids:
                self._lost[seq_id] = reason
                self._lost.move_to_end(seq_id)
                self._expected.pop(seq_id, None)
            while len(self._lost) > MAX_LOST:
                self._lost.popitem(last=False)

    def opened(self, seq_id: str) -> None:
        """An Open of `seq_id` arrived: it is no longer lost."""
        if self._lost:
            with self._lost_lock:
                self._lost.pop(seq_id, None)

    def _check_lost(self, seq_ids: Sequence[str]) -> None:
        lost = self._lost
        for seq_id in seq_ids:
            reason = lost.get(seq_id)
            if reason is not None:
                raise SequenceLost(seq_id, reason, self.node_id)

    def missing(self, exc: SequenceNotFound) -> PagedKVError:
        """What a data call on an id still unknown after its grace answers: SequenceLost when
        a current ticket named it (the coordinator placed it here; its Open never came:
        the coordinator failed before sending it), else `exc` (NOT_FOUND)."""
        seq_id = exc.seq_id
        if isinstance(seq_id, str) and self._expected.get(seq_id):
            reason = (
                f"its open never reached node {self.node_id!r} (the coordinator failed or could not send it)"
            )
            return SequenceLost(seq_id, reason, self.node_id)
        return exc

    def open_grace_s(self, seq_id: str, default_s: float) -> float:
        """How long a data call waits for `seq_id`'s Open: a lease when a current ticket
        named it (the coordinator placed it here and sent the Open: only a slow node keeps
        it waiting), else `default_s` (an id nobody placed, or a node without tickets)."""
        if self._expected.get(seq_id) and self.lease_ttl_s > default_s:
            return self.lease_ttl_s
        return default_s

    # -- credentials -----------------------------------------------------------------

    def credentials(self) -> Credentials:
        """A new connection's credentials (nothing presented yet)."""
        return _TRUSTED if self.mode == OPEN else Credentials()

    def from_metadata(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> Credentials:
        """A gRPC call's credentials: its tickets and bearer token (Unauthenticated when
        one is forged or not for this node)."""
        if self.mode == OPEN:
            return _TRUSTED
        creds = Credentials()
        if self.mode == TOKEN:
            self.present_token(creds, bearer_in(metadata))
        else:
            self.present(creds, tickets_in(metadata))
        return creds

    def present(self, creds: Credentials, tickets: Sequence[bytes]) -> None:
        """Add tickets to `creds`; Unauthenticated (nothing added after the bad one) when
        one is not this cluster's, or names another node."""
        if self._verifier is None:
            return  # (a token or open node has no use for tickets)
        for raw in tickets:
            t = self._verifier.verify(raw)
            if t.node_id != self.node_id:
                raise Unauthenticated(f"a ticket for node {t.node_id!r} presented to node {self.node_id!r}")
            if t.rights & RIGHT_ADMIN:
                creds.admin = t
                continue
            if len(creds.tickets) >= MAX_TICKETS_PER_CONNECTION:
                del creds.tickets[next(iter(creds.tickets))]
            creds.tickets[t.seq_id] = t
            if t.epoch == self.epoch and t.seq_id not in self._expected:
                self._expected[t.seq_id] = True
                if len(self._expected) > MAX_EXPECTED:
                    self._expected.popitem(last=False)

    def present_token(self, creds: Credentials, token: str | None) -> None:
        if self.mode != TOKEN or token is None:
            return
        if not hmac.compare_digest(token.encode(), self.trust.token.encode()):
            raise Unauthenticated("wrong bearer token for this node")
        creds.is_owner = True

    # -- questions -------------------------------------------------------------------

    def _is_admin(self, creds: Credentials) -> bool:
        if creds.is_owner:
            return True
        t = creds.admin
        return t is not None and t.epoch == self.epoch and t.expires_at >= self._clock()

    def _unregistered(self) -> Unavailable:
        return Unavailable(f"node {self.node_id!r} has not registered with its coordinator yet; retry")

    def require_admin(self, creds: Credentials, method: str) -> None:
        """The control rpcs (Open with a salt, Fork, Free, swaps, pins, Lookup)."""
        if creds.is_owner:
            return
        if self.mode == TOKEN:
            raise Unauthenticated(
                f"{method}: this node requires its bearer token (authorization: Bearer ...)"
            )
        if self.epoch is None:
            raise self._unregistered()
        if not self._is_admin(creds):
            raise PermissionDenied(
                f"{method}: node {self.node_id!r} serves a cluster; only its coordinator may call it "
                "(direct mode is refused: open, fork and close sequences through the coordinator)"
            )

    def require_free(self, creds: Credentials, seq_id: str) -> None:
        """Free: the coordinator's ADMIN ticket (as every control rpc), or in a cluster the
        sequence's own ticket with WRITE (the worker closing it frees it first, so its close
        hears a loss from the node): checked as a data call, fenced and lost answers included.
        A node without a cluster secret cannot tell the two callers apart: it answers every
        Free as a data call (a coordinator's refused Free is retried, then reconciliation's)."""
        if self.mode == CLUSTER and not creds.is_owner and creds.admin is None:
            self.require(creds, [seq_id], RIGHT_WRITE, "Free")
            return
        if self.mode == OPEN:
            if self._lease_deadline is not None:
                self.check_lease()
            if self._lost:
                self._check_lost([seq_id])
        self.require_admin(creds, "Free")

    def check_order(
        self, creds: Credentials, order: bytes, tag: bytes, node_id: str, epoch: int, expires_at: int
    ) -> None:
        """An open order a worker carries (OpenSigned): signed with the cluster secret for
        this node's current registration, not expired. Without a secret the order is
        taken as an Open (open mode) or needs the node's token (token mode); an order
        for another registration is refused in every mode once this node registered.
        Not fenced: the order is the coordinator's decision, as its own Open, and a worker
        sends it once (a refusal drops the page table: a stall shorter than the lease would
        lose the sequence); the data calls that follow it are fenced."""
        if self.mode == TOKEN:
            self.require_admin(creds, "OpenSigned")
        if self.mode == CLUSTER and self.epoch is None:
            raise self._unregistered()
        if self.epoch is not None and (node_id != self.node_id or epoch != self.epoch):
            raise FailedPrecondition(
                f"an open order for node {node_id!r} (registration {epoch}) reached node {self.node_id!r} "
                f"(registration {self.epoch}): the node restarted or re-registered since; open again"
            )
        if self.mode != CLUSTER:
            return
        if expires_at < self._clock():
            raise FailedPrecondition(
                "the open order expired (it is sent on at once: clock skew?); open again"
            )
        if not check_order(self.trust.keys, order, tag, node_id, epoch, expires_at):  # type: ignore[arg-type]
            raise Unauthenticated(
                "open order not signed by this cluster's key (forged, altered, or another cluster's)"
            )

    def require(self, creds: Credentials, seq_ids: Sequence[str], rights: int, method: str) -> None:
        """Every sequence named needs a live ticket with `rights` (the coordinator's
        ADMIN ticket covers all). The same answer whether or not the sequence exists.
        First of all the lease (Unavailable while fenced), then lost ids (SequenceLost)."""
        if self._lease_deadline is not None:
            self.check_lease()
        if self._lost:
            self._check_lost(seq_ids)
        if creds.is_owner:
            return
        if self.mode == TOKEN:
            raise Unauthenticated(
                f"{method}: this node requires its bearer token (authorization: Bearer ...)"
            )
        tickets = creds.tickets
        if not tickets:
            if creds.admin is not None and self._is_admin(creds):
                return
            if self.epoch is None:
                raise self._unregistered()
            raise Unauthenticated(
                f"{method}: node {self.node_id!r} serves a cluster: data calls need the ticket its "
                "coordinator issued for each sequence (none presented)"
            )
        now, epoch = self._clock(), self.epoch
        for seq_id in seq_ids:
            t = tickets.get(seq_id)
            if t is None or t.rights & rights != rights:
                if self._is_admin(creds):
                    continue
                raise PermissionDenied(
                    f"{method}: no ticket for sequence {seq_id!r} on node {self.node_id!r}"
                )
            if t.expires_at < now:
                raise Unauthenticated(
                    f"{method}: the ticket for sequence {seq_id!r} expired; look the sequence up again"
                )
            if t.epoch != epoch:
                raise SequenceLost(
                    seq_id,
                    f"{method}: its ticket is for an earlier registration of node {self.node_id!r} "
                    "(the node restarted or was declared dead since)",
                    self.node_id,
                )

    # -- quotas --------------------------------------------------------------------------

    def set_allowance(self, seq_id: str, max_blocks: int | None) -> None:
        if max_blocks is None:
            self._allowances.pop(seq_id, None)
        else:
            self._allowances[seq_id] = max_blocks

    def drop(self, seq_id: str) -> None:
        """`seq_id` was freed."""
        self._allowances.pop(seq_id, None)
        if seq_id in self._expected:
            self._expected[seq_id] = False

    def reset(self) -> None:
        """The node came back empty (re-registered): no sequence, no allowance."""
        self._allowances.clear()
        self._expected.clear()

    def allowance(self, seq_id: str) -> int | None:
        return self._allowances.get(seq_id)

    def charging(
        self, seq_ids: Sequence[str], new_tokens: Sequence[int], held: Callable[[str], int], block_size: int
    ) -> AbstractContextManager[object]:
        """Hold this around an engine call that appends new_tokens[i] tokens to
        seq_ids[i] (held(id): the tokens it holds now): for sequences with an
        allowance, more is reserved first when the append would pass it, and the
        check and the append are one step (the quota lock, held across the
        coordinator's Reserve: one round trip per _GROW_BLOCKS blocks a sequence grows).
        Nothing to do (no lock) for sequences without one."""
        allowances = self._allowances
        if not allowances:
            return _NO_CHARGE
        limited = [(s, n) for s, n in zip(seq_ids, new_tokens, strict=True) if n > 0 and s in allowances]
        return self._charge(limited, held, block_size) if limited else _NO_CHARGE

    @contextlib.contextmanager
    def _charge(
        self, limited: list[tuple[str, int]], held: Callable[[str], int], block_size: int
    ) -> Iterator[None]:
        with self._quota_lock:
            for seq_id, n in limited:
                need = -(-(held(seq_id) + n) // block_size)
                allowed = self._allowances.get(seq_id)
                if allowed is None or need <= allowed:
                    continue
                if self.reserve is None:
                    raise Unavailable(
                        f"sequence {seq_id!r} needs more quota and this node has no coordinator"
                    )
                more = need - allowed
                self._allowances[seq_id] = self.reserve(seq_id, more, max(more, _GROW_BLOCKS))
            yield


# Quota is reserved in steps of at least this many blocks: one coordinator round trip
# per 8 blocks a decoding sequence grows, not one per block.
_GROW_BLOCKS = 8
