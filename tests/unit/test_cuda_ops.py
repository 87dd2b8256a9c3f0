"""The fused glue-op wiring of `model.cuda_ops`, on CPU: the layers through `FusedGlueOps` over
FlashInfer's contracts in plain torch (`ReferenceFused`: add+RMSNorm, SiLU*up, RoPE from the
step's positions and a float32 cos|sin cache) decode exactly what the unfused torch ops and
transformers decode (float32), and a CUDA bf16 decoder picks FlashInfer's kernels (a fake
module stands in for FlashInfer, only here)."""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any

import pytest
import torch
from models import hf_greedy

from mstar.engine.config import EngineConfig
from mstar.engine.engine import LLMEngine
from mstar.engine.model import cuda_ops
from mstar.engine.model.cuda_ops import FusedGlueOps, ReferenceFused, attach_fused_glue_ops
from mstar.engine.sampling_params import SamplingParams

PROMPTS = [[5, 6, 7], [40, 41, 42, 43, 44, 45, 46, 47, 48], [9]]
NEW = 10


def _torch_ops_engine(folder: Path) -> LLMEngine:
    """The tiny model with the layers' glue ops in torch (no C++ provider, no fused decode)."""
    cfg = EngineConfig(model=str(folder), dtype="float32", device="cpu", num_pages=64)
    engine = LLMEngine.from_config(cfg)
    engine.decoder.cpu_kernels = None
    engine.decoder.fused_decode = None
    return engine


def test_reference_fused_ops_decode_like_the_unfused_ops(tiny_llama_dir: Path) -> None:
    params = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    plain = _torch_ops_engine(tiny_llama_dir).generate(PROMPTS, params)
    engine = _torch_ops_engine(tiny_llama_dir)
    rope = ReferenceFused.apply_rope_with_cos_sin_cache_inplace
    kv_heads = engine.model_config.num_kv_heads
    ops = FusedGlueOps(
        ReferenceFused.fused_add_rmsnorm, ReferenceFused.silu_and_mul, rope, kv_heads
    )
    engine.decoder.cpu_kernels = ops
    assert engine.generate(PROMPTS, params) == plain == hf_greedy(tiny_llama_dir, PROMPTS, NEW)
    layers = engine.model_config.num_layers
    steps = ops.calls["silu_mul"] // layers
    assert steps >= NEW and ops.calls["silu_mul"] == steps * layers
    assert ops.calls["rope_"] == steps * layers
    # Per step: both norms of every layer (layer 0's input norm over a zero residual), and
    # the final norm.
    assert ops.calls["add_rms_norm_"] == steps * (2 * layers + 1)


def test_reference_rope_matches_the_layers_rotation_in_bf16() -> None:
    """FlashInfer's RoPE contract (float32 math over the widened table, one rounding) against
    torch's bf16 rotation of the same Q|K views: within bf16, the K heads after the Q heads."""
    from mstar.engine.model.rope import RotaryEmbedding

    table = RotaryEmbedding(64, 256, 10000.0, dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(1)
    qkv = torch.randn(7, 6 + 2 * 2, 64, generator=gen).to(torch.bfloat16)
    positions = torch.tensor([0, 3, 17, 100, 101, 255, 5])
    want = qkv.clone()
    table.rotate_(want[:, :8], *table.lookup(positions))
    ops = FusedGlueOps(
        ReferenceFused.fused_add_rmsnorm,
        ReferenceFused.silu_and_mul,
        ReferenceFused.apply_rope_with_cos_sin_cache_inplace,
        kv_heads=2,
    )
    got = qkv.clone()
    ops.rope_(got[:, :8], *ops.rope_lookup(table, positions))
    torch.testing.assert_close(got, want, atol=3e-2, rtol=2e-2)
    assert torch.equal(got[:, 8:], qkv[:, 8:])  # V untouched
    assert not torch.equal(got[:, :8], qkv[:, :8])


def test_reference_matches_the_layers_rms_norm_in_bf16() -> None:
    """FlashInfer's contract in bf16: residual is the rounded sum, x its norm (within bf16)."""
    from mstar.engine.model.layers import RMSNorm

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 64, generator=gen).to(torch.bfloat16)
    residual = torch.randn(5, 64, generator=gen).to(torch.bfloat16)
    norm = RMSNorm(64, 1e-6, torch.bfloat16)
    norm.weight.data.copy_(torch.rand(64, generator=gen) + 0.5)
    want, want_res = norm.add_forward(x.clone(), residual.clone(), None)
    got, got_res = x.clone(), residual.clone()
    ReferenceFused.fused_add_rmsnorm(got, got_res, norm.weight, norm.eps)
    assert torch.equal(got_res, want_res)
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)


