"""protos/prompt.py: which prompts pack into int32s, and what a packed field reads as."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedkv.client.codec import packed_prompt
from pagedkv.protos import pagedkv_pb2 as pb
from pagedkv.protos.errors import InvalidArgument
from pagedkv.protos.prompt import pack, tokens_of

EDGES = [0, 1, -1, 2**31 - 1, -(2**31)]


@pytest.mark.parametrize(
    "source",
    [EDGES, tuple(EDGES), np.asarray(EDGES), np.asarray(EDGES, np.int32), torch.tensor(EDGES)],
    ids=["list", "tuple", "int64 array", "int32 array", "tensor"],
)
def test_ids_that_fit_pack_and_read_back_exactly(source) -> None:
    packed = packed_prompt(source)
    assert packed is not None and len(packed) == 4 * len(EDGES)
    msg = pb.CoordOpenRequest.FromString(pb.CoordOpenRequest(packed_token_ids=packed).SerializeToString())
    assert tokens_of(msg, "t").tolist() == EDGES


@pytest.mark.parametrize(
    "source",
    [[2**31], [-(2**31) - 1], [1, True], [1, 2.0], ["1"], [2**63], np.asarray([2**40]), np.asarray([True])],
)
def test_what_does_not_fit_or_is_not_an_int_is_left_to_the_varint_field(source) -> None:
    assert pack(source) is None


def test_a_two_dimensional_batch_of_one_is_flattened() -> None:
    assert packed_prompt(torch.tensor([[5, 6, 7]])) == np.asarray([5, 6, 7], "<i4").tobytes()


def test_a_message_with_both_encodings_or_ragged_bytes_is_refused_by_name() -> None:
    with pytest.raises(InvalidArgument, match="Open: token_ids and packed_token_ids are both set"):
        tokens_of(pb.CoordOpenRequest(token_ids=[1], packed_token_ids=b"\0" * 4), "Open")
    with pytest.raises(InvalidArgument, match="6 bytes, not whole int32s"):
        tokens_of(pb.CoordOpenRequest(packed_token_ids=b"\0" * 6), "Open")
    assert list(tokens_of(pb.CoordOpenRequest(token_ids=[3, 4]), "Open")) == [3, 4]
