"""Qwen2 / Qwen2.5: biases on Q, K and V only; a sliding window only where the config turns
it on (``use_sliding_window``), for the layers at or past ``max_window_layers``."""

from __future__ import annotations

from typing import Any

from mstar.engine.model.config import layer_windows
from mstar.engine.model.family import Family


def qwen_windows(cfg: dict[str, Any]) -> tuple[int, ...]:
    """Qwen's windows: configs carry ``sliding_window`` even when it is off."""
    if not cfg.get("use_sliding_window", False):
        return ()
    layers = int(cfg.get("num_hidden_layers") or 0)
    if cfg.get("layer_types") is None:
        first = int(cfg.get("max_window_layers", layers))
        kinds = ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
        cfg = {**cfg, "layer_types": kinds}
    return layer_windows(cfg, layers)


def _own(cfg: dict[str, Any]) -> dict[str, Any]:
    return {
        "qkv_bias": True,
        "o_bias": False,
        "mlp_bias": False,
        "layer_windows": qwen_windows(cfg),
    }


FAMILY = Family(
    name="qwen2",
    architectures=("Qwen2ForCausalLM",),
    model_types=("qwen2",),
    gguf_architectures=("qwen2",),
    own=_own,
)
