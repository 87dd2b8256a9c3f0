"""Mixtral (``MixtralForCausalLM``): Mistral's attention (a ``sliding_window`` windows every
layer when set); every layer's MLP is an MoE block (``block_sparse_moe``: softmax router,
top-k renormalised, experts ``w1``/``w3``/``w2``)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from mstar.engine.model.families.qwen3_moe import moe_fields
from mstar.engine.model.family import Family, llama_names


def _names(i: int) -> Iterator[tuple[str, list[str]]]:
    yield from llama_names(i)
    yield "moe", [f"model.layers.{i}.block_sparse_moe"]


def _own(cfg: dict[str, Any]) -> dict[str, Any]:
    return {"qkv_bias": False, "o_bias": False, "mlp_bias": False, **moe_fields(cfg)}


FAMILY = Family(
    name="mixtral",
    architectures=("MixtralForCausalLM",),
    model_types=("mixtral",),
    own=_own,
    names=_names,
)
