"""FlashInfer workspace sizing: the split-KV scratch bound, worked by hand for real shapes."""

from __future__ import annotations

import pytest

from mstar.kernels.flashinfer_workspace import (
    MIB,
    eager_scratch_bytes,
    fa2_cta_tile_q,
    graph_decode_scratch_bytes,
    workspace_bytes,
)

H200_SMS = 132


@pytest.mark.parametrize(
    "packed,head_dim,tile",
    [(3, 64, 16), (16, 128, 16), (17, 128, 64), (64, 64, 64), (65, 128, 128), (65, 256, 64)],
)
def test_cta_tile_q_follows_flashinfer(packed: int, head_dim: int, tile: int) -> None:
    assert fa2_cta_tile_q(packed, head_dim) == tile


def test_graph_bucket_64_of_a_64_head_model_needs_more_than_32_mib() -> None:
    # 64 q / 8 kv heads, head_dim 128: group 8 -> 16-row tiles; ceil(64*8/16) + 63 = 95 work
    # items (more than 2*132//8 = 33); 64 heads x 95 x 16 rows x (128 + 1) floats x 4 bytes.
    need = graph_decode_scratch_bytes(64, 8, 128, H200_SMS, 64)
    assert need == 64 * 95 * 16 * 129 * 4 + 32
    assert need > 32 * MIB  # the old fixed graph workspace: the bucket's capture failed


def test_small_buckets_are_bounded_by_the_split_limit() -> None:
    # SmolLM2: 9 q / 3 kv heads, head_dim 64; bucket 1 pads to 2*132//3 = 88 items.
    assert graph_decode_scratch_bytes(9, 3, 64, H200_SMS, 1) == 9 * 88 * 16 * 65 * 4 + 32
    assert graph_decode_scratch_bytes(9, 3, 64, H200_SMS, 8) == 9 * 88 * 16 * 65 * 4 + 32


def test_eager_bound_takes_the_largest_tile() -> None:
    assert eager_scratch_bytes(9, 3, 64, H200_SMS) == 9 * 88 * 128 * 65 * 4 + 32
    assert eager_scratch_bytes(8, 1, 256, H200_SMS) == 8 * 264 * 64 * 257 * 4 + 32


def test_workspace_is_whole_mib_covering_eager_and_the_largest_bucket() -> None:
    for shape in [(9, 3, 64), (64, 8, 128), (32, 32, 128), (8, 1, 256)]:
        for bs in (0, 1, 64, 256):
            size = workspace_bytes(*shape, H200_SMS, bs)
            assert size % MIB == 0
            assert size >= eager_scratch_bytes(*shape, H200_SMS)
            if bs:
                assert size >= graph_decode_scratch_bytes(*shape, H200_SMS, bs)
    # A 64-head model at bucket 256 is sized by the graph bound, not the eager one.
    assert workspace_bytes(64, 8, 128, H200_SMS, 256) > workspace_bytes(64, 8, 128, H200_SMS, 0)


@pytest.mark.parametrize(
    "args,msg",
    [
        ((9, 2, 64, H200_SMS), "not a multiple"),
        ((0, 1, 64, H200_SMS), "positive"),
        ((8, 8, 64, 0), "positive"),
    ],
)
def test_bad_shapes_are_refused(args: tuple[int, int, int, int], msg: str) -> None:
    with pytest.raises(ValueError, match=msg):
        eager_scratch_bytes(*args)
    with pytest.raises(ValueError, match=msg):
        graph_decode_scratch_bytes(*args, 8)


def test_graph_batch_must_be_positive() -> None:
    with pytest.raises(ValueError, match="batch_size"):
        graph_decode_scratch_bytes(8, 8, 64, H200_SMS, 0)
