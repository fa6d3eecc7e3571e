"""Redis high availability as Redis does it: the coordinator follows the primary through
Redis Sentinel (redis-py's `redis.sentinel.Sentinel`).

    redis+sentinel://host:port,host:port,host:port/mastername[/db][?password=...]

names the sentinels (at least one; three or more in production, on separate machines) and
the primary's name as the sentinels know it. The store's client asks a sentinel for the
current primary on every new connection; after a failover the old primary, now a replica,
refuses writes (READONLY), redis-py turns that into a connection error, the connection is
dropped, and the store's one retry layer sends the call again to the new primary. A call
in flight during the failover answers Unavailable (it may or may not have been applied),
as for any outage, and the reaper extends every lease by the outage (liveness.py).

What a failover loses: Redis replication is asynchronous, so writes the old primary
acknowledged but had not yet sent to the promoted replica are gone (a page table, a
prefix-index update). Reconciliation repairs both kinds: a node's sequence the store no
longer knows is freed, and the prefix index is rebuilt from each node's next events (a
missing key only costs a cache hit).
"""

from __future__ import annotations

from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

import redis
from redis.sentinel import Sentinel

from ..protos.errors import InvalidArgument

SCHEME = "redis+sentinel://"


def parse_sentinel_url(url: str) -> tuple[list[tuple[str, int]], str, int, str | None]:
    """(sentinels as (host, port), the primary's name, db, password) of a redis+sentinel:// URL;
    InvalidArgument naming what is wrong."""
    if not url.startswith(SCHEME):
        raise InvalidArgument(f"a Sentinel URL starts with {SCHEME}, got {url!r}")
    parts = urlsplit(url)
    hosts = parts.netloc.rsplit("@", 1)[-1]
    sentinels = []
    for item in hosts.split(","):
        host, sep, port = item.strip().rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise InvalidArgument(f"{url!r}: sentinel {item!r} is not host:port")
        sentinels.append((host.strip("[]"), int(port)))
    path = [p for p in parts.path.split("/") if p]
    if not path:
        raise InvalidArgument(f"{url!r} names no primary: {SCHEME}host:port,.../mastername[/db]")
    if len(path) > 2 or (len(path) == 2 and not path[1].isdigit()):
        raise InvalidArgument(f"{url!r}: the path must be /mastername or /mastername/db")
    db = int(path[1]) if len(path) == 2 else 0
    query = parse_qs(parts.query)
    password = query["password"][0] if "password" in query else None
    if password is None and "@" in parts.netloc:
        password = unquote(parts.netloc.split("@", 1)[0].rpartition(":")[2]) or None
    return sentinels, unquote(path[0]), db, password


def primary_client(url: str, **connection: Any) -> redis.Redis:
    """A client of the primary the sentinels name (followed across failovers);
    `connection`: redis-py connection options (timeouts, retry, pool size)."""
    sentinels, name, db, password = parse_sentinel_url(url)
    timeout = connection.get("socket_timeout", 1.0)
    sentinel = Sentinel(sentinels, socket_timeout=timeout, socket_connect_timeout=timeout)
    return sentinel.master_for(name, db=db, password=password, **connection)
