"""CUDA-graph bookkeeping on CPU: bucket choice, eager fallback, slot rotation, padding ids,
sink-page padding of a decode layout, grow-only static buffers, the backend refusal, and what a
failed capture means."""

from __future__ import annotations

import pytest
import torch

from mstar.engine.batch import DECODE_WALK
from mstar.engine.config import EngineConfig, parse_cli_args, to_cli_args
from mstar.engine.cuda_graphs import (
    GraphCaptureError,
    SlotRotation,
    capture_failure,
    choose_bucket,
    decode_bucket,
    graphs_off_reason,
    pad_ids,
    slot_specs,
)
from mstar.engine.resources.attention import AttentionResource, pad_decode_layout
from mstar.engine.resources.kv import KVCache, KVConfig
from mstar.engine.resources.kv.plan import build_plan
from mstar.engine.resources.kv.stream import Stream
from mstar.engine.resources.positions import PositionsResource, pad_positions
from mstar.engine.resources.static_buffers import GrowOnlyBuffers
from mstar.engine.resources.step import BucketKey, ResourceStep, Segment, SlotLease, StepContext
from mstar.kernels import BackendUnavailable, TorchPagedAttention, resolve_attention_backend

SIZES = (1, 2, 4, 8, 16, 32, 64)


@pytest.mark.parametrize(
    "rows,bucket", [(1, 1), (2, 2), (3, 4), (5, 8), (9, 16), (33, 64), (64, 64), (65, None)]
)
def test_smallest_bucket_that_holds_the_rows(rows: int, bucket: int | None) -> None:
    assert choose_bucket(SIZES, rows) == bucket


def test_unsorted_sizes_and_zero_rows() -> None:
    assert choose_bucket((8, 2, 32), 3) == 8
    assert choose_bucket(SIZES, 0) is None


def test_eager_fallback_for_prefill_mixed_and_oversized_steps() -> None:
    assert decode_bucket(SIZES, 3, batched_decode=True) == BucketKey(DECODE_WALK, 4, 4)
    assert decode_bucket(SIZES, 3, batched_decode=False) is None  # prefill / mixed
    assert decode_bucket(SIZES, 100, batched_decode=True) is None  # above the largest


def test_graphs_off_reasons() -> None:
    on = dict(enforce_eager=False, sizes=SIZES, cuda=True, flashinfer=True, capture=True)
    assert graphs_off_reason(**on) is None  # type: ignore[arg-type]
    assert graphs_off_reason(**{**on, "enforce_eager": True}) == "--enforce-eager"  # type: ignore[arg-type]
    assert graphs_off_reason(**{**on, "sizes": ()}) == "no --cuda-graph-batch-sizes"  # type: ignore[arg-type]
    assert graphs_off_reason(**{**on, "cuda": False}) == "not a CUDA device"  # type: ignore[arg-type]
    assert "torch attention" in graphs_off_reason(**{**on, "flashinfer": False})  # type: ignore[arg-type,operator]
    # The CPU emulation (capture=False) needs neither CUDA nor FlashInfer.
    assert graphs_off_reason(**{**on, "cuda": False, "flashinfer": False, "capture": False}) is None  # type: ignore[arg-type]


def test_slots_rotate_globally_across_buckets() -> None:
    rot = SlotRotation(2)
    used = []
    for _ in range(5):  # whatever bucket each step picks, consecutive steps alternate
        slot = rot.peek()
        assert rot.peek() == slot  # peeking (a pre-plan, a refused declaration) takes nothing
        rot.take(slot)
        used.append(slot)
    assert used == [0, 1, 0, 1, 0]
    with pytest.raises(ValueError):
        SlotRotation(0)


def test_slot_specs_largest_bucket_first_two_slots_each() -> None:
    specs = slot_specs((1, 4, 2), 2)
    assert [(s.bucket.bs, s.slot) for s in specs] == [  # type: ignore[union-attr]
        (4, 0),
        (4, 1),
        (2, 0),
        (2, 1),
        (1, 0),
        (1, 1),
    ]


