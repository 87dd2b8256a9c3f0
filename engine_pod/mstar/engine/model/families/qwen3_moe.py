"""Qwen3-MoE (``Qwen3MoeForCausalLM``): Qwen3's attention (q/k norm, no bias); the MLP of
every ``decoder_sparse_step``-th layer not in ``mlp_only_layers`` is an MoE block (softmax
router, top-k renormalised by ``norm_topk_prob``), the others Qwen3's dense MLP."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from mstar.engine.model.config import ModelLoadError
from mstar.engine.model.families.qwen2 import qwen_windows
from mstar.engine.model.family import Family, llama_names
from mstar.engine.model.moe import MoeSpec, is_moe_layer


def moe_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """The `ModelConfig` MoE fields of an MoE family's config (`MoeSpec.from_config`)."""
    try:
        spec = MoeSpec.from_config(cfg)
    except (KeyError, ValueError) as exc:
        raise ModelLoadError(f"MoE config: {exc}") from exc
    layers = int(cfg.get("num_hidden_layers") or 0)
    return {"moe": spec, "moe_layers": tuple(i for i in range(layers) if is_moe_layer(cfg, i))}


def _names(i: int) -> Iterator[tuple[str, list[str]]]:
    yield from llama_names(i)
    yield "moe", [f"model.layers.{i}.mlp"]


def _own(cfg: dict[str, Any]) -> dict[str, Any]:
    return {
        "qk_norm": True,
        "mlp_bias": False,
        "layer_windows": qwen_windows(cfg),
        **moe_fields(cfg),
    }


FAMILY = Family(
    name="qwen3_moe",
    architectures=("Qwen3MoeForCausalLM",),
    model_types=("qwen3_moe",),
    gguf_architectures=("qwen3moe",),
    own=_own,
    names=_names,
)
