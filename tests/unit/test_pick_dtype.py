"""`--dtype auto` takes bf16 where it is the faster dtype on the CPU, float32 for a GGUF served as
stored there; explicit dtypes are honoured as given. `--kv-cache-dtype auto`: bf16 beside the
stored GGUF's float32 activations, else the activations' dtype."""

from __future__ import annotations

import argparse
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from mstar.engine import engine
from mstar.engine.config import EngineConfig, add_cli_args, from_namespace, to_cli_args
from mstar.kernels import BackendUnavailable, cpu_gemm, cpu_isa


@pytest.mark.parametrize(("faster", "want"), [(True, torch.bfloat16), (False, torch.float32)])
def test_auto_on_cpu_takes_bf16_where_it_is_faster(monkeypatch, faster, want):
    monkeypatch.setattr(engine, "cpu_prefers_bf16", lambda kernels: faster)
    assert engine._pick_dtype("auto", torch.device("cpu")) == want


class _Kernels:
    def __init__(self, fma: bool) -> None:
        self.fma = fma

    def fma_available(self) -> bool:
        return self.fma


#: /proc/cpuinfo flags: a Zen 1 (AVX2), a Skylake-SP (AVX-512, no bf16 math), a Zen 4
_AVX2 = {"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe", "abm"}
_SKYLAKE = _AVX2 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
_ZEN4 = _SKYLAKE | {"avx512_bf16"}


@pytest.mark.parametrize(
    ("flags", "kernels", "want"),
    [
        (_ZEN4, None, True),  # native bf16 math
        (_AVX2, _Kernels(fma=True), True),  # the FMA bf16 GEMM over half-size weights
        (_AVX2, None, False),  # kernels off: bf16 would be float32 GEMMs on copies
        (_SKYLAKE, _Kernels(fma=True), True),  # the FMA GEMM, not oneDNN's emulated bf16
        (_SKYLAKE, None, False),  # kernels off: oneDNN's emulated bf16 or float32 copies
    ],
    ids=["avx512-bf16", "avx2", "avx2-no-kernels", "avx512-no-bf16", "avx512-no-kernels"],
)
def test_bf16_is_preferred_where_it_is_measured_faster(monkeypatch, flags, kernels, want):
    monkeypatch.delenv(cpu_isa.ENV_LEVEL, raising=False)
    monkeypatch.setattr(cpu_isa, "detect", lambda: cpu_isa.CpuFeatures(frozenset(flags)))
    assert cpu_gemm.cpu_prefers_bf16(kernels) is want


def test_auto_on_cuda_is_bf16(monkeypatch):
    monkeypatch.setattr(engine, "cpu_prefers_bf16", lambda kernels: False)
    assert engine._pick_dtype("auto", torch.device("cuda")) == torch.bfloat16


@pytest.mark.parametrize("name", ["float32", "bfloat16", "float16"])
def test_explicit_dtype_wins(monkeypatch, name):
    monkeypatch.setattr(engine, "cpu_prefers_bf16", lambda kernels: True)
    assert engine._pick_dtype(name, torch.device("cpu")) == getattr(torch, name)


def _write_gguf(path: Path, qtype: GGMLQuantizationType) -> str:
    """A GGUF whose one matrix is stored as ``qtype``, beside an F32 norm."""
    w = gguf.GGUFWriter(str(path), arch="llama")
    data = np.random.default_rng(0).standard_normal((32, 64), dtype=np.float32)
    raw = quantize(data, qtype)
    w.add_tensor("blk.0.attn_q.weight", raw, raw_shape=raw.shape, raw_dtype=qtype)
    w.add_tensor("blk.0.attn_norm.weight", np.ones(64, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def test_auto_for_a_gguf_served_as_stored_is_float32_on_cpu(monkeypatch, tmp_path):
    """Stored blocks read the same bytes whatever the activations: float32 keeps a prompt's
    logits the dequantized model's. A GGUF the loader dequantizes gets bf16 as before."""
    monkeypatch.setattr(engine, "cpu_prefers_bf16", lambda kernels: True)
    cpu = torch.device("cpu")
    quantized = _write_gguf(tmp_path / "m.Q8_0.gguf", GGMLQuantizationType.Q8_0)
    for config, stored in (
        (EngineConfig(), True),  # --model naming a GGUF, flags at their defaults
        (EngineConfig(quantization="none"), False),
        (EngineConfig(deterministic=True), False),
        (EngineConfig(tensor_parallel_size=2), False),
    ):
        assert engine._serves_stored(config, quantized, cpu) is stored
        want = torch.float32 if stored else torch.bfloat16
        assert engine._pick_dtype("auto", cpu, stored=stored) == want
    assert not engine._serves_stored(EngineConfig(), "/m/folder", cpu)
    assert engine._pick_dtype("auto", torch.device("cuda"), stored=True) == torch.bfloat16
    assert engine._pick_dtype("bfloat16", cpu, stored=True) == torch.bfloat16


def test_auto_for_a_gguf_of_plain_tensors_is_bf16_on_cpu(monkeypatch, tmp_path):
    """A BF16 GGUF (llama-quantize's BF16 of a Q4_K_M file) holds no blocks to keep: it is
    dequantized like any checkpoint, so it gets the faster bf16, not stored blocks' float32."""
    monkeypatch.setattr(engine, "cpu_prefers_bf16", lambda kernels: True)
    cpu = torch.device("cpu")
    plain = _write_gguf(tmp_path / "m.BF16.gguf", GGMLQuantizationType.BF16)
    assert not engine._serves_stored(EngineConfig(), plain, cpu)


def test_kv_cache_dtype_auto_is_bf16_for_stored_float32_on_cpu(caplog):
    """llama.cpp's default 16-bit cache beside float32 activations, for a stored GGUF only;
    every other engine keeps its activations' dtype (the float32 exactness tests' cache)."""
    cpu, f32, bf16 = torch.device("cpu"), torch.float32, torch.bfloat16
    with caplog.at_level("INFO", logger="mstar.engine.engine"):
        assert engine._pick_kv_dtype("auto", f32, cpu, stored=True) == bf16
    assert "KV cache: bfloat16 (auto: a GGUF served as stored" in caplog.text
    assert engine._pick_kv_dtype("auto", f32, cpu, stored=False) == f32
    assert engine._pick_kv_dtype("auto", bf16, cpu, stored=True) == bf16
    assert engine._pick_kv_dtype("auto", bf16, torch.device("cuda"), stored=False) == bf16
    assert engine._pick_kv_dtype("float32", f32, cpu, stored=True) == f32
    assert engine._pick_kv_dtype("bfloat16", f32, cpu, stored=False) == bf16


def test_kv_cache_dtype_flag_and_its_refusals():
    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    cfg = EngineConfig(kv_cache_dtype="bfloat16")
    assert from_namespace(parser.parse_args(to_cli_args(cfg))) == cfg
    assert "KV cache dtype" in parser.format_help()
    with pytest.raises(ValueError, match="--kv-cache-dtype must be one of auto, bfloat16, float32"):
        EngineConfig(kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="--kv-cache-dtype: not served with --tensor-parallel"):
        EngineConfig(kv_cache_dtype="bfloat16", tensor_parallel_size=2)
    with pytest.raises(BackendUnavailable, match=r"--kv-cache-dtype bfloat16: .* on CPU only"):
        engine._pick_kv_dtype("bfloat16", torch.float32, torch.device("cuda"), stored=False)
