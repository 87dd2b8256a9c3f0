"""Phi-3: Q/K/V and gate/up stored fused in the checkpoint (``qkv_proj``, ``gate_up_proj``),
LongRoPE scaling (parsed with the other RoPE variants), no biases."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from mstar.engine.model.family import Family


def _names(i: int) -> Iterator[tuple[str, list[str]]]:
    pre = f"model.layers.{i}."
    yield "qkv_proj.weight", [pre + "self_attn.qkv_proj.weight"]
    yield "o_proj.weight", [pre + "self_attn.o_proj.weight"]
    yield "gate_up_proj.weight", [pre + "mlp.gate_up_proj.weight"]
    yield "down_proj.weight", [pre + "mlp.down_proj.weight"]
    for norm in ("input_layernorm", "post_attention_layernorm"):
        yield f"{norm}.weight", [f"{pre}{norm}.weight"]


def _own(cfg: dict[str, Any]) -> dict[str, Any]:
    return {"qkv_bias": False, "o_bias": False, "mlp_bias": False}


FAMILY = Family(
    name="phi3",
    architectures=("Phi3ForCausalLM",),
    model_types=("phi3",),
    gguf_architectures=("phi3",),
    own=_own,
    names=_names,
)
