"""Block keys: the compiled chain (protos/csrc/chain_keys.c), the hashlib path and an
independent one-shot hashlib reference agree bit for bit; bad input raises ValueError on
both paths; the loader falls back to hashlib when it cannot build, and concurrent
builders share one library."""

from __future__ import annotations

import ctypes
import ctypes.util
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv.protos import keys, keys_native
from pagedkv.protos.keys import KEY_BYTES, chain_keys, chain_keys_python, root_key
from pagedkv.protos.keys_native import get_chain

NATIVE = get_chain()
needs_native = pytest.mark.skipif(NATIVE[0] is None, reason=f"compiled keys unavailable: {NATIVE[1].detail}")
INT64 = st.integers(-(2**63), 2**63 - 1)


def reference(parent: bytes, tokens: list[int], block_size: int, start_block: int) -> list[bytes]:
    """The definition, hashed one block at a time over the concatenated bytes."""
    out = []
    for b in range(start_block, len(tokens) // block_size):
        block = tokens[b * block_size : (b + 1) * block_size]
        data = parent + b"".join(t.to_bytes(8, "little", signed=True) for t in block)
        parent = hashlib.sha256(data).digest()[:16]
        out.append(parent)
    return out


@needs_native
@settings(max_examples=300, deadline=None)
@given(
    tokens=st.lists(INT64, max_size=200),
    block_size=st.sampled_from([1, 8, 16, 17]),
    salt=st.binary(max_size=24),
    start_block=st.integers(0, 5),
)
def test_compiled_equals_python_equals_hashlib(tokens, block_size, salt, start_block) -> None:
    parent = root_key(salt)
    if start_block:  # a chain that continues from an earlier block's key
        parent = hashlib.sha256(parent + b"earlier").digest()[:16]
    expected = reference(parent, tokens, block_size, start_block)
    assert chain_keys_python(parent, tokens, block_size, start_block) == expected
    assert chain_keys(parent, tokens, block_size, start_block) == expected  # list entry point
    array = np.array(tokens, dtype=np.int64)
    assert chain_keys(parent, array, block_size, start_block) == expected  # packed-bytes entry point
    assert chain_keys(parent, tuple(tokens), block_size, start_block) == expected


@needs_native
def test_long_chains_and_message_lengths_around_sha256_blocks() -> None:
    # 16 + 8 * bs bytes per key; SHA-256 pads into a new 64-byte block from 56 bytes on: bs 4
    # (48 bytes) fits one block, 5 (56) needs two, 6 (64) is exactly one before its padding
    # block, 12 (112) needs two, 13 (120) three.
    rng = np.random.default_rng(7)
    for block_size in (1, 4, 5, 6, 12, 13, 16, 29, 64, 256):
        tokens = rng.integers(-(2**63), 2**63 - 1, size=block_size * 41 - 1, dtype=np.int64).tolist()
        parent = root_key(f"salt-{block_size}")
        expected = reference(parent, tokens, block_size, 0)
        assert len(expected) == 40
        assert chain_keys(parent, tokens, block_size) == expected
        assert chain_keys(expected[38], tokens, block_size, 39) == expected[39:]


def test_keys_are_pinned_across_versions_and_machines() -> None:
    # Any change to the key function breaks every cache and index that outlives a deploy
    # (SHA-256-128 since 0.1.0's keys moved off BLAKE2b: hardware SHA on the hosts we run).
    assert chain_keys(root_key(b""), list(range(40)), 16)[1].hex() == "2cd0964bb28e440f94d54309f9edce1d"
    tokens = [-1, 2**63 - 1, -(2**63), 7]
    assert chain_keys(root_key("tenant-a"), tokens, 2)[1].hex() == "a87f842fda13ab2e0c1ddd4fa17a1141"
    assert chain_keys_python(root_key("tenant-a"), tokens, 2)[1].hex() == "a87f842fda13ab2e0c1ddd4fa17a1141"


def test_salts_separate_tenants_and_partial_blocks_get_no_key() -> None:
    tokens = list(range(33))
    a, b = chain_keys(root_key("a"), tokens, 16), chain_keys(root_key("b"), tokens, 16)
    assert len(a) == len(b) == 2 and not set(a) & set(b)
    assert chain_keys(root_key(), tokens[:15], 16) == []
    assert chain_keys(root_key(), tokens, 16, start_block=2) == []
    assert all(len(k) == KEY_BYTES for k in a)


@pytest.mark.parametrize("fn", [chain_keys, chain_keys_python], ids=["chain_keys", "python"])
@pytest.mark.parametrize(
    "tokens",
    [[1, 2, "x", 4], [1, 2, 2**63, 4], [1.5, 2, 3, 4], [None] * 4],
    ids=["str", "big", "float", "none"],
)
def test_bad_token_ids_raise_value_error(fn, tokens) -> None:
    with pytest.raises(ValueError, match="int64"):
        fn(root_key(), tokens, 2)


@pytest.mark.parametrize("fn", [chain_keys, chain_keys_python], ids=["chain_keys", "python"])
@pytest.mark.parametrize(
    "args", [(root_key(), 0, 0), (root_key(), -3, 0), (root_key(), 4, -1), (b"short", 4, 0)]
)
def test_bad_sizes_raise_value_error(fn, args) -> None:
    parent, block_size, start_block = args
    with pytest.raises(ValueError, match="block_size"):
        fn(parent, list(range(16)), block_size, start_block)


def test_a_list_that_is_not_a_list_of_ints_changes_nothing() -> None:
    tokens = list(range(32))
    tokens[20] = "bad"
    before = list(tokens)
    with pytest.raises(ValueError):
        chain_keys(root_key(), tokens, 16)
    assert tokens == before
    assert chain_keys(root_key(), list(range(32)), 16) == reference(root_key(), list(range(32)), 16, 0)


# -- the loader ------------------------------------------------------------------------

PROBE = (
    "import json; from pagedkv.protos import keys_native, keys;"
    "fn, info = keys_native.get_chain();"
    "print(json.dumps({'native': fn is not None, 'detail': info.detail,"
    " 'key': keys.chain_keys(keys.root_key(b's'), list(range(48)), 16)[-1].hex()}))"
)


def probe(env_extra: dict[str, str], kernel_dir: Path) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if k != "PAGEDKV_PURE_KEYS"}
    env.update(PAGEDKV_KERNEL_DIR=str(kernel_dir), **env_extra)
    return subprocess.Popen([sys.executable, "-c", PROBE], env=env, stdout=subprocess.PIPE, text=True)


