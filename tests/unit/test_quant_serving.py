"""A GGUF file's quantized projections served as stored (`gguf_linear.GGUFLinearMethod`).

A tiny Llama (tied head), Qwen2 (Q/K/V biases, own LM head), Qwen3 (q/k norms) and Gemma 3
(four ``1 + w`` norms, sliding window, soft-capped logits, tied head) are written as GGUF files
with Q8_0 / Q4_0 / Q4_1 / Q5_0 projections; where a fused projection's parts mix types (Qwen2's
and Gemma's Q/K/V, as in Gemma 3 270M's Q4_K_M file) it is one `QuantLinear` per part.
Loaded with ``quantization="auto"`` they must give the logits of the same engine on the
dequantized weights (``quantization="none"``) up to the activations' 8-bit quantization, and the
same greedy tokens wherever the reference's top-2 margin exceeds that tolerance; the projections
must hold the file's blocks and no float copy.
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
from mstar.engine.model.gguf_linear import ConcatQuantLinear, QuantDecodeWeights, QuantEmbedding
from mstar.engine.sampling_params import SamplingParams
from mstar.kernels import quant_linear
from mstar.kernels.cpu_gemm import PackedLinear
from mstar.kernels.quant_linear import QuantLinear, row_bytes

pytestmark = pytest.mark.usefixtures("one_thread")

QTYPES = {
    "llama": {  # its tied LM head multiplies by the embedding's Q8_0 blocks
        "token_embd.weight": "Q8_0",
        "attn_q.weight": "Q8_0",
        "attn_k.weight": "Q8_0",
        "attn_v.weight": "Q8_0",
        "attn_output.weight": "Q4_0",
        "ffn_gate.weight": "Q4_0",
        "ffn_up.weight": "Q4_0",
        "ffn_down.weight": "Q8_0",
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
    "qwen3": {
        "attn_q.weight": "Q4_1",
        "attn_k.weight": "Q4_1",
        "attn_v.weight": "Q4_1",
        "attn_output.weight": "Q8_0",
        "ffn_gate.weight": "Q4_1",
        "ffn_up.weight": "Q4_1",
        "ffn_down.weight": "Q5_0",
        "output.weight": "Q4_1",
    },
    "gemma3": {  # Gemma 3 270M's Q4_K_M file's small-row types (its K-quants need 256 inputs)
        "attn_q.weight": "Q5_0",
        "attn_k.weight": "Q5_0",
        "attn_v.weight": "Q8_0",
        "attn_output.weight": "Q4_0",
        "ffn_gate.weight": "Q5_0",
        "ffn_up.weight": "Q5_0",
        "ffn_down.weight": "Q8_0",
    },
}
#: the families whose fused Q/K/V mixes types above (one `QuantLinear` per part)
MIXED_QKV = ("qwen2", "gemma3")
#: logits of the quantized engine against the dequantized one, as a fraction of the largest
#: |logit|: the only difference is x quantized to 8 bits per 32 values before each integer dot
#: product (measured: at most 1.8% Llama, 4.4% Qwen2, whose LM head is Q8_0 too, 1.6% Qwen3,
#: 1.5% Gemma 3)
LOGIT_TOL = 0.05


def _bytes(module: torch.nn.Module) -> int:
    tensors = [*module.parameters(), *module.buffers()]
    return sum(t.numel() * t.element_size() for t in {id(t): t for t in tensors}.values())


@pytest.mark.parametrize("family", list(QTYPES))
def test_gguf_served_quantized_matches_dequantized(tmp_path, monkeypatch, caplog, family):
    monkeypatch.setenv("MSTAR_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / f"{family}.gguf"
    write_tiny_gguf(path, family, qtypes=QTYPES[family])
    with caplog.at_level(logging.INFO, logger="mstar.engine.model.loader"):
        quant, cfg, tok = load_model(path, "float32")
    dense, _, _ = load_model(path, "float32", quantization="none")
    # the fused C++ decode over the blocks (test_quant_fused_decode's)
    fused = isinstance(quant.fused_decode, QuantDecodeWeights)
    assert fused  # every dense family's layer, Gemma 3's and Qwen3's too

    # every projection holds the file's blocks, and nothing else of its weight; a tied head
    # is quantized where the embedding is
    quantized_head = not cfg.tie_word_embeddings or "token_embd.weight" in QTYPES[family]
    taken = 0
    for name, spec in quant.linears.specs.items():
        module = quant.get_submodule(name)
        if name == "lm_head" and not quantized_head:
            assert isinstance(module, PackedLinear)  # the float embedding's, packed
            continue
        parts = module.parts if isinstance(module, ConcatQuantLinear) else [module]
        assert all(isinstance(p, QuantLinear) for p in parts), name
        assert isinstance(module, ConcatQuantLinear) == (family in MIXED_QKV and "qkv" in name)
        stored = sum(row_bytes(p.qtype, spec.in_features) * p.out_features for p in parts)
        assert _bytes(module) == stored + (spec.out_features * 4 if spec.bias else 0)
        assert isinstance(dense.get_submodule(name), PackedLinear)
        taken += 1
    assert taken == cfg.num_layers * 4 + quantized_head
    saved = sum(
        _bytes(dense.get_submodule(n)) - _bytes(quant.get_submodule(n))
        for n in quant.linears.specs
        if n != "lm_head" or quantized_head
    )
    # a quantized tied head's blocks are the embedding's too: the float table is dropped
    shared = cfg.tie_word_embeddings and quantized_head
    assert isinstance(quant.embed_tokens, QuantEmbedding) == shared
    if shared:
        saved += _bytes(dense.embed_tokens)
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
    monkeypatch.setattr(quant_linear, "DEQUANT_MIN_ROWS_AMX", 1)
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
    config = EngineConfig(
        model=str(path), dtype="float32", kv_cache_dtype="float32", device="cpu", num_pages=64
    )  # the float32 pool's cache below (auto's bf16 one: the next test)
    engine = LLMEngine.from_config(config)
    assert any(isinstance(m, QuantLinear) for m in engine.decoder.modules())
    decoder, cfg, tok = load_model(path, "float32")
    prompt = tok.encode("the lazy dog near the café")
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    (served,) = engine.generate([prompt], params)
    assert served == greedy(decoder, PagedPool(cfg, num_pages=16, page_size=4), [prompt], 8)[0]
    dense = LLMEngine.from_config(dataclasses.replace(config, quantization="none"))
    assert not any(isinstance(m, QuantLinear) for m in dense.decoder.modules())


def test_stored_gguf_kv_cache_is_bf16_beside_float32_activations(tmp_path, monkeypatch, caplog):
    """`--kv-cache-dtype auto` on a stored GGUF under float32 activations: a bf16 cache (half
    the bytes, as llama.cpp's default f16 one); q, k, v rounded to bf16 before attention give
    each step's logits close to the float32 cache's and not equal to them, and the same greedy
    tokens on this prompt."""
    monkeypatch.setenv("MSTAR_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "q.gguf"
    write_tiny_gguf(path, "qwen3", qtypes=QTYPES["qwen3"])
    config = EngineConfig(model=str(path), dtype="float32", device="cpu", num_pages=64)
    with caplog.at_level(logging.INFO, logger="mstar.engine.engine"):
        engine = LLMEngine.from_config(config)
    assert "KV cache: bfloat16 (auto: a GGUF served as stored" in caplog.text
    full = LLMEngine.from_config(dataclasses.replace(config, kv_cache_dtype="float32"))
    half, f32 = engine.kv.cache.tensor, full.kv.cache.tensor
    assert (half.dtype, f32.dtype) == (torch.bfloat16, torch.float32)
    assert half.shape == f32.shape and 2 * half.nbytes == f32.nbytes
    prompt = engine.tokenizer.encode("the lazy dog near the café")
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    steps = [_record_logits(e) for e in (engine, full)]
    assert engine.generate([prompt], params) == full.generate([prompt], params)
    assert len(steps[0]) == len(steps[1]) == 4  # the prompt's step, then 3 decode steps
    for ours, ref in zip(*steps, strict=True):
        assert ours.dtype == torch.float32 and not torch.equal(ours, ref)
        # bf16's rounding (<= 2^-9 relative) alone would be well under 1%, but a rounded
        # activation that crosses one of the next integer dot's 8-bit steps moves a full step:
        # LOGIT_TOL's bound (one step measured at 2.2% of the largest |logit|)
        atol = LOGIT_TOL * float(ref.abs().max())
        torch.testing.assert_close(ours, ref, atol=atol, rtol=0)


def _record_logits(engine: LLMEngine) -> list[torch.Tensor]:
    """The list each of ``engine``'s decoder steps appends its logits to."""
    decoder = engine.model_runner.decoder
    forward, seen = decoder.forward, []

    def recording(*args: object) -> torch.Tensor:
        logits: torch.Tensor = forward(*args)
        seen.append(logits.clone())
        return logits

    decoder.forward = recording
    return seen
