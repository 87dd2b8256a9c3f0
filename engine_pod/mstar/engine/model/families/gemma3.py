"""Gemma 3 text (``Gemma3ForCausalLM``): sliding-window layers interleaved with full ones,
each kind with its own RoPE base; RMSNorm scaling by ``1 + w``; norms after attention and
around the MLP too; q/k norm; embeddings scaled by sqrt(hidden); GELU-tanh gated MLP;
attention scale ``query_pre_attn_scalar ** -0.5``; optional final logit soft-capping."""

from __future__ import annotations

from typing import Any

from mstar.engine.model.config import ModelLoadError, layer_windows, parse_rope
from mstar.engine.model.family import Family


def _own(cfg: dict[str, Any]) -> dict[str, Any]:
    if cfg.get("attn_logit_softcapping") is not None:
        raise ModelLoadError("Gemma attn_logit_softcapping is not supported")
    if cfg.get("use_bidirectional_attention"):
        raise ModelLoadError("Gemma use_bidirectional_attention is not supported")
    layers = int(cfg.get("num_hidden_layers") or 0)
    if cfg.get("layer_types") is None:  # transformers 4 configs: every Nth layer is full
        pattern = int(cfg.get("sliding_window_pattern", 6))
        kinds = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                 for i in range(layers)]  # fmt: skip
        cfg = {**cfg, "layer_types": kinds}
    params = cfg.get("rope_parameters") or {}
    if "full_attention" in params:  # transformers 5: one entry per layer type
        full = parse_rope(cfg, params["full_attention"])
        local = parse_rope(cfg, params.get("sliding_attention") or {"rope_theta": 10000.0})
    else:
        full = parse_rope(cfg)
        local = parse_rope({"rope_theta": cfg.get("rope_local_base_freq", 10000.0)})
    softcap = cfg.get("final_logit_softcapping")
    windowed = {**cfg, "sliding_window": cfg.get("sliding_window", 4096)}
    return {
        "head_dim": int(cfg.get("head_dim") or 256),
        "rope_theta": full.theta,
        "rope_scaling": full.scaling,
        "local_rope": local,
        "layer_windows": layer_windows(windowed, layers),
        "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", True)),
        "qkv_bias": bool(cfg.get("attention_bias", False)),
        "o_bias": bool(cfg.get("attention_bias", False)),
        "mlp_bias": False,
        "qk_norm": True,
        "norm_offset": True,
        "sandwich_norms": True,
        "embed_scale": True,
        "query_pre_attn_scalar": float(cfg.get("query_pre_attn_scalar", 256)),
        "final_logit_softcap": None if softcap is None else float(softcap),
    }


FAMILY = Family(
    name="gemma3",
    architectures=("Gemma3ForCausalLM",),
    model_types=("gemma3_text",),
    gguf_architectures=("gemma3",),
    own=_own,
)
