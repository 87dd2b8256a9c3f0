"""The CUDA KV write's plan arithmetic (`flashinfer_kv_write`), on CPU tensors.

Each step's ``append_paged_kv_cache`` arrays (row and position of every new token, the page
table) are computed once on the host from the KV plan; FlashInfer's write contract in torch
(`append_kv_reference`) over them must put every K/V row exactly where the slot-based write
(`write_kv`, what CPU serving runs) puts it: mixed prefill/decode batches across page
boundaries, padded CUDA-graph layouts (pad rows on the sink page), and a static buffer's
fixed offsets. Then the engine's wiring: the attention resource planning the layouts once a
step, every layer writing through them (eager and the padded graph path), greedy tokens equal
to transformers.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch
from models import hf_greedy

from mstar.engine.config import EngineConfig
from mstar.engine.engine import LLMEngine
from mstar.engine.resource_keys import ATTN
from mstar.engine.resources.attention import pad_decode_layout
from mstar.engine.resources.kv import KVCacheResource, KVConfig, KVPlan
from mstar.engine.resources.step import ADMIT_OK, ResourceStep, Segment, StepContext
from mstar.engine.sampling_params import SamplingParams
from mstar.kernels import write_kv
from mstar.kernels.flashinfer_kv_write import (
    KVAppend,
    append_kv_reference,
    append_rows,
    stage_append_layout,
    static_append_size,
)

CTX = StepContext(request_ids=[], graph_walk="mixed", slot=0, capture=False)
PS, HEADS, DIM, PAGES = 4, 2, 3, 48
CPU = torch.device("cpu")


def _plans(seed: int, steps: int = 4) -> list[KVPlan]:
    """Random mixed steps over a real KV resource: prompts of 1-11 tokens, decodes, commits."""
    rng = random.Random(seed)
    config = KVConfig(num_layers=1, num_kv_heads=HEADS, head_dim=DIM, num_pages=PAGES,
                      page_size=PS, reserve_sink_page=True)  # fmt: skip
    kv = KVCacheResource(config)
    rids = [f"r{i}" for i in range(5)]
    for rid in rids:
        kv.ingest_request(rid)
    plans = []
    started: set[str] = set()
    for _ in range(steps):
        segs = []
        for rid in rng.sample(rids, rng.randint(1, len(rids))):
            segs.append(Segment(rid, "main", 1 if rid in started else rng.randint(1, 11)))
            started.add(rid)
        st = ResourceStep(segments=tuple(segs))
        assert kv.admit(st, CTX) is ADMIT_OK
        plans.append(kv.plan(st, CTX))
        kv.commit(st, CTX)
    return plans


def _kv(tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    # strided views of one QKV-like row, as the layers hand them over
    qkv = torch.randn(tokens, 3 * HEADS, DIM, generator=gen)
    return qkv[:, HEADS : 2 * HEADS], qkv[:, 2 * HEADS :]


def _both_writes(layout_args: tuple, slots: torch.Tensor, seed: int, first_page: int = 0) -> None:
    """Both writes of the same rows agree on every page from ``first_page`` (a padded layout's
    rows all write the sink page 0, in no defined order on a GPU)."""
    tokens = slots.numel()
    k, v = _kv(tokens, seed)
    by_slots = torch.zeros(PAGES, 2, PS, HEADS, DIM)
    write_kv(by_slots, k, v, slots)
    appended = torch.zeros_like(by_slots)
    layout = stage_append_layout(*layout_args, PS, CPU)
    KVAppend(append_kv_reference)(appended, k, v, layout)
    assert torch.equal(appended[first_page:], by_slots[first_page:])
    assert appended[first_page:].abs().sum() > 0


def test_rows_and_positions_of_a_mixed_step() -> None:
    # rows of 1 (decode at a page start), 3 (prefill) and 1 (decode mid-page) new tokens
    qo = torch.tensor([0, 1, 4, 5], dtype=torch.int32)
    kv_indptr = torch.tensor([0, 2, 3, 5], dtype=torch.int32)
    last = torch.tensor([1, 3, 2], dtype=torch.int32)
    rows, positions = append_rows(qo, kv_indptr, last, PS)
    assert rows.tolist() == [0, 1, 1, 1, 2]
    assert positions.tolist() == [4, 0, 1, 2, 5]
    assert rows.dtype == positions.dtype == torch.int32


def test_append_layout_writes_where_the_slots_do() -> None:
    for seed in range(4):
        for i, plan in enumerate(_plans(seed)):
            args = (plan.qo_indptr, plan.kv_indptr, plan.kv_indices, plan.kv_last_page_len)
            _both_writes(args, plan.write_slots, seed * 10 + i)


def test_padded_graph_layout_writes_the_sink_page_in_a_static_buffer() -> None:
    sink, bs = 0, 8
    plan = _plans(3, steps=3)[-1]
    if not plan.is_decode:  # the last step of seed 3 is all decodes; keep the test honest
        raise AssertionError("expected a decode step")
    lay = pad_decode_layout(plan, bs, sink)
    static = torch.full((static_append_size(bs, bs * 4),), -1, dtype=torch.int32)
    args = (lay.qo_indptr, lay.kv_indptr, lay.kv_indices, lay.kv_last_page_len)
    layout = stage_append_layout(*args, PS, CPU, static)
    assert layout.batch_indices.data_ptr() == static.data_ptr()  # fixed offsets in the buffer
    assert layout.kv_indices.numel() == static.numel() - (4 * bs + 1)
    n = len(plan.request_ids)
    assert layout.positions[n:].tolist() == [0] * (bs - n)  # pad rows: entry 0 of the sink
    _both_writes(args, lay.write_slots, 7, first_page=sink + 1)


GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 6, 7], [40, 41, 42, 43, 44, 45, 46, 47, 48], [9]]


def _append_engine(folder: Path) -> tuple[LLMEngine, KVAppend]:
    """The tiny model on torch ops with every layer's KV write through the reference append."""
    cfg = EngineConfig(model=str(folder), dtype="float32", device="cpu", num_pages=64,
                       page_size=4, attention_backend="torch")  # fmt: skip
    engine = LLMEngine.from_config(cfg)
    engine.decoder.cpu_kernels = None
    engine.decoder.fused_decode = None
    writer = KVAppend(append_kv_reference)
    engine.model_runner.runner.resources[ATTN].kv_append = writer  # type: ignore[attr-defined]
    return engine, writer


def test_engine_writes_every_layer_through_the_planned_append(tiny_llama_dir: Path) -> None:
    engine, writer = _append_engine(tiny_llama_dir)
    assert engine.generate(PROMPTS, GREEDY) == hf_greedy(tiny_llama_dir, PROMPTS, 10)
    steps = writer.calls // engine.model_config.num_layers
    assert steps >= 10 and writer.calls == steps * engine.model_config.num_layers
    engine.kv.assert_pages_conserved()


def test_padded_graph_path_writes_through_the_static_append_buffers(
    tiny_llama_dir: Path,
) -> None:
    engine, writer = _append_engine(tiny_llama_dir)
    runner = engine.model_runner
    assert runner.setup_graphs((1, 2, 4), False, engine.max_model_len, capture=False) is None
    assert engine.generate(PROMPTS, GREEDY) == hf_greedy(tiny_llama_dir, PROMPTS, 10)
    assert runner.graphs is not None and runner.graphs.eager_runs > 0 and writer.calls > 0
    engine.kv.assert_pages_conserved()
