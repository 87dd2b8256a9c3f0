"""Gemma 3 270M's real Q4_K_M file served as stored: Q5_0 / Q8_0 attention (mixed within a
layer's Q/K/V), Q4_K / Q6_K feed-forward outputs, Q5_0 gate/up, the tied LM head on the
embedding's Q8_0. Prompt and decode-step logits stay within the activations' 8-bit quantization
of the same engine on the dequantized weights (``quantization="none"``, itself greedy-equal to
transformers: tests/engine/test_gemma3_270m.py).
"""

from __future__ import annotations

import torch
from models import gemma3_270m_gguf
from mstar_model_testutil import PagedPool
from test_quant_serving import LOGIT_TOL

from mstar.engine.model import load_model
from mstar.engine.model.gguf_linear import ConcatQuantLinear
from mstar.kernels.quant_linear import QuantLinear

PROMPTS = ["Water boils at a temperature of", "def fibonacci(n):"]
NEW_TOKENS = 12


def test_quantized_logits_match_dequantized() -> None:
    """Every projection keeps the file's blocks (the tied LM head the embedding's Q8_0);
    logits stay within `LOGIT_TOL` of the largest |logit| (measured 4.6% on the first prompt:
    decode-sized batches take the integer kernels, x quantized to 8 bits per 32 values), and
    the greedy token is the same wherever the dequantized engine's top-2 margin clears twice
    that."""
    path = gemma3_270m_gguf()
    quant, cfg, tok = load_model(path, "float32")
    ref, _, _ = load_model(path, "float32", quantization="none")
    specs = list(quant.linears.specs)
    kept = [n for n in specs if isinstance(quant.get_submodule(n), QuantLinear)]
    split = [n for n in specs if isinstance(quant.get_submodule(n), ConcatQuantLinear)]
    assert len(kept) + len(split) == len(specs) == cfg.num_layers * 4 + 1
    assert split and "lm_head" in kept  # Q/K/V mix Q5_0 and Q8_0 in half the layers
    clear = 0
    for text in PROMPTS:
        ids = tok.encode(text, add_special_tokens=True)
        pools = [PagedPool(cfg, num_pages=8, page_size=16) for _ in range(2)]
        ours = pools[0].step(quant, [(0, ids)], all_logits=True)
        want = pools[1].step(ref, [(0, ids)], all_logits=True)
        for _ in range(NEW_TOKENS):
            atol = LOGIT_TOL * float(want.abs().max())
            torch.testing.assert_close(ours, want, atol=atol, rtol=0)
            top2 = want[-1].topk(2).values
            if float(top2[0] - top2[1]) > 2 * atol:
                assert int(ours[-1].argmax()) == int(want[-1].argmax())
                clear += 1
            nxt = int(want[-1].argmax())
            ours = pools[0].step(quant, [(0, [nxt])])
            want = pools[1].step(ref, [(0, [nxt])])
    assert clear >= 4
