"""A decode step over GGUF blocks in one `cpu_kernels.quant_decode_layers` call: the bits of
the layer-by-layer `QuantLinear` path, on every ISA level this CPU runs (the x86-64 baseline's
plain C++ dots included), float32 (over auto's bf16 KV cache, and over a float32 one) and bf16,
for a tiny Llama (one type per projection), a Qwen2 (QKV biases; Q, K, V stored in different
types, so QKV is several parts), a Qwen3 (q/k norm) and a Gemma 3 (q/k norm, 1 + w sandwich
norms, GELU-tanh, sliding-window layers on their local RoPE base; mixed QKV types), at 1, 6
and 19 rows (the 4-row kernel and the batched tiles). Two threads: the fused call splits its
columns over every part at once, the layer path part by part."""

from __future__ import annotations

import dataclasses
import logging
import random
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from external_tools import require_tool
from fused_compare import compare_fused_steps
from test_model_gguf_convert import write_tiny_gguf
from test_quant_serving import MIXED_QKV, QTYPES

from mstar.engine.config import EngineConfig
from mstar.engine.engine import LLMEngine
from mstar.engine.model.gguf_linear import ConcatQuantLinear, QuantDecodeWeights
from mstar.engine.sampling_params import SamplingParams
from mstar.kernels import cpu_isa, cpu_kernels

NEW_TOKENS = 8
FAMILIES = ("llama", "qwen2", "qwen3", "gemma3")


@pytest.fixture(params=[lvl.name for lvl in cpu_isa.supported_levels()])
def level(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The engine built at this level (`MSTAR_CPU_ISA`), forgotten after."""
    require_tool("g++")
    monkeypatch.setenv(cpu_isa.ENV_LEVEL, request.param)
    cpu_kernels.load.cache_clear()
    yield request.param
    cpu_kernels.load.cache_clear()


@pytest.fixture
def two_threads() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(threads)


@pytest.mark.usefixtures("two_threads")
@pytest.mark.parametrize(
    ("dtype", "kv_cache_dtype", "family"),
    [
        *((d, "auto", f) for d in ("float32", "bfloat16") for f in FAMILIES),
        ("float32", "float32", "llama"),  # auto's bf16 cache under float32 is the line above
    ],
)
def test_quant_fused_decode_gives_the_layer_by_layer_bits(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    level: str,
    family: str,
    dtype: str,
    kv_cache_dtype: str,
) -> None:
    monkeypatch.setenv("MSTAR_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / f"{family}.gguf"
    write_tiny_gguf(path, family, qtypes=QTYPES[family], hidden=64)
    config = EngineConfig(
        model=str(path), dtype=dtype, device="cpu", page_size=4, num_pages=256,
        host_offload_gb=0, seed=0, kv_cache_dtype=kv_cache_dtype,
    )  # fmt: skip
    with caplog.at_level(logging.INFO, logger="mstar.engine.model.loader"):
        engine = LLMEngine.from_config(config)
    assert "one fused CPU kernel call (weights: GGUF blocks as stored)" in caplog.text
    # `--kv-cache-dtype auto`: bf16 under float32 activations (q, k, v cast around attention)
    kv_dtype = torch.float32 if kv_cache_dtype == "float32" else torch.bfloat16
    assert engine.kv.cache.tensor.dtype == kv_dtype
    decoder = engine.model_runner.decoder
    assert decoder.cpu_kernels is not None and decoder.cpu_kernels.isa_level() == level
    bundle = decoder.fused_decode
    assert isinstance(bundle, QuantDecodeWeights)
    concat = isinstance(decoder.layers[0].qkv_proj, ConcatQuantLinear)
    assert concat == (family in MIXED_QKV) and (max(bundle.parts) > 1) == concat
    fused_rows = compare_fused_steps(decoder)
    rng = random.Random(0)
    vocab = decoder.config.vocab_size
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.choice([1, 5, 9]))] for _ in range(19)]
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    outs = [engine.generate(prompts[:n], params) for n in (1, 6, 19)]
    assert [len(o) for batch in outs for o in batch] == [NEW_TOKENS] * 26
    # 1 and 6 rows: the 4-row kernel; 19: the batched tiles (8 rows or more)
    assert {1, 6, 19} <= set(fused_rows)


def test_a_projection_not_all_blocks_is_not_gathered(tmp_path: Path, monkeypatch) -> None:
    """A model whose projections are float (``quantization="none"``) gives no bundle; the
    C++ call refuses parts that do not fill a projection, and a layout whose cache slot is
    out of range, by name."""
    monkeypatch.setenv("MSTAR_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "llama.gguf"
    write_tiny_gguf(path, "llama", qtypes=QTYPES["llama"], hidden=64)
    config = EngineConfig(model=str(path), dtype="float32", device="cpu", num_pages=64)
    dense = LLMEngine.from_config(dataclasses.replace(config, quantization="none"))
    assert QuantDecodeWeights.gather(dense.model_runner.decoder.layers) is None
    decoder = LLMEngine.from_config(config).model_runner.decoder
    bundle = decoder.fused_decode
    assert isinstance(bundle, QuantDecodeWeights) and decoder.cpu_kernels is not None
    cfg = decoder.config
    hidden, dim = cfg.hidden_size, cfg.head_dim
    cache = torch.zeros(cfg.num_layers, 4, 2, 4, cfg.num_kv_heads, dim)
    cos = sin = torch.zeros(1, 1, dim // 2)
    layers = cfg.num_layers
    args = (
        torch.zeros(1, hidden), torch.zeros(1, hidden), bundle.norm_in, bundle.norm_post,
    )  # fmt: skip
    rest = (
        bundle.biases, cache, [cos], [sin], [torch.zeros(1, 4, dtype=torch.int64)],
        [torch.ones(1, dtype=torch.int64)], [torch.zeros(1, dtype=torch.int64)],
        [None] * (4 * layers), [0, 0, 0, 0] * layers, False, cfg.num_heads, cfg.num_kv_heads,
        cfg.intermediate_size, 1.0, 1e-6,
    )  # fmt: skip
    short = bundle.blocks[:]
    short[0] = short[0][:-1]  # QKV one row short
    with pytest.raises(RuntimeError, match="parts hold"):
        decoder.cpu_kernels.quant_decode_layers(*args, short, bundle.types, bundle.parts, *rest)
    bad_slot = (*rest[:8], [0, 0, 0, layers] * layers, *rest[9:])
    with pytest.raises(RuntimeError, match="cache slot is out of range"):
        decoder.cpu_kernels.quant_decode_layers(
            *args, bundle.blocks, bundle.types, bundle.parts, *bad_slot
        )
