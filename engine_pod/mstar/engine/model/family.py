"""What a model family declares: its names, its config parsing, its checkpoint name map, and
whether the fused CPU decode (`cpu_kernels.decode_layers`) runs its layers.

A family file (``families/<name>.py``) builds one `Family`; `registry.FAMILIES` lists them.
Everything the families share (layers, RoPE, attention, loading) lives once elsewhere.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from mstar.engine.model.config import ModelConfig, parse_common

#: (a decoder parameter local to layer i, the checkpoint tensors filling its rows in order)
NameMap = Callable[[int], Iterator[tuple[str, list[str]]]]


def llama_names(i: int) -> Iterator[tuple[str, list[str]]]:
    """The Llama checkpoint layout most families share: separate q/k/v and gate/up tensors
    fused into one parameter each, biases where present, the two pre-norms, q/k norms."""
    pre = f"model.layers.{i}."
    att = pre + "self_attn."
    mlp = pre + "mlp."
    for kind in ("weight", "bias"):
        yield f"qkv_proj.{kind}", [f"{att}{p}_proj.{kind}" for p in "qkv"]
        yield f"o_proj.{kind}", [f"{att}o_proj.{kind}"]
        yield f"gate_up_proj.{kind}", [f"{mlp}gate_proj.{kind}", f"{mlp}up_proj.{kind}"]
        yield f"down_proj.{kind}", [f"{mlp}down_proj.{kind}"]
    for norm in ("input_layernorm", "post_attention_layernorm"):
        yield f"{norm}.weight", [f"{pre}{norm}.weight"]
    for norm in ("pre_feedforward_layernorm", "post_feedforward_layernorm"):
        yield f"{norm}.weight", [f"{pre}{norm}.weight"]
    yield "q_norm.weight", [f"{att}q_norm.weight"]
    yield "k_norm.weight", [f"{att}k_norm.weight"]


def layer_weight_sources(num_layers: int, names: NameMap) -> dict[str, list[str]]:
    """Projection name (``layers.3.qkv_proj``) -> the checkpoint weights fused into it, in
    order (the quantized linear methods find a projection's stored tensors by it)."""
    sources: dict[str, list[str]] = {}
    for i in range(num_layers):
        for local, tensors in names(i):
            module, _, kind = local.rpartition(".")
            if kind == "weight":
                sources[f"layers.{i}.{module}"] = tensors
    return sources


@dataclass(frozen=True)
class Family:
    """One model family. ``own`` maps a config dict to the fields `parse_common` does not
    read as this family needs; ``fused_decode`` says whether `decode_layers` implements its
    layer (the decoder still refuses a config whose layer shape it cannot run, by name)."""

    name: str
    architectures: tuple[str, ...]
    model_types: tuple[str, ...]
    gguf_architectures: tuple[str, ...] = ()
    own: Callable[[dict[str, Any]], dict[str, Any]] = lambda cfg: {}
    names: NameMap = llama_names
    fused_decode: bool = True

    def parse(self, cfg: dict[str, Any]) -> ModelConfig:
        """The checkpoint's `ModelConfig`; raises `ModelLoadError` naming the problem."""
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in self.architectures), self.architectures[0])
        return parse_common(cfg, arch, self.name, **self.own(cfg))
