"""The MoE side of GGUF conversion (`gguf_convert`): files as llama.cpp's converter writes
them, ``qwen3moe`` and ``llama`` with ``expert_count`` (Mixtral).

Each MoE layer's router is ``ffn_gate_inp`` and its experts are stacked: ``ffn_gate_exps`` /
``ffn_up_exps`` [E, I, H] and ``ffn_down_exps`` [E, H, I] (numpy order). They become
transformers 5's fused ``experts.gate_up_proj`` [E, 2I, H] and ``experts.down_proj``, the
layout `moe.load_moe_block_` reads. As llama.cpp runs these files, Qwen3-MoE always
renormalises its top-k (``norm_topk_prob``) and Mixtral has no sliding window; a Qwen3-MoE
layer without a router is dense (``mlp_only_layers``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

#: an MoE layer's GGUF tensors -> their HF names under the layer's MoE module
_MOE_NAMES = {
    "ffn_gate_inp.weight": "gate.weight",
    "ffn_gate_exps.weight": "experts.gate_proj",
    "ffn_up_exps.weight": "experts.up_proj",
    "ffn_down_exps.weight": "experts.down_proj",
}


def moe_hf_name(idx: str, rest: str, arch: str) -> str | None:
    """The HF name of layer ``idx``'s GGUF tensor ``rest`` if it is an MoE one, else None
    (Mixtral's module is ``block_sparse_moe``, Qwen's ``mlp``)."""
    if rest not in _MOE_NAMES:
        return None
    module = "block_sparse_moe" if arch == "llama" else "mlp"
    return f"model.layers.{idx}.{module}.{_MOE_NAMES[rest]}"


def moe_config(
    field: Callable[[str], Any], tensor_names: list[str], arch: str, cfg: dict[str, Any]
) -> None:
    """The MoE fields of the config (in place) where the file has experts (``field``: a
    metadata key's value or None): Mixtral for a ``llama`` file; Qwen3-MoE's expert width,
    top-k and dense layers."""
    p = f"{arch}."
    experts = int(field(p + "expert_count") or 0)
    if not experts:
        return
    used = int(field(p + "expert_used_count"))
    if arch == "llama":
        cfg.update(architectures=["MixtralForCausalLM"], model_type="mixtral")
        cfg.update(num_local_experts=experts, num_experts_per_tok=used, sliding_window=None)
        return
    routed = {n.split(".")[1] for n in tensor_names if n.endswith("ffn_gate_inp.weight")}
    width = int(field(p + "expert_feed_forward_length"))
    cfg.update(
        num_experts=experts,
        num_experts_per_tok=used,
        moe_intermediate_size=width,
        intermediate_size=int(field(p + "feed_forward_length") or width),
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[i for i in range(int(cfg["num_hidden_layers"])) if str(i) not in routed],
    )


def fuse_expert_stacks(tensors: dict[str, torch.Tensor]) -> None:
    """Each MoE layer's gate and up stacks -> one ``experts.gate_up_proj`` [E, 2I, H], in
    place."""
    for gate_name in [n for n in tensors if n.endswith(".experts.gate_proj")]:
        prefix = gate_name[: -len("gate_proj")]
        gate, up = tensors.pop(gate_name), tensors.pop(prefix + "up_proj")
        tensors[prefix + "gate_up_proj"] = torch.cat((gate, up), dim=1).contiguous()
