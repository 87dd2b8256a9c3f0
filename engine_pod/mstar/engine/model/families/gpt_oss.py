"""gpt-oss (``GptOssForCausalLM``): attention with biases on Q, K, V and O and a learned sink
logit per query head, sliding-window (128) and full layers alternating (``layer_types``),
YaRN RoPE; every layer's MLP an MoE block (``MoeSpec`` "gpt_oss": top-k of the biased router
logits then softmax, experts with biases and the clamped SwiGLU; MXFP4 experts dequantized
at load)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from mstar.engine.model.config import layer_windows
from mstar.engine.model.families.qwen3_moe import moe_fields
from mstar.engine.model.family import Family, llama_names


def _names(i: int) -> Iterator[tuple[str, list[str]]]:
    yield from llama_names(i)
    yield "sinks", [f"model.layers.{i}.self_attn.sinks"]
    yield "moe", [f"model.layers.{i}.mlp"]


def _own(cfg: dict[str, Any]) -> dict[str, Any]:
    layers = int(cfg.get("num_hidden_layers") or 0)
    if cfg.get("layer_types") is None:  # transformers' default: sliding first, then full
        kinds = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
        cfg = {**cfg, "layer_types": kinds}
    bias = bool(cfg.get("attention_bias", True))
    windowed = {**cfg, "sliding_window": cfg.get("sliding_window", 128)}
    return {
        "head_dim": int(cfg.get("head_dim") or 64),
        "qkv_bias": bias,
        "o_bias": bias,
        "mlp_bias": False,
        "layer_windows": layer_windows(windowed, layers),
        "attn_sinks": True,
        **moe_fields(cfg),
    }


FAMILY = Family(
    name="gpt_oss",
    architectures=("GptOssForCausalLM",),
    model_types=("gpt_oss",),
    own=_own,
    names=_names,
    gguf_architectures=("gpt-oss",),
)
