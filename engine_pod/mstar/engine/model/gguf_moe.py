"""The MoE side of GGUF conversion (`gguf_convert`): files as llama.cpp's converter writes
them, ``qwen3moe``, ``llama`` with ``expert_count`` (Mixtral) and ``gpt-oss``.

Each MoE layer's router is ``ffn_gate_inp`` and its experts are stacked: ``ffn_gate_exps`` /
``ffn_up_exps`` [E, I, H] and ``ffn_down_exps`` [E, H, I] (numpy order). They become
transformers 5's fused ``experts.gate_up_proj`` [E, 2I, H] and ``experts.down_proj``, the
layout `moe.load_moe_block_` reads. As llama.cpp runs these files, Qwen3-MoE always
renormalises its top-k (``norm_topk_prob``) and Mixtral has no sliding window; a Qwen3-MoE
layer without a router is dense (``mlp_only_layers``).

gpt-oss files also carry the router's bias and the experts' biases (``ffn_*_exps.bias``), and
their experts may be MXFP4 (``gguf.quants`` dequantizes them at read).
They become the checkpoint's own layout (`moe._load_gpt_oss`): ``gate_up_proj`` [E, H, 2I]
with gate and up columns interleaved, ``down_proj`` [E, I, H]. Its config is what llama.cpp
runs: layers alternate sliding (even) and full, YaRN with the file's factor and betas and no
truncation, and the clamped SwiGLU's constants (1.702, 7.0), which the file does not store.
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


#: gpt-oss's: the router is ``router`` with a bias, every expert stack has a bias
_GPT_OSS_NAMES = {
    "ffn_gate_inp.weight": "router.weight",
    "ffn_gate_inp.bias": "router.bias",
    **{k: v for k, v in _MOE_NAMES.items() if "exps" in k},
    **{k.replace("weight", "bias"): v + "_bias" for k, v in _MOE_NAMES.items() if "exps" in k},
}
#: llama.cpp's gpt-oss constants (not stored in the file): SwiGLU alpha and clamp
GPT_OSS_SWIGLU = (1.702, 7.0)


def moe_hf_name(idx: str, rest: str, arch: str) -> str | None:
    """The HF name of layer ``idx``'s GGUF tensor ``rest`` if it is an MoE one, else None
    (Mixtral's module is ``block_sparse_moe``, Qwen's and gpt-oss's ``mlp``)."""
    names = _GPT_OSS_NAMES if arch == "gpt-oss" else _MOE_NAMES
    if rest not in names:
        return None
    module = "block_sparse_moe" if arch == "llama" else "mlp"
    return f"model.layers.{idx}.{module}.{names[rest]}"


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
    if arch == "gpt-oss":
        _gpt_oss_config(field, experts, used, cfg)
        return
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


def _gpt_oss_config(
    field: Callable[[str], Any], experts: int, used: int, cfg: dict[str, Any]
) -> None:
    p = "gpt-oss."
    layers = int(cfg["num_hidden_layers"])
    cfg.pop("use_sliding_window", None)
    alpha, limit = GPT_OSS_SWIGLU
    cfg.update(
        num_local_experts=experts,
        num_experts_per_tok=used,
        intermediate_size=int(field(p + "expert_feed_forward_length")),
        attention_bias=True,
        sliding_window=int(field(p + "attention.sliding_window")),
        layer_types=[
            "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)
        ],
        swiglu_alpha=alpha,
        swiglu_limit=limit,
    )
    theta = cfg.pop("rope_theta")
    if field(p + "rope.scaling.type") != "yarn":
        cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": theta}
        return
    cfg["rope_parameters"] = {
        "rope_type": "yarn",
        "rope_theta": theta,
        "factor": float(field(p + "rope.scaling.factor")),
        "original_max_position_embeddings": int(field(p + "rope.scaling.original_context_length")),
        "beta_fast": float(field(p + "rope.scaling.yarn_beta_fast") or 32.0),
        "beta_slow": float(field(p + "rope.scaling.yarn_beta_slow") or 1.0),
        "truncate": False,
    }


def fuse_expert_stacks(tensors: dict[str, torch.Tensor]) -> None:
    """Each MoE layer's gate and up stacks -> one ``experts.gate_up_proj`` [E, 2I, H], in
    place; gpt-oss's (those with biases) -> its checkpoint's interleaved [E, H, 2I] and
    ``down_proj`` [E, I, H]."""
    for gate_name in [n for n in tensors if n.endswith(".experts.gate_proj")]:
        prefix = gate_name[: -len("gate_proj")]
        gate, up = tensors.pop(gate_name), tensors.pop(prefix + "up_proj")
        if prefix + "gate_proj_bias" not in tensors:
            tensors[prefix + "gate_up_proj"] = torch.cat((gate, up), dim=1).contiguous()
            continue
        gate_b, up_b = tensors.pop(prefix + "gate_proj_bias"), tensors.pop(prefix + "up_proj_bias")
        e, i, h = gate.shape
        rows = torch.stack((gate, up), dim=2).reshape(e, 2 * i, h)  # gate 0, up 0, gate 1...
        tensors[prefix + "gate_up_proj"] = rows.transpose(1, 2).contiguous()
        tensors[prefix + "gate_up_proj_bias"] = torch.stack((gate_b, up_b), dim=2).reshape(e, -1)
        tensors[prefix + "down_proj"] = tensors[prefix + "down_proj"].transpose(1, 2).contiguous()
