"""Llama (1-3.x, SmolLM2, ...): the shared layout with nothing of its own."""

from __future__ import annotations

from typing import Any

from mstar.engine.model.family import Family


def _own(cfg: dict[str, Any]) -> dict[str, Any]:
    return {"layer_windows": ()}  # Llama configs carry no sliding window


FAMILY = Family(
    name="llama",
    architectures=("LlamaForCausalLM",),
    model_types=("llama",),
    gguf_architectures=("llama",),
    own=_own,
)