def result(proc: subprocess.Popen[str]) -> dict:
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0
    return json.loads(out)


EXPECTED_KEY = reference(root_key(b"s"), list(range(48)), 16, 0)[-1].hex()


def test_pure_python_fallback_when_asked_or_when_the_compiler_fails(tmp_path: Path) -> None:
    pure = result(probe({"PAGEDKV_PURE_KEYS": "1"}, tmp_path / "a"))
    assert not pure["native"] and "PAGEDKV_PURE_KEYS" in pure["detail"] and pure["key"] == EXPECTED_KEY
    broken = result(probe({"CC": "/bin/false"}, tmp_path / "b"))
    assert not broken["native"] and "failed" in broken["detail"] and broken["key"] == EXPECTED_KEY
    missing = result(probe({"CC": str(tmp_path / "no-such-cc")}, tmp_path / "c"))
    assert not missing["native"] and missing["key"] == EXPECTED_KEY


@needs_native
def test_an_empty_or_relative_cache_directory_still_loads(tmp_path: Path) -> None:
    for value, cwd in (("", tmp_path), ("rel", tmp_path)):
        env = {k: v for k, v in os.environ.items() if k != "PAGEDKV_PURE_KEYS"}
        env.update(PAGEDKV_KERNEL_DIR=value, XDG_CACHE_HOME=str(tmp_path / "xdg"))
        out = subprocess.run([sys.executable, "-c", PROBE], env=env, cwd=cwd, capture_output=True, text=True)
        got = json.loads(out.stdout)
        assert got["native"] and got["key"] == EXPECTED_KEY, got
    assert not list(tmp_path.glob("*.so"))  # nothing built into the working directory


@needs_native
def test_concurrent_builders_share_one_library(tmp_path: Path) -> None:
    procs = [probe({}, tmp_path) for _ in range(3)]
    results = [result(p) for p in procs]
    assert all(r["native"] and r["key"] == EXPECTED_KEY for r in results)
    assert [p.name for p in tmp_path.iterdir()] == [Path(results[0]["detail"].split()[0]).name]
    again = result(probe({}, tmp_path))  # loaded from the disk cache: no build
    assert again["native"] and "built with" not in again["detail"]


def test_the_module_uses_what_the_loader_reports() -> None:
    assert (keys._native is None) == (NATIVE[0] is None)


@settings(max_examples=60, deadline=None)
@given(
    tokens=st.lists(INT64, max_size=70),
    block_size=st.sampled_from([1, 8, 16, 17]),
    native=st.booleans(),
)
def test_packed_keys_are_the_chain_concatenated_from_any_int_source(tokens, block_size, native) -> None:
    """chain_keys_packed == b"".join(chain_keys) whether the ids come as a list, an int
    array or a protobuf repeated field (what the coordinator passes), compiled or not."""
    from pagedkv.protos import pagedkv_pb2 as pb

    parent = root_key(b"tenant")
    want = b"".join(reference(parent, tokens, block_size, 0))
    field = pb.CoordOpenRequest(token_ids=tokens).token_ids
    saved = keys._native
    keys._native = saved if native else None
    try:
        for source in (tokens, np.array(tokens, dtype=np.int64), field):
            assert keys.chain_keys_packed(parent, source, block_size) == want
    finally:
        keys._native = saved


@pytest.mark.parametrize(
    "tokens", [[1.5, 2.0], ["a", "b"], np.zeros((2, 2), np.int64), np.array([2**64 - 1], np.uint64)]
)
def test_packed_keys_refuse_what_is_not_int64_ids(tokens) -> None:
    with pytest.raises(ValueError, match="token ids must be ints"):
        keys.chain_keys_packed(root_key(b""), tokens, 1)


def test_without_libcrypto_the_chain_is_not_used(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(keys_native, "_libcrypto", lambda: None)
    chain, info = keys_native._load()
    assert chain is None and not info.is_available and "libcrypto" in info.detail


@needs_native
def test_a_library_whose_key_disagrees_with_hashlib_is_not_used(monkeypatch: pytest.MonkeyPatch) -> None:
    """The loader checks one key against hashlib before using the library: handed another
    digest (SHA-224, the same context layout), it refuses it."""
    name = ctypes.util.find_library("crypto")
    if name is None:
        pytest.skip("no libcrypto found by name")
    crypto = ctypes.CDLL(name)
    monkeypatch.setattr(
        keys_native, "_libcrypto", lambda: (crypto.SHA224_Init, crypto.SHA224_Update, crypto.SHA224_Final)
    )
    try:
        chain, info = keys_native._load()
        assert chain is None and "disagrees" in info.detail
    finally:
        monkeypatch.undo()
        assert keys_native._load()[0] is not None  # the shared library hashes with SHA-256 again
    assert chain_keys(root_key(b""), list(range(40)), 16)[1].hex() == "2cd0964bb28e440f94d54309f9edce1d"
