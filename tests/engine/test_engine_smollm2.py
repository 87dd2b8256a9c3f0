"""The real default model (SmolLM2-135M-Instruct, float32): greedy output equals transformers'
token for token for 16 mixed prompts, also when a tiny KV pool forces evictions mid-generation."""

from __future__ import annotations

from pathlib import Path

import pytest
from models import QUESTIONS, hf_greedy

from mstar.engine.config import EngineConfig
from mstar.engine.engine import LLMEngine
from mstar.engine.model.gguf_convert import default_model_path
from mstar.engine.model.tokenizer import Tokenizer
from mstar.engine.sampling_params import SamplingParams

NEW_TOKENS = 32


@pytest.fixture(scope="module")
def smollm2_dir() -> Path:
    return default_model_path()


@pytest.fixture(scope="module")
def prompts(smollm2_dir: Path) -> list[list[int]]:
    """16 prompts: chat-formatted (all share the template's system prefix, several pages long)
    and raw text of mixed lengths, some shorter than a page."""
    tok = Tokenizer.from_dir(smollm2_dir)
    chat = [
        tok.encode(tok.apply_chat_template([{"role": "user", "content": q}])) for q in QUESTIONS
    ]
    raw = [tok.encode(q) for q in QUESTIONS]
    return chat + raw


@pytest.fixture(scope="module")
def reference(smollm2_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    return hf_greedy(smollm2_dir, prompts, NEW_TOKENS)


GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


def test_smollm2_greedy_matches_transformers(
    smollm2_dir: Path, prompts: list[list[int]], reference: list[list[int]]
) -> None:
    assert any(len(p) > 16 for p in prompts) and any(len(p) < 16 for p in prompts)
    engine = LLMEngine.from_config(
        EngineConfig(model=str(smollm2_dir), dtype="float32", device="cpu", num_pages=512)
    )
    assert engine.generate(prompts, GREEDY) == reference


def test_smollm2_exact_under_evictions(
    smollm2_dir: Path, prompts: list[list[int]], reference: list[list[int]]
) -> None:
    # 24 usable pages of 16 tokens for 16 requests of 40-80 tokens each, 6 host pages: requests
    # are offloaded, reloaded and recomputed mid-generation.
    page_bytes = 30 * 2 * 16 * 3 * 64 * 4
    engine = LLMEngine.from_config(
        EngineConfig(
            model=str(smollm2_dir),
            dtype="float32",
            device="cpu",
            num_pages=25,
            host_offload_gb=6 * page_bytes / 2**30,
        )
    )
    assert engine.generate(prompts, GREEDY) == reference
    c = engine.counters
    assert c.admit_failures > 0 and c.offloads > 0 and c.reloads > 0 and c.recomputations > 0
    engine.kv.assert_pages_conserved()
    assert engine.kv.num_host_pages_used == 0
