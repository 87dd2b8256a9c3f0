"""A GGUF file's quantized projections served as stored (`gguf_linear.GGUFLinearMethod`).

A tiny Llama (tied head) and Qwen2 (Q/K/V biases, own LM head) are written as GGUF files with
Q8_0 / Q4_0 projections; Qwen2's Q/K/V mix types, so its fused QKV is one `QuantLinear` per
part. Loaded with ``quantization="auto"`` they must give the logits of the same engine on the
dequantized weights (``quantization="none"``) up to the activations' 8-bit quantization, and
the same greedy tokens wherever the reference's top-2 margin exceeds that tolerance; the
projections must hold the file's blocks and no float copy.
"""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
from mstar_model_testutil import PagedPool, greedy
from test_model_gguf_convert import write_tiny_gguf

from mstar.engine.config import EngineConfig
from mstar.engine.engine import LLMEngine
from mstar.engine.model import ModelLoadError, load_model
from mstar.engine.model.gguf_linear import ConcatQuantLinear, QuantDecodeWeights
from mstar.engine.sampling_params import SamplingParams
from mstar.kernels import quant_linear
from mstar.kernels.cpu_gemm import PackedLinear
from mstar.kernels.quant_linear import QuantLinear, row_bytes

pytestmark = pytest.mark.usefixtures("one_thread")

QTYPES = {
    "llama": {
        "attn_q.weight": "Q8_0",
        "attn_k.weight": "Q8_0",
        "attn_v.weight": "Q8_0",
        "attn_output.weight": "Q4_0",
        "ffn_gate.weight": "Q4_0",
        "ffn_up.weight": "Q4_0",
        "ffn_down.weight": "Q8_0",
        "token_embd.weight": "Q8_0",  # the tied LM head multiplies these blocks
    },
    "qwen2": {
        "attn_q.weight": "Q8_0",
        "attn_k.weight": "Q4_0",
        "attn_v.weight": "Q8_0",
        "attn_output.weight": "Q4_0",
        "ffn_gate.weight": "Q8_0",
        "ffn_up.weight": "Q8_0",
        "ffn_down.weight": "Q4_0",
        "output.weight": "Q8_0",
    },
}
#: logits of the quantized engine against the dequantized one, as a fraction of the largest
#: |logit|: the only difference is x quantized to 8 bits per 32 values before each integer dot
#: product (measured: at most 1.8% Llama, 4.4% Qwen2, whose LM head is Q8_0 too)
LOGIT_TOL = 0.05


