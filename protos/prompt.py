"""A prompt's token ids in a message: repeated int64 varints, or packed little-endian int32s.

Packed is a copy on both ends where 32k varints take ~0.4 ms to parse and as long to
serialize; the client packs when every id fits in 32 bits (vocabularies do) and falls back
to the repeated field otherwise. No torch: the coordinator reads prompts too.
"""

from __future__ import annotations

import array
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from .errors import InvalidArgument

_INT32 = np.dtype("<i4")
PACKED_TOKEN_BYTES = _INT32.itemsize
_I32_MIN, _I32_MAX = -(2**31), 2**31 - 1
_ARRAY_CODE = "i" if array.array("i").itemsize == 4 else "l"  # "i" on every common platform


def pack(token_ids: Any) -> bytes | None:
    """The ids (a list, an integer array, any sequence of ints) as packed int32s, or None
    when one is not an int (a bool counts as not) or does not fit: the caller then sends the
    repeated field, which checks each id and says which is wrong."""
    if not isinstance(token_ids, np.ndarray):
        ids = token_ids if type(token_ids) is list else list(token_ids)
        try:  # array.array checks each id is an int in range, in C
            arr = array.array(_ARRAY_CODE, ids)
        except (TypeError, OverflowError):
            return None
        if bool in set(map(type, ids)):  # array.array takes True as 1; the repeated field refuses it
            return None
        if sys.byteorder == "big":
            arr.byteswap()
        return arr.tobytes()
    if token_ids.ndim != 1 or (token_ids.size and token_ids.dtype.kind not in "iu"):
        return None
    if token_ids.size and (int(token_ids.min()) < _I32_MIN or int(token_ids.max()) > _I32_MAX):
        return None
    return token_ids.astype(_INT32, copy=False).tobytes()


def tokens_of(message: Any, what: str) -> np.ndarray | Sequence[int]:
    """A message's prompt: its `packed_token_ids` as an int32 array (no copy), else its
    `token_ids` field as it is. InvalidArgument (naming `what`) when both are set or the
    packed bytes are not whole int32s."""
    packed = message.packed_token_ids
    if not packed:
        return message.token_ids  # type: ignore[no-any-return]
    if message.token_ids:
        raise InvalidArgument(f"{what}: token_ids and packed_token_ids are both set (send one)")
    if len(packed) % _INT32.itemsize:
        raise InvalidArgument(f"{what}: packed_token_ids holds {len(packed)} bytes, not whole int32s")
    return np.frombuffer(packed, _INT32)
