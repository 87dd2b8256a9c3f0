"""FP8 GEMMs and the fused RoPE / KV write on CUDA (skipped without a device: these are the
device script's checks; CPU CI covers the same contracts in torch in tests/unit/test_fp8.py,
test_cuda_ops.py and test_flashinfer_kv_write.py).

- ``torch._scaled_mm`` with per-token activation scales (what `Fp8Linear` runs on CUDA bf16)
  against the dequantized reference, odd token counts and the static-scale case included;
- a bf16 engine with ``--quantization fp8`` runs every projection through the FP8 GEMM and
  decodes within a token or two of the dequantized-weight engine;
- FlashInfer's in-place RoPE on the QKV output's strided Q/K views against the torch contract;
- FlashInfer's ``append_paged_kv_cache`` over the step's staged layout writes exactly what the
  slot-based write writes, for a mixed prefill/decode step and a padded graph layout.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from cuda_testing import build_hd64_llama, cuda_engine, needs_cuda, needs_flashinfer

from mstar.engine.model.cuda_ops import ReferenceFused
from mstar.engine.model.fp8 import Fp8Linear, quantize_activations, quantize_rows
from mstar.engine.model.linear import LinearSpec
from mstar.engine.model.rope import RotaryEmbedding
from mstar.engine.resources.attention import pad_decode_layout
from mstar.engine.resources.kv import KVCacheResource, KVConfig
from mstar.engine.resources.step import ADMIT_OK, ResourceStep, Segment, StepContext
from mstar.engine.sampling_params import SamplingParams
from mstar.kernels import fp8_quant, write_kv
from mstar.kernels.flashinfer_kv_write import stage_append_layout

pytestmark = [needs_cuda]
CUDA = torch.device("cuda")


def _fp8_linear(n: int, k: int, bias: bool) -> Fp8Linear:
    gen = torch.Generator().manual_seed(n + k)
    mod = Fp8Linear(LinearSpec("layers.0.o_proj", k, n, bias), torch.bfloat16, CUDA)
    q, s = quantize_rows(torch.randn(n, k, generator=gen).to(CUDA))
    mod.weight.data.copy_(q)
    mod.weight_scale.data.copy_(s)
    if mod.bias is not None:
        mod.bias.data.copy_(torch.randn(n, generator=gen).to(CUDA, torch.bfloat16))
    return mod


SHAPES = [
    (1, 4096, 4096, False),
    (7, 1024, 4096, True),
    (64, 14336, 4096, False),
    (3, 128, 64, True),
]


@pytest.mark.parametrize(("m", "n", "k", "bias"), SHAPES)
@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("triton", [False, True])
def test_scaled_mm_matches_the_dequantized_reference(
    m: int, n: int, k: int, bias: bool, static: bool, triton: bool
) -> None:
    mod = _fp8_linear(n, k, bias)
    if triton:
        mod.quantize = fp8_quant.load()
    x = torch.randn(m, k, device=CUDA).to(torch.bfloat16)
    want = torch.nn.functional.linear(x.float(), mod.dequantized(torch.float32),
                                      None if mod.bias is None else mod.bias.float())  # fmt: skip
    mod.fp8_gemm = True
    if static:
        mod.input_scale = (x.abs().max().float() / 448.0).reshape(())
    got = mod(x)
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    err = ((got.float() - want).norm() / want.norm()).item()
    print(f"fp8 [{m}x{k}] @ [{k}x{n}] static={static}: relative error {err:.4f}")
    assert err < 0.06


@pytest.mark.parametrize("k", [64, 576, 4096, 14336])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_quantizer_equals_the_torch_quantizer(k: int, dtype: torch.dtype) -> None:
    """The one-kernel per-token quantizer the FP8 GEMMs run, bit for bit against the torch ops
    (CPU CI can only run it under Triton's interpreter, whose e4m3 cast differs)."""
    quantize = fp8_quant.load()
    x = (torch.randn(33, 2 * k, device=CUDA) * 5).to(dtype)[:, :k]  # strided rows
    x[3] = 0
    for static in (None, torch.tensor(0.03, device=CUDA)):
        got_q, got_s = quantize(x, static)
        want_q, want_s = quantize_activations(x, static)
        assert torch.equal(got_s, want_s)
        assert torch.equal(got_q.view(torch.uint8), want_q.view(torch.uint8))


def test_quantization_fp8_engine_runs_fp8_gemms_and_tracks_the_reference(tmp_path: Path) -> None:
    folder = build_hd64_llama(tmp_path / "llama")
    prompts = [[5, 6, 7, 8], [40 + i for i in range(20)], [9, 3]]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    # eager: the second run must not replay graphs captured over the FP8 GEMMs
    engine = cuda_engine(folder, quantization="fp8", enforce_eager=True)
    linears = [m for m in engine.decoder.modules() if isinstance(m, Fp8Linear)]
    assert linears and all(m.fp8_gemm for m in linears)
    assert all(m.quantize is not quantize_activations for m in linears)  # Triton's kernel
    got = engine.generate(prompts, params)
    engine.kv.assert_pages_conserved()
    for m in linears:  # the same FP8 weights, dequantized: weight-only quantization
        m.fp8_gemm = False
    want = engine.generate(prompts, params)
    same = sum(a == b for g, w in zip(got, want, strict=True) for a, b in zip(g, w, strict=True))
    print(f"fp8 GEMM vs dequantized weights: {same} of {12 * len(prompts)} tokens equal")
    assert [g[0] for g in got] == [w[0] for w in want]
    assert same >= 0.75 * 12 * len(prompts)


@needs_flashinfer
def test_flashinfer_rope_on_strided_qk_views_matches_the_contract() -> None:
    import flashinfer

    table = RotaryEmbedding(128, 4096, 500000.0, dtype=torch.bfloat16, device=CUDA)
    hq, hkv, d = 32, 8, 128
    qkv = torch.randn(9, (hq + 2 * hkv) * d, device=CUDA).to(torch.bfloat16)
    positions = torch.tensor([0, 1, 2, 900, 901, 4095, 17, 18, 3000], device=CUDA)
    want = qkv.clone()
    q = want[:, : hq * d].view(9, hq, d)
    k = want[:, hq * d : (hq + hkv) * d].view(9, hkv, d)
    ReferenceFused.apply_rope_with_cos_sin_cache_inplace(positions, q, k, d, table.cos_sin_cache())
    got = qkv.clone()
    qk = got[:, : (hq + hkv) * d].view(9, hq + hkv, d)
    flashinfer.rope.apply_rope_with_cos_sin_cache_inplace(
        positions, qk[:, :hq], qk[:, hq:], d, table.cos_sin_cache(), True
    )
    torch.testing.assert_close(got, want, atol=2e-2, rtol=1e-2)
    assert torch.equal(got[:, (hq + hkv) * d :], qkv[:, (hq + hkv) * d :])  # V untouched


@needs_flashinfer
def test_flashinfer_append_writes_where_the_slots_do() -> None:
    import flashinfer

    ps, heads, dim, pages = 16, 8, 128, 64
    kv = KVCacheResource(KVConfig(num_layers=1, num_kv_heads=heads, head_dim=dim,
                                  num_pages=pages, page_size=ps, dtype=torch.bfloat16,
                                  device="cuda", reserve_sink_page=True))  # fmt: skip
    ctx = StepContext(request_ids=[], graph_walk="mixed", slot=0, capture=False)
    for rid in "abc":
        kv.ingest_request(rid)
    steps = [[("a", 20), ("b", 3)], [("a", 1), ("b", 1), ("c", 37)], [("a", 1), ("b", 1), ("c", 1)]]
    for i, segs in enumerate(steps):
        st = ResourceStep(segments=tuple(Segment(r, "main", n) for r, n in segs))
        assert kv.admit(st, ctx) is ADMIT_OK
        plan = kv.plan(st, ctx)
        layouts = [(0, plan.qo_indptr, plan.kv_indptr, plan.kv_indices, plan.kv_last_page_len,
                    plan.write_slots)]  # fmt: skip
        if plan.is_decode:  # pad rows all write the sink page (0): compare the pages after it
            lay = pad_decode_layout(plan, 8, 0)
            layouts.append((1, lay.qo_indptr, lay.kv_indptr, lay.kv_indices,
                            lay.kv_last_page_len, lay.write_slots))  # fmt: skip
        for first, *arrays, slots in layouts:
            tokens = slots.numel()
            qkv = torch.randn(tokens, 3 * heads, dim, device=CUDA).to(torch.bfloat16)
            k, v = qkv[:, heads : 2 * heads], qkv[:, 2 * heads :]
            want = torch.zeros(pages, 2, ps, heads, dim, device=CUDA, dtype=torch.bfloat16)
            write_kv(want, k, v, slots)
            got = torch.zeros_like(want)
            layout = stage_append_layout(*arrays, ps, CUDA)
            flashinfer.page.append_paged_kv_cache(
                k, v, layout.batch_indices, layout.positions, got,
                layout.kv_indices, layout.kv_indptr, layout.kv_last_page_len, "NHD",
            )  # fmt: skip
            assert torch.equal(got[first:], want[first:]), f"step {i}"
        kv.commit(st, ctx)
