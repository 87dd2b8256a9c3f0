"""Every registered family against transformers on fully random weights (norm weights and
biases random too), float32 greedy token for token: offline through the engine (prompts
longer than the sliding windows, chunked prefill mixed with decode) and through the server.

gpt-oss runs its sinks through every attention path: chunked prompts (the prefill kernel on
full layers, one-query rows on the sliding ones) and decode.

Phi-3's prompts stay under its LongRoPE pretraining length and its generations cross it:
there transformers and the engine both rotate each new token with the long table.
"""

from __future__ import annotations

import dataclasses
import logging
import random
from pathlib import Path

import pytest
import torch
import transformers
from greedy_compare import assert_close_until_near_tie, drive, router_flip
from live_server import LiveServer, make_engine
from models import TINY_VOCAB, build_tiny_model, hf_greedy

from mstar.engine.model import ModelConfig
from mstar.engine.model.decoder import fused_decode_refusal
from mstar.engine.model.registry import family_named
from mstar.engine.model.tokenizer import Tokenizer
from mstar.engine.sampling_params import SamplingParams
from mstar.kernels import cpu_kernels

NEW_TOKENS = 14
#: (family, `build_tiny_model` overrides): Mixtral with its sliding window and without
CASES = [
    pytest.param((family, {}), id=family)
    for family in ("qwen3", "mistral", "gemma3", "phi3", "qwen3_moe", "mixtral", "gpt_oss")
] + [pytest.param(("mixtral", {"sliding_window": None}), id="mixtral-full")]
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


def _prompts(seed: int) -> list[list[int]]:
    """Lengths around and past the test models' 8-token windows (and under Phi-3's 32)."""
    rng = random.Random(seed)
    return [[rng.randrange(3, TINY_VOCAB) for _ in range(n)] for n in (3, 9, 17, 30, 12, 25)]


@pytest.fixture(scope="module", params=CASES)
def family_case(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[str, Path, list[list[int]], list[list[int]]]:
    family, overrides = request.param
    folder = build_tiny_model(tmp_path_factory.mktemp(family), family, **overrides)
    prompts = _prompts(len(family))
    return family, folder, prompts, hf_greedy(folder, prompts, NEW_TOKENS)


def test_offline_greedy_matches_transformers(family_case, caplog) -> None:
    family, folder, prompts, expected = family_case
    with caplog.at_level(logging.INFO, logger="mstar.engine.model.loader"):
        # 16-token steps: prompts arrive in chunks beside other rows' decode tokens.
        engine = make_engine(folder, max_num_batched_tokens=16, num_pages=128)
    assert engine.model_config.family == family
    assert engine.generate(prompts, GREEDY) == expected
    engine.kv.assert_pages_conserved()
    # The log says which decode path runs, and why the fused one is off where it is.
    why = fused_decode_refusal(engine.model_config, family_named(family).fused_decode)
    if why is not None and engine.decoder.cpu_kernels is not None:
        assert engine.decoder.fused_decode is None
        assert f"fused CPU decode off ({why})" in caplog.text


def test_server_greedy_matches_transformers(family_case) -> None:
    family, folder, prompts, expected = family_case
    tokenizer = Tokenizer.from_dir(folder)
    with LiveServer(make_engine(folder)) as server:
        # Parameters held = transformers' count; active per token = held less the experts a
        # token does not read ((E - k) of each MoE layer's).
        hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        cfg = ModelConfig.from_file(folder)
        held = sum(p.numel() for p in hf.parameters())
        idle = cfg.moe.params(cfg.moe.num_experts - cfg.moe.top_k) if cfg.moe else 0
        idle -= cfg.moe.params(0) if cfg.moe else 0  # the router is read by every token
        assert server.metric("mstar:model_parameters", kind="held") == held
        active = held - idle * len(cfg.moe_layers)
        assert server.metric("mstar:model_parameters", kind="active") == active
        for prompt, tokens in zip(prompts[:3], expected[:3], strict=True):
            body = {"model": "tiny", "prompt": prompt, "max_tokens": NEW_TOKENS,
                    "temperature": 0, "ignore_eos": True}  # fmt: skip
            text = server.post("/v1/completions", body)["choices"][0]["text"]
            assert text.split() == tokenizer.decode(tokens).split(), family


def test_bf16_kernels_stay_close_to_torch_ops(family_case, monkeypatch) -> None:
    """bf16 on the C++ kernels (windowed decode, q/k norms, Gemma's float32 norms, sinks)
    against the same model on torch's ops: equal up to a rounding near-tie (`greedy_compare`).
    MoE: a prompt may also diverge where a router's top-k is a near-tie, which the final
    token's top-2 gap cannot show (Qwen3-MoE's test model: a float32 top-k gap of 2.8e-3, under
    bf16's rounding of the logits); its tokens up to the divergence, prefilled by both engines,
    must then route differently first where the reference's k-th and (k+1)-th router logits
    are within `ROUTER_TIE_ULPS` bf16 steps."""
    _, folder, prompts, _ = family_case
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=2)
    monkeypatch.setenv(cpu_kernels.ENV_SWITCH, "0")
    cpu_kernels.load.cache_clear()
    try:
        reference = make_engine(folder, dtype="bfloat16")
        assert reference.decoder.cpu_kernels is None
        ref = drive(reference, prompts, params)
    finally:
        monkeypatch.delenv(cpu_kernels.ENV_SWITCH)
        cpu_kernels.load.cache_clear()
    engine = make_engine(folder, dtype="bfloat16")
    got = drive(engine, prompts, params, tag="k")
    moe = engine.model_config.moe
    compared = 0
    for i, prompt in enumerate(prompts):
        try:
            compared += assert_close_until_near_tie(
                ([ref[0][i]], [ref[1][i]]), ([got[0][i]], [got[1][i]])
            )[0]
        except AssertionError:
            pairs = zip(ref[0][i], got[0][i], strict=True)
            t = next((t for t, (a, b) in enumerate(pairs) if a != b), None)
            if moe is None or t is None:
                raise
            margin, bound = router_flip(reference, engine, prompt + ref[0][i][:t], moe.top_k)
            assert margin < bound, f"prompt {i}: routers differ at a top-k margin {margin:.4f}"
    assert compared >= len(prompts)


@pytest.mark.parametrize(
    "family,reason",
    [
        ("llama", None),
        ("qwen3", None),
        ("mistral", None),
        ("gemma3", None),
        ("phi3", None),
        ("qwen3_moe", None),
        ("mixtral", None),
        ("gpt_oss", None),
    ],
)
def test_fused_decode_is_refused_by_name(tmp_path, family, reason) -> None:
    cfg = ModelConfig.from_file(build_tiny_model(tmp_path, family))
    assert fused_decode_refusal(cfg, family_named(family).fused_decode) == reason
    other = dataclasses.replace(cfg, hidden_act="relu")  # an activation the loop lacks
    got = fused_decode_refusal(other, family_named(family).fused_decode)
    assert got is not None and "relu activation" in got
