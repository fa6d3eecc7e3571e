"""The per-request scripts on kept connections (coordinator/kept_script.py), on a real
redis-server: the replies are redis-py's, a flushed script cache and a killed
connection are recovered within the call, a script error leaves the connection
usable, and concurrent callers never read each other's replies."""

from __future__ import annotations

import threading

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from pagedkv.coordinator.kept_script import MAX_IDLE, KeptScripts
from pagedkv.coordinator.records import NewSequence, NodeRoom
from pagedkv.coordinator.redis_store import RedisStore
from pagedkv.protos.errors import IntegrityError

pytestmark = pytest.mark.timeout(60)

ECHO = "return {ARGV[1], tonumber(ARGV[2]) * 2}"
SPEC = {"num_layers": 1, "num_kv_heads": 1, "head_dim": 8}


def _client(url: str, name: str | None = None) -> redis.Redis:
    """A client that retries a connection error once (RedisStore's own retries twice)."""
    return redis.Redis.from_url(
        url, retry=Retry(NoBackoff(), 1), retry_on_error=[redis.ConnectionError], client_name=name
    )


def test_replies_match_redis_py_script_calls(redis_url: str) -> None:
    client = _client(redis_url)
    script = client.register_script(ECHO)
    kept = KeptScripts(client)
    assert kept.run(script, [b"k\x00\xff", 21]) == script(args=[b"k\x00\xff", 21]) == [b"k\x00\xff", 42]
    kept.close()
    client.close()


def test_arguments_travel_as_redis_py_sends_them(redis_url: str) -> None:
    """KeptScripts packs with hiredis itself: str (UTF-8), bytes, a bytearray, int (past 64 bits)
    and float arrive as redis-py's own packing sends them; a bool is refused as redis-py does."""
    client = _client(redis_url)
    script = client.register_script("return ARGV")
    kept = KeptScripts(client)
    args = ["é\tx", b"\x00\xff", bytearray(b"ba"), -5, 2**70, 0.1, 1e300, 1 / 3]
    assert kept.run(script, args) == script(args=args)
    assert kept.run_many([(script, args), (script, [7])]) == [script(args=args), [b"7"]]
    with pytest.raises(redis.DataError):
        kept.run(script, [True])
    with pytest.raises(redis.DataError):
        script(args=[True])
    assert kept.run(script, ["still usable"]) == [b"still usable"]
    kept.close()
    client.close()


def test_noscript_after_script_flush_reloads_and_answers(redis_url: str) -> None:
    client = _client(redis_url)
    script = client.register_script(ECHO)
    kept = KeptScripts(client)
    assert kept.run(script, ["a", 1]) == [b"a", 2]
    client.script_flush()
    assert client.script_exists(script.sha) == [False]
    assert kept.run(script, ["b", 2]) == [b"b", 4]  # NOSCRIPT, loaded again, sent again
    assert client.script_exists(script.sha) == [True]
    kept.close()
    client.close()


def _evalsha_client_ids(r: redis.Redis, name: str) -> list[str]:
    """Connections of client `name` whose last command was EVALSHA (the server is shared with
    other tests, whose stores may still hold connections)."""
    return [str(c["id"]) for c in r.client_list() if c.get("cmd") == "evalsha" and c.get("name") == name]


def test_a_killed_kept_connection_is_retried_on_a_new_one(redis_url: str) -> None:
    client = _client(redis_url, "kept-killed")
    script = client.register_script(ECHO)
    kept = KeptScripts(client)
    killer = redis.Redis.from_url(redis_url)
    assert kept.run(script, ["a", 1]) == [b"a", 2]
    assert kept.run(script, ["b", 1]) == [b"b", 2]
    (first_id,) = _evalsha_client_ids(killer, "kept-killed")  # both calls went on the one kept connection
    assert killer.client_kill_filter(_id=first_id) == 1
    assert kept.run(script, ["c", 5]) == [b"c", 10]  # the dead socket fails, Retry reconnects it
    (second_id,) = _evalsha_client_ids(killer, "kept-killed")
    assert second_id != first_id
    kept.close()
    killer.close()
    client.close()


def test_a_script_error_raises_and_leaves_the_connection_clean(redis_url: str) -> None:
    client = _client(redis_url)
    bad = client.register_script("return redis.call('NOSUCHCOMMAND')")
    good = client.register_script(ECHO)
    kept = KeptScripts(client)
    with pytest.raises(redis.ResponseError):
        kept.run(bad, [])
    assert kept.run(good, ["x", 3]) == [b"x", 6]  # no stale reply left on the connection
    kept.close()
    client.close()


def _evalsha_and_loads(r: redis.Redis) -> tuple[int, int]:
    stats = r.info("commandstats")
    return stats.get("cmdstat_evalsha", {}).get("calls", 0), stats.get("cmdstat_script|load", {}).get(
        "calls", 0
    )