def _bytes(module: torch.nn.Module) -> int:
    tensors = [*module.parameters(), *module.buffers()]
    return sum(t.numel() * t.element_size() for t in {id(t): t for t in tensors}.values())


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_gguf_served_quantized_matches_dequantized(tmp_path, monkeypatch, caplog, family):
    monkeypatch.setenv("MSTAR_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / f"{family}.gguf"
    write_tiny_gguf(path, family, qtypes=QTYPES[family])
    with caplog.at_level(logging.INFO, logger="mstar.engine.model.loader"):
        quant, cfg, tok = load_model(path, "float32")
    dense, _, _ = load_model(path, "float32", quantization="none")
    assert isinstance(quant.fused_decode, QuantDecodeWeights)  # test_quant_fused_decode's

    # every projection holds the file's blocks, and nothing else of its weight
    taken = 0
    for name, spec in quant.linears.specs.items():
        module = quant.get_submodule(name)
        parts = module.parts if isinstance(module, ConcatQuantLinear) else [module]
        assert all(isinstance(p, QuantLinear) for p in parts), name
        assert isinstance(module, ConcatQuantLinear) == (family == "qwen2" and "qkv" in name)
        stored = sum(row_bytes(p.qtype, spec.in_features) * p.out_features for p in parts)
        assert _bytes(module) == stored + (spec.out_features * 4 if spec.bias else 0)
        assert isinstance(dense.get_submodule(name), PackedLinear)
        taken += 1
    assert taken == cfg.num_layers * 4 + 1
    saved = sum(
        _bytes(dense.get_submodule(n)) - _bytes(quant.get_submodule(n)) for n in quant.linears.specs
    )
    assert saved > 0 and _bytes(quant) == _bytes(dense) - saved

    ids = tok.encode("the quick brown fox jumps over")
    pools = [PagedPool(cfg, num_pages=16, page_size=4) for _ in range(2)]
    ours_all = pools[0].step(quant, [(0, ids)], all_logits=True)
    ref_all = pools[1].step(dense, [(0, ids)], all_logits=True)
    atol = LOGIT_TOL * float(ref_all.abs().max())
    torch.testing.assert_close(ours_all, ref_all, atol=atol, rtol=0)
    ours, ref = ours_all[-1:], ref_all[-1:]
    clear = 0
    for _ in range(24):  # greedy on the reference's tokens, each step compared
        top2 = ref[0].topk(2).values
        if float(top2[0] - top2[1]) > 2 * atol:
            assert int(ours.argmax()) == int(ref.argmax())
            clear += 1
        torch.testing.assert_close(ours, ref, atol=atol, rtol=0)
        nxt = int(ref.argmax())
        ours = pools[0].step(quant, [(0, [nxt])])
        ref = pools[1].step(dense, [(0, [nxt])])
    assert clear >= 4  # random tiny models' top-2 margins are often inside the tolerance

    # the same blocks through the dequantize-then-GEMM path: float rounding only, so the
    # tolerance above is the activations' quantization and not misplaced rows
    monkeypatch.setattr(quant_linear, "DEQUANT_MIN_ROWS", 1)
    monkeypatch.setattr(quant_linear, "DEQUANT_MIN_ROWS_AVX2", 1)
    exact = PagedPool(cfg, num_pages=16, page_size=4).step(quant, [(0, ids)], all_logits=True)
    torch.testing.assert_close(exact, ref_all, atol=1e-4, rtol=1e-4)


def test_quantization_none_and_unsupported_setups_dequantize(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("MSTAR_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "q.gguf"
    write_tiny_gguf(path, "llama", qtypes=QTYPES["llama"])
    with caplog.at_level(logging.INFO, logger="mstar.engine.model.loader"):
        decoder, _, _ = load_model(path, "bfloat16", deterministic=True)
    assert "serving dequantized weights (--deterministic" in caplog.text
    assert not any(isinstance(m, QuantLinear) for m in decoder.modules())
    with pytest.raises(ModelLoadError, match="unsupported quantization 'int8'"):
        load_model(path, "float32", quantization="int8")
    with pytest.raises(ValueError, match="--quantization must be one of auto, none"):
        EngineConfig(quantization="int8")


def test_engine_serves_gguf_quantized(tmp_path, monkeypatch):
    """`mstar-engine serve --model x.gguf` (`EngineConfig` -> `LLMEngine.from_config`) keeps
    the projections quantized; its greedy tokens are the quantized decoder's own."""
    monkeypatch.setenv("MSTAR_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "q.gguf"
    write_tiny_gguf(path, "qwen2", qtypes=QTYPES["qwen2"])
    config = EngineConfig(model=str(path), dtype="float32", device="cpu", num_pages=64)
    engine = LLMEngine.from_config(config)
    assert any(isinstance(m, QuantLinear) for m in engine.decoder.modules())
    decoder, cfg, tok = load_model(path, "float32")
    prompt = tok.encode("the lazy dog near the café")
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    (served,) = engine.generate([prompt], params)
    assert served == greedy(decoder, PagedPool(cfg, num_pages=16, page_size=4), [prompt], 8)[0]
    dense = LLMEngine.from_config(dataclasses.replace(config, quantization="none"))
    assert not any(isinstance(m, QuantLinear) for m in dense.decoder.modules())