def test_padding_ids_are_per_slot_and_follow_the_real_rows() -> None:
    assert pad_ids(1, ["a", "b"], 4) == ["a", "b", "__pad1.2", "__pad1.3"]
    assert pad_ids(0, ["a"], 1) == ["a"]
    assert set(pad_ids(0, [], 2)).isdisjoint(pad_ids(1, [], 2))


def _decode_plan(lengths: dict[str, int], pages: dict[str, list[int]], ps: int = 4):  # type: ignore[no-untyped-def]
    streams = {}
    for rid, n in lengths.items():
        s = Stream()
        s.pages = list(pages[rid])
        s.stored_len = n
        streams[rid] = {"main": s}
    segs = [Segment(rid, "main", 1) for rid in lengths]
    return build_plan(segs, streams, ps, torch.device("cpu"))


def test_padded_rows_read_and_write_only_the_sink_page() -> None:
    plan = _decode_plan({"a": 5, "b": 3}, {"a": [3, 7], "b": [9]})
    lay = pad_decode_layout(plan, 4, sink_page=0)
    assert lay.qo_indptr.tolist() == [0, 1, 2, 3, 4]
    assert lay.kv_indptr.tolist() == [0, 2, 3, 4, 5]
    assert lay.kv_indices.tolist() == [3, 7, 9, 0, 0]  # the two pad rows: sink page only
    assert lay.kv_last_page_len.tolist() == [2, 4, 1, 1]
    # Real rows keep their slots; pad rows write slot 0 of page 0 and nothing else.
    assert lay.write_slots.tolist() == [7 * 4 + 1, 9 * 4 + 3, 0, 0]
    real_pages = {3, 7, 9}
    pad_slots = lay.write_slots[2:]
    assert not (set((pad_slots // 4).tolist()) & real_pages)
    assert pad_positions(plan.prefix_lens, 4).tolist() == [5, 3, 0, 0]


def test_all_padding_layout_for_capture_and_refusals() -> None:
    empty = build_plan((), {}, 4, torch.device("cpu"))
    lay = pad_decode_layout(empty, 2, sink_page=0)
    assert lay.kv_indptr.tolist() == [0, 1, 2] and lay.kv_indices.tolist() == [0, 0]
    with pytest.raises(ValueError, match="do not fit"):
        pad_decode_layout(_decode_plan({"a": 1, "b": 1}, {"a": [1], "b": [2]}), 1, 0)
    streams = {"a": {"main": Stream()}}
    streams["a"]["main"].pages = [1, 2]
    prefill = build_plan([Segment("a", "main", 5)], streams, 4, torch.device("cpu"))
    with pytest.raises(ValueError, match="only decode"):
        pad_decode_layout(prefill, 2, 0)


def test_static_buffers_grow_only_and_never_after_their_address_is_handed_out() -> None:
    bufs = GrowOnlyBuffers("cpu")
    big = bufs.ensure("ids", 64, torch.int64)
    assert bufs.ensure("ids", 8, torch.int64) is big  # a smaller bucket keeps the address
    grown = bufs.ensure("ids", 128, torch.int64)  # growing before use is allowed
    assert grown.numel() == 128
    view = bufs.get("ids", 16)
    assert view.data_ptr() == grown.data_ptr()  # smaller buckets slice the largest
    with pytest.raises(RuntimeError, match="handed out"):
        bufs.ensure("ids", 256, torch.int64)
    assert bufs.ensure("ids", 32, torch.int64) is grown
    with pytest.raises(RuntimeError, match="holds 128"):
        bufs.get("ids", 129)


def test_flashinfer_refused_when_missing_or_float32_and_auto_falls_back() -> None:
    cuda = torch.device("cuda")
    with pytest.raises(BackendUnavailable, match="not importable"):
        resolve_attention_backend("flashinfer", cuda, torch.bfloat16, available=False)
    with pytest.raises(BackendUnavailable, match="float32"):
        resolve_attention_backend("flashinfer", cuda, torch.float32, available=True)
    with pytest.raises(BackendUnavailable, match="CUDA device"):
        resolve_attention_backend("flashinfer", torch.device("cpu"), torch.bfloat16)
    assert resolve_attention_backend("flashinfer", cuda, torch.float16, available=True) == (
        "flashinfer"
    )
    assert resolve_attention_backend("auto", cuda, torch.bfloat16, available=True) == "flashinfer"
    assert resolve_attention_backend("auto", cuda, torch.float32, available=True) == "torch"
    assert resolve_attention_backend("auto", cuda, torch.bfloat16, available=False) == "torch"
    assert resolve_attention_backend("torch", cuda, torch.bfloat16, available=True) == "torch"


def test_auto_logs_its_choice(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("INFO", logger="mstar.kernels"):
        resolve_attention_backend("auto", torch.device("cpu"), torch.float32)
    assert "attention backend auto -> torch (not a CUDA device" in caplog.text


def test_gpu_flags_round_trip() -> None:
    cfg = EngineConfig(attention_backend="flashinfer", enforce_eager=True, enable_preplan=False)
    args = to_cli_args(cfg)
    assert args == ["--attention-backend", "flashinfer", "--enforce-eager", "--no-enable-preplan"]
    assert parse_cli_args(args) == cfg
    with pytest.raises(ValueError, match="--attention-backend must be one of"):
        EngineConfig(attention_backend="triton")


def test_resource_graph_buffers_keep_their_addresses_across_builds() -> None:
    cache = KVCache(KVConfig(num_layers=1, num_kv_heads=1, head_dim=4, num_pages=8, page_size=4))
    attn = AttentionResource(
        cache, TorchPagedAttention(), num_qo_heads=2, num_kv_heads=1, head_dim=4, sink_page=0
    )
    pos = PositionsResource()
    big = slot_specs((1, 2, 4), 2)
    for res in (attn, pos):
        res.build_cuda_graph_buffers(big, 4, 32)
    empty = build_plan((), {}, 4, torch.device("cpu"))

    def planned(lease: SlotLease) -> tuple[int, int, object]:
        ctx = StepContext([], DECODE_WALK, lease.slot, True, slot_lease=lease)
        ctx.plan_results["kv"] = empty
        a = attn.plan(ResourceStep(), ctx)
        p = pos.plan(ResourceStep(), ctx)
        (slots,) = a.write_slots  # type: ignore[union-attr]  # one KV group: one slot buffer
        assert slots.tolist() == [0] * lease.bucket.bs
        return slots.data_ptr(), p.data_ptr(), a.backends[0]  # type: ignore[union-attr]

    first = {spec: planned(spec) for spec in big}
    # A second, smaller build (another capturing runner) must not move or replace anything.
    for res in (attn, pos):
        res.build_cuda_graph_buffers(slot_specs((1, 2), 2), 2, 32)
    assert {spec: planned(spec) for spec in big} == first
    # Slots have separate buffers; buckets of one slot share (slice) them.
    s0, s1 = SlotLease(0, BucketKey(DECODE_WALK, 4, 4)), SlotLease(1, BucketKey(DECODE_WALK, 4, 4))
    assert first[s0][0] != first[s1][0]
    assert first[SlotLease(0, BucketKey(DECODE_WALK, 1, 1))][0] == first[s0][0]
    with pytest.raises(RuntimeError, match="handed out"):
        attn.build_cuda_graph_buffers(slot_specs((8,), 2), 8, 32)  # growing after use


def test_only_an_out_of_memory_capture_falls_back_to_eager() -> None:
    assert capture_failure(64, torch.cuda.OutOfMemoryError("CUDA out of memory")) is None
    overflow = RuntimeError("Buffer overflow when allocating memory for batch_prefill_tmp_v")
    err = capture_failure(64, overflow)
    assert isinstance(err, GraphCaptureError)
    msg = str(err)
    assert "decode batch size 64" in msg and "Buffer overflow" in msg
    assert "--enforce-eager" in msg
    assert "RuntimeError" in str(capture_failure(8, RuntimeError("operation not permitted")))