def test_run_many_pairs_every_reply_in_order_without_reloading(redis_url: str) -> None:
    client = _client(redis_url, "kept-many")
    echo = client.register_script(ECHO)
    count = client.register_script("return redis.call('INCR', ARGV[1])")
    kept = KeptScripts(client)
    assert kept.run_many([]) == []
    calls = [(echo, ["a", 1]), (count, ["many:n"]), (echo, ["b", 2]), (count, ["many:n"])]
    kept.run(echo, ["warm", 0])  # the kept connection exists and both scripts are loaded
    kept.run(count, ["many:warm"])
    before = _evalsha_and_loads(client)
    assert kept.run_many(calls) == [[b"a", 2], 1, [b"b", 4], 2]  # Redis ran them in order
    assert _evalsha_and_loads(client) == (before[0] + 4, before[1])  # 4 EVALSHA, no SCRIPT LOAD
    assert kept.run(echo, ["c", 3]) == [b"c", 6]  # the connection is clean after it
    kept.close()
    client.close()


def test_run_many_reloads_flushed_scripts_and_raises_a_script_error_after_every_reply(
    redis_url: str,
) -> None:
    client = _client(redis_url)
    echo = client.register_script(ECHO)
    count = client.register_script("return redis.call('INCR', ARGV[1])")
    bad = client.register_script("return redis.call('NOSUCHCOMMAND')")
    kept = KeptScripts(client)
    assert kept.run_many([(echo, ["a", 1]), (count, ["flushed:n"])]) == [[b"a", 2], 1]
    client.script_flush()
    assert kept.run_many([(echo, ["b", 1]), (count, ["flushed:n"])]) == [[b"b", 2], 2]  # sent again
    assert client.script_exists(echo.sha, count.sha) == [True, True]
    with pytest.raises(redis.ResponseError, match="NOSUCHCOMMAND|Unknown"):
        kept.run_many([(count, ["flushed:n"]), (bad, []), (count, ["flushed:n"])])
    assert client.get("flushed:n") == b"4"  # the calls around the error ran
    assert kept.run(echo, ["c", 3]) == [b"c", 6]  # and no reply was left unread
    kept.close()
    client.close()


def test_concurrent_callers_get_their_own_replies(redis_url: str) -> None:
    client = _client(redis_url)
    script = client.register_script(ECHO)
    kept = KeptScripts(client)
    wrong: list[tuple[int, object]] = []

    def caller(t: int) -> None:
        for i in range(200):
            n = t * 1000 + i
            reply = kept.run(script, [str(n), n])
            if reply != [str(n).encode(), 2 * n]:
                wrong.append((n, reply))

    threads = [threading.Thread(target=caller, args=(t,)) for t in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert wrong == []
    assert 1 <= len(kept._idle) <= min(8, MAX_IDLE)  # one kept connection per concurrent caller at most
    kept.close()
    assert kept._idle == []
    client.close()


def test_store_open_and_delete_survive_a_script_flush(redis_url: str) -> None:
    store = RedisStore(redis_url)
    store.register_node("n1", "a:1", SPEC, 10, 30.0)
    new = NewSequence("s1", "t", 4, 1, 4, bytes(16), (NodeRoom("n1", 10, 10),))
    assert store.open_sequence(new).node_id == "n1"
    redis.Redis.from_url(redis_url).script_flush()
    assert store.delete_sequence("s1").seq_id == "s1"
    assert store.open_sequence(new).node_id == "n1"
    assert store.match_prefix([bytes(16)]) == {"n1": 0}
    store.close()


def test_store_maps_a_script_error_to_integrity_error(redis_url: str) -> None:
    store = RedisStore(redis_url)
    store.register_node("n1", "a:1", SPEC, 10, 30.0)
    client = _client(redis_url)
    client.sadd(b"pkv:idx:" + bytes(16), "n1")  # the index names n1: its nkeys set is read
    client.set("pkv:nkeys:n1", "not a set")  # SMISMEMBER on a string: WRONGTYPE inside the script
    with pytest.raises(IntegrityError, match="match_prefix"):
        store.match_prefix([bytes(16)])
    client.delete("pkv:nkeys:n1")
    assert store.match_prefix([bytes(16)]) == {"n1": 0}  # the kept connection still answers
    store.close()
    client.close()


def test_a_forked_child_never_uses_the_parents_kept_connection(redis_url: str) -> None:
    import os

    client = _client(redis_url, "kept-forked")
    script = client.register_script(ECHO)
    kept = KeptScripts(client)
    assert kept.run(script, ["parent", 1]) == [b"parent", 2]
    pid = os.fork()
    if pid == 0:  # the child: a connection of its own, the parent's socket left alone
        ok = kept.run(script, ["child", 2]) == [b"child", 4]
        lister = redis.Redis.from_url(redis_url)
        ok = ok and len(_evalsha_client_ids(lister, "kept-forked")) == 2  # the parent's and the child's
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    for i in range(20):  # the parent's kept connection still pairs its replies
        assert kept.run(script, [f"p{i}", i]) == [f"p{i}".encode(), 2 * i]
    kept.close()
    client.close()
