"""Qwen3 (dense): Qwen2's layout without the QKV bias, plus an RMSNorm over each Q and K head
before RoPE."""

from __future__ import annotations

from typing import Any

from mstar.engine.model.families.qwen2 import qwen_windows
from mstar.engine.model.family import Family


def _own(cfg: dict[str, Any]) -> dict[str, Any]:
    return {"qk_norm": True, "mlp_bias": False, "layer_windows": qwen_windows(cfg)}


FAMILY = Family(
    name="qwen3",
    architectures=("Qwen3ForCausalLM",),
    model_types=("qwen3",),
    gguf_architectures=("qwen3",),
    own=_own,
)