def _fake_flashinfer(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    fake = {
        "flashinfer.norm": types.SimpleNamespace(fused_add_rmsnorm=lambda *a: None),
        "flashinfer.activation": types.SimpleNamespace(silu_and_mul=lambda x: x),
        "flashinfer.rope": types.SimpleNamespace(
            apply_rope_with_cos_sin_cache_inplace=lambda *a: None
        ),
    }
    monkeypatch.setattr(cuda_ops.importlib, "import_module", lambda name: fake[name])
    return fake


def test_a_cuda_bf16_decoder_selects_flashinfers_ops(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _fake_flashinfer(monkeypatch)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    ops = cuda_ops.fused_glue_ops(cuda, torch.bfloat16)
    assert ops is not None
    assert ops._add_rmsnorm is fake["flashinfer.norm"].fused_add_rmsnorm
    assert ops._silu_and_mul is fake["flashinfer.activation"].silu_and_mul
    assert cuda_ops.fused_glue_ops(cpu, torch.bfloat16) is None
    assert cuda_ops.fused_glue_ops(cuda, torch.float32) is None  # float32 keeps torch's ops
    one_table = types.SimpleNamespace(num_kv_heads=2)
    made: list[bool] = []
    table = types.SimpleNamespace(cos_sin_cache=lambda: made.append(True))
    decoder = types.SimpleNamespace(cpu_kernels=None, config=one_table, ropes={"global": table})
    assert attach_fused_glue_ops(decoder, cuda, torch.bfloat16, deterministic=False)
    assert isinstance(decoder.cpu_kernels, FusedGlueOps)
    rope = fake["flashinfer.rope"].apply_rope_with_cos_sin_cache_inplace
    assert decoder.cpu_kernels._rope is rope and decoder.cpu_kernels.kv_heads == 2
    assert made == [True]  # the float32 cache exists before any graph is captured
    # Gemma 3's two RoPE tables keep torch's rotation (one cache per fused call)
    two = types.SimpleNamespace(cpu_kernels=None, config=one_table, ropes={"a": 0, "b": 1})
    assert attach_fused_glue_ops(two, cuda, torch.bfloat16, deterministic=False)
    assert two.cpu_kernels._rope is None
    for deterministic, kernels in ((True, None), (False, object())):
        other = types.SimpleNamespace(cpu_kernels=kernels, config=one_table, ropes={})
        assert not attach_fused_glue_ops(other, cuda, torch.bfloat16, deterministic)
        assert other.cpu_kernels is kernels


def test_without_flashinfer_the_layers_keep_torchs_ops(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing(name: str) -> Any:
        raise ImportError(f"No module named {name!r}")

    monkeypatch.setattr(cuda_ops.importlib, "import_module", missing)
    config = types.SimpleNamespace(num_kv_heads=2)
    decoder = types.SimpleNamespace(cpu_kernels=None, config=config, ropes={"g": 0})
    assert not attach_fused_glue_ops(decoder, torch.device("cuda"), torch.bfloat16, False)
    assert decoder.cpu_kernels is None
