"""Several Lua scripts in one Redis Cluster pipeline, NOSCRIPT recovered (ClusterStore).

redis-py's ClusterPipeline queues EVALSHA and leaves a script Redis no longer has (NOSCRIPT,
after a restart or a SCRIPT FLUSH) to the caller: here it is loaded on every master and the
calls it refused are sent again. Errors are redis-py's own; the store translates them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from redis.cluster import RedisCluster
from redis.commands.core import Script
from redis.exceptions import NoScriptError

ScriptCall = tuple[Script, Sequence[bytes], Sequence[str | bytes]]  # (script, keys, args)


def run_scripts(client: RedisCluster, calls: Sequence[ScriptCall]) -> list[Any]:
    """Each call's reply, in order: a round trip per master, each master's calls in order. A
    call answered NOSCRIPT ran nothing: it is sent again after the others, so the scripts must
    be safe in that order (apply_event_runs's check their own). The first error raises, once
    every reply is in."""
    replies = _send(client, calls)
    missing = [i for i, reply in enumerate(replies) if isinstance(reply, NoScriptError)]
    if missing:
        for script in {id(calls[i][0]): calls[i][0] for i in missing}.values():
            script.sha = client.script_load(script.script)  # on every master
        for i, reply in zip(missing, _send(client, [calls[i] for i in missing]), strict=True):
            replies[i] = reply
    for reply in replies:
        if isinstance(reply, Exception):
            raise reply
    return replies


def _send(client: RedisCluster, calls: Sequence[ScriptCall]) -> list[Any]:
    pipe = client.pipeline(transaction=False)
    for script, keys, args in calls:
        script(keys=keys, args=args, client=pipe)
    return pipe.execute(raise_on_error=False)  # type: ignore[no-any-return]
