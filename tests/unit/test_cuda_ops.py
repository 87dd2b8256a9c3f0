"""The fused glue-op wiring of `model.cuda_ops`, on CPU: the layers through `FusedGlueOps` over
FlashInfer's contracts in plain torch (`ReferenceFused`) decode exactly what the unfused torch
ops and transformers decode (float32), and a CUDA bf16 decoder picks FlashInfer's kernels (a
fake module stands in for FlashInfer, only here)."""

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
    ops = FusedGlueOps(ReferenceFused.fused_add_rmsnorm, ReferenceFused.silu_and_mul)
    engine.decoder.cpu_kernels = ops
    assert engine.generate(PROMPTS, params) == plain == hf_greedy(tiny_llama_dir, PROMPTS, NEW)
    layers = engine.model_config.num_layers
    steps = ops.calls["silu_mul"] // layers
    assert steps >= NEW and ops.calls["silu_mul"] == steps * layers
    # Per step: every layer's post-attention norm, layers 1.. input norm, the final norm.
    assert ops.calls["add_rms_norm_"] == steps * 2 * layers


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
    decoder = types.SimpleNamespace(cpu_kernels=None)
    assert attach_fused_glue_ops(decoder, cuda, torch.bfloat16, deterministic=False)
    assert isinstance(decoder.cpu_kernels, FusedGlueOps)
    for deterministic, kernels in ((True, None), (False, object())):
        other = types.SimpleNamespace(cpu_kernels=kernels)
        assert not attach_fused_glue_ops(other, cuda, torch.bfloat16, deterministic)
        assert other.cpu_kernels is kernels


def test_without_flashinfer_the_layers_keep_torchs_ops(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing(name: str) -> Any:
        raise ImportError(f"No module named {name!r}")

    monkeypatch.setattr(cuda_ops.importlib, "import_module", missing)
    decoder = types.SimpleNamespace(cpu_kernels=None)
    assert not attach_fused_glue_ops(decoder, torch.device("cuda"), torch.bfloat16, False)
    assert decoder.cpu_kernels is None
