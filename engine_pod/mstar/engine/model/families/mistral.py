"""Mistral: Llama's layout; ``sliding_window`` (7B v0.1) windows every layer."""

from __future__ import annotations

from typing import Any

from mstar.engine.model.family import Family


def _own(cfg: dict[str, Any]) -> dict[str, Any]:
    return {"qkv_bias": False, "o_bias": False, "mlp_bias": False}


FAMILY = Family(
    name="mistral",
    architectures=("MistralForCausalLM",),
    model_types=("mistral",),
    own=_own,
)
