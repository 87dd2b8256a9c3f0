"""MoE and gpt-oss's attention sinks on CUDA (issue 45; skipped without CUDA).

- The MoE block captures in a CUDA graph and its replay equals the eager block, in bf16
  (torch's grouped GEMM) and fp16 (the fixed-shape forms `moe_cuda` records when the grouped
  GEMM cannot run), at decode and wider row counts; the bf16 eager block makes no host sync
  (``torch.cuda.set_sync_debug_mode("error")``).
- A Qwen3-MoE engine with graphs gives the same bf16 tokens as with ``--enforce-eager``.
- FlashInfer's decode wrapper (eager and CUDA-graph) with sinks equals the torch backend's
  sink attention, which checks the base of the log-sum-exp `flashinfer_sinks` rescales with.
- gpt-oss loads on CUDA: float32 on the torch backend equals transformers token for token,
  and bf16 FlashInfer agrees with the bf16 torch backend until a near-tie.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from cuda_testing import (
    KERNEL_SHAPE,
    cuda_decode_case,
    cuda_engine,
    needs_cuda,
    needs_flashinfer,
)
from greedy_compare import assert_close_until_near_tie, drive
from models import build_tiny_model, hf_greedy

from mstar.engine.model.moe import MoeBlock, MoeSpec
from mstar.engine.sampling_params import SamplingParams
from mstar.kernels import FlashInferPagedAttention, TorchPagedAttention

pytestmark = needs_cuda

HIDDEN, INTER, EXPERTS, TOP_K = 256, 128, 16, 4
PROMPTS = [[3 + (i * 7 + j * 3) % 90 for j in range(n)] for i, n in enumerate([2, 9, 17, 30])]
NEW = 16
#: head_dim 64 (FlashInfer's prebuilt kernels), hidden 256
HD64 = dict(hidden_size=256, head_dim=64, num_attention_heads=4, num_key_value_heads=2)


def _block(model_type: str, dtype: torch.dtype) -> MoeBlock:
    cfg = {"model_type": model_type, "hidden_size": HIDDEN, "moe_intermediate_size": INTER,
           "intermediate_size": INTER, "num_experts": EXPERTS, "num_local_experts": EXPERTS,
           "num_experts_per_tok": TOP_K, "norm_topk_prob": True}  # fmt: skip
    block = MoeBlock(MoeSpec.from_config(cfg), dtype, "cuda")
    gen = torch.Generator(device="cuda").manual_seed(3)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, device="cuda") * p.shape[-1] ** -0.5)
    return block


@pytest.mark.parametrize("tokens", [1, 4, 32])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("model_type", ["qwen3_moe", "gpt_oss"])
def test_moe_block_graph_replay_equals_eager(
    model_type: str, dtype: torch.dtype, tokens: int
) -> None:
    block = _block(model_type, dtype)
    x = torch.randn(tokens, HIDDEN, device="cuda", dtype=dtype)
    eager = block(x)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        block(x)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = block(x)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.testing.assert_close(out, block(x), atol=2e-2, rtol=2e-2)
    assert not torch.allclose(out, eager, atol=1e-2)  # the replay read the new input
    if dtype == torch.bfloat16:
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            block(x)  # router top-k and grouped GEMM: no host sync
        finally:
            torch.cuda.set_sync_debug_mode("default")


@needs_flashinfer
def test_qwen3_moe_engine_graphs_equal_eager(tmp_path: Path) -> None:
    folder = build_tiny_model(tmp_path, "qwen3_moe", **HD64)
    greedy = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    eager = cuda_engine(folder, attention_backend="flashinfer", enforce_eager=True)
    fast = cuda_engine(folder, attention_backend="flashinfer", cuda_graph_batch_sizes=[1, 2, 4])
    graphs = fast.model_runner.graphs
    assert graphs is not None and graphs.num_graphs == 6
    assert fast.generate(PROMPTS, greedy) == eager.generate(PROMPTS, greedy)
    assert graphs.replays > 0


@needs_flashinfer
def test_flashinfer_sinks_equal_the_torch_backend() -> None:
    pool, q, plan = cuda_decode_case([37, 200, 5, 64], seed=4)
    sinks = torch.randn(KERNEL_SHAPE["num_qo_heads"], device="cuda") + 2.0
    ref = TorchPagedAttention("cuda")
    ref.plan(*plan, **KERNEL_SHAPE)
    want = ref.run(q, pool, 0, sinks).float()
    fi = FlashInferPagedAttention("cuda", torch.bfloat16)
    graph_decode = fi.graph_decode(q.shape[0], max_pages=128)  # before the first plan
    fi.plan(*plan, **KERNEL_SHAPE)
    torch.testing.assert_close(fi.run(q, pool, 0, sinks).float(), want, atol=2e-2, rtol=2e-2)
    assert not torch.allclose(fi.run(q, pool).float(), want, atol=5e-2)  # sinks mattered
    graph_decode.plan(*plan, **KERNEL_SHAPE)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture
        graph_decode.run(q, pool, 0, sinks)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = graph_decode.run(q, pool, 0, sinks)
    graph.replay()
    torch.testing.assert_close(out.float(), want, atol=2e-2, rtol=2e-2)


def test_gpt_oss_float32_torch_backend_matches_transformers(tmp_path: Path) -> None:
    folder = build_tiny_model(tmp_path, "gpt_oss", **HD64)
    engine = cuda_engine(folder, dtype="float32", attention_backend="torch")
    greedy = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    assert engine.generate(PROMPTS, greedy) == hf_greedy(folder, PROMPTS, NEW)


@needs_flashinfer
def test_gpt_oss_bf16_flashinfer_matches_torch_until_a_near_tie(tmp_path: Path) -> None:
    folder = build_tiny_model(tmp_path, "gpt_oss", **HD64)
    params = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True, logprobs=2)
    ref = cuda_engine(folder, attention_backend="torch", enforce_eager=True)
    fast = cuda_engine(folder, attention_backend="flashinfer")
    compared, worst = assert_close_until_near_tie(
        drive(ref, PROMPTS, params), drive(fast, PROMPTS, params)
    )
    print(f"gpt-oss bf16 flashinfer vs torch: {compared} tokens, max |dlogprob| = {worst:.4f}")
    assert compared >= len(PROMPTS) * NEW // 2
