"""The MoE block against transformers' own blocks on the same random weights, float32.

Each family's block is built by transformers from its config (Qwen3-MoE's
``Qwen3MoeSparseMoeBlock``, Qwen2-MoE's with its shared expert, ``MixtralSparseMoeBlock``,
gpt-oss's ``GptOssMLP``), every weight and bias random; mstar's block loads the tensors under
the names the family's checkpoints use, and both run the same tokens: one, a few, and a
prompt-sized batch, through the C++ grouped kernel and through torch's grouped GEMM. The
router weights give a clear top-k (checked), so a different rounding cannot change the choice.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from external_tools import require_tool
from torch import nn

from mstar.engine.model.moe import (
    MoeBlock,
    MoeSpec,
    dequantize_mxfp4,
    is_moe_layer,
    load_moe_block_,
    route,
)
from mstar.kernels import cpu_kernels
from mstar.kernels.moe_experts import CpuExperts

pytestmark = pytest.mark.usefixtures("one_thread")

HIDDEN, INTER, EXPERTS, TOP_K = 64, 96, 8, 3  # MXFP4 packs 32 values a scale
TOKENS = (1, 5, 160)


def _hf_block(model_type: str) -> tuple[nn.Module, dict[str, Any]]:
    """transformers' block for the family, random weights, and its config as a dict."""
    if model_type == "qwen3_moe":
        from transformers import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

        cfg: Any = Qwen3MoeConfig(
            hidden_size=HIDDEN, moe_intermediate_size=INTER, num_experts=EXPERTS,
            num_experts_per_tok=TOP_K, norm_topk_prob=True,
        )  # fmt: skip
        block: nn.Module = Qwen3MoeSparseMoeBlock(cfg)
    elif model_type == "qwen2_moe":
        from transformers import Qwen2MoeConfig
        from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

        cfg = Qwen2MoeConfig(
            hidden_size=HIDDEN, moe_intermediate_size=INTER, num_experts=EXPERTS,
            num_experts_per_tok=TOP_K, shared_expert_intermediate_size=80,
        )  # fmt: skip
        block = Qwen2MoeSparseMoeBlock(cfg)
    elif model_type == "mixtral":
        from transformers import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

        cfg = MixtralConfig(
            hidden_size=HIDDEN, intermediate_size=INTER, num_local_experts=EXPERTS,
            num_experts_per_tok=TOP_K,
        )  # fmt: skip
        block = MixtralSparseMoeBlock(cfg)
    else:
        from transformers import GptOssConfig
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

        cfg = GptOssConfig(
            hidden_size=HIDDEN, intermediate_size=INTER, num_local_experts=EXPERTS,
            num_experts_per_tok=TOP_K,
        )  # fmt: skip
        block = GptOssMLP(cfg)
    gen = torch.Generator().manual_seed(len(model_type))
    with torch.no_grad():
        for name, param in block.named_parameters():
            # Expert outputs of a few units: gpt-oss's clamp at 7 is reached by some values.
            scale = 1.0 if "router" in name or name.startswith("gate.") else 0.25
            param.copy_(torch.randn(param.shape, generator=gen) * scale)
    return block.eval(), cfg.to_dict()


def _checkpoint(block: nn.Module, model_type: str, prefix: str) -> dict[str, torch.Tensor]:
    """The block's tensors under the names the family's checkpoints use on the hub."""
    params = {n: p.detach().clone() for n, p in block.named_parameters()}
    if model_type == "gpt_oss":
        return {f"{prefix}.{n}": t for n, t in params.items()}
    names = ("w1", "w3", "w2") if model_type == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    out = {f"{prefix}.gate.weight": params.pop("gate.weight")}
    gate_up, down = params.pop("experts.gate_up_proj"), params.pop("experts.down_proj")
    for e in range(EXPERTS):
        out[f"{prefix}.experts.{e}.{names[0]}.weight"] = gate_up[e, :INTER]
        out[f"{prefix}.experts.{e}.{names[1]}.weight"] = gate_up[e, INTER:]
        out[f"{prefix}.experts.{e}.{names[2]}.weight"] = down[e]
    out.update({f"{prefix}.{n}": t for n, t in params.items()})  # the shared expert, its gate
    return out


def _router_logits(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    router = block.router if hasattr(block, "router") else block.gate
    return nn.functional.linear(x, router.weight, getattr(router, "bias", None))


def _hf_out(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = block(x.unsqueeze(0))
    return (out[0] if isinstance(out, tuple) else out).squeeze(0)


@pytest.fixture(scope="module")
def kernels() -> Any:
    require_tool("g++")
    require_tool("ninja")
    ext = cpu_kernels.load()
    assert ext is not None, "the CPU kernels did not build"
    return ext


@pytest.mark.parametrize("path", ["cpu_kernel", "torch_grouped"])
@pytest.mark.parametrize("model_type", ["qwen3_moe", "qwen2_moe", "mixtral", "gpt_oss"])
def test_block_matches_transformers(model_type: str, path: str, request: Any) -> None:
    hf, cfg = _hf_block(model_type)
    spec = MoeSpec.from_config(cfg)
    assert (spec.num_experts, spec.top_k, spec.inter) == (EXPERTS, TOP_K, INTER)
    ours = MoeBlock(spec)
    held = sum(p.numel() for p in ours.parameters())
    assert spec.params(spec.num_experts) == held == sum(p.numel() for p in hf.parameters())
    assert spec.params(spec.top_k) < held
    prefix = "model.layers.0.block_sparse_moe" if model_type == "mixtral" else "model.layers.0.mlp"
    load_moe_block_(ours, _checkpoint(hf, model_type, prefix), prefix)
    if path == "cpu_kernel":
        ours.use_cpu_kernels(request.getfixturevalue("kernels"))
    gen = torch.Generator().manual_seed(7)
    for tokens in TOKENS:
        x = torch.randn(tokens, HIDDEN, generator=gen)
        top = torch.topk(_router_logits(hf, x), TOP_K + 1).values
        assert (top[:, -2] - top[:, -1]).min() > 1e-3, "the test's router has no clear top-k"
        with torch.no_grad():
            expected = _hf_out(hf, x)
        got = ours(x)
        assert got.shape == (tokens, HIDDEN)
        torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-5)


def test_gpt_oss_mxfp4_experts_dequantize_as_transformers_does() -> None:
    """Random MXFP4 blocks and scales: transformers' own dequantization sets its block's
    weights, mstar's block loads the blocks and scales; both give the same outputs."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    hf, cfg = _hf_block("gpt_oss")
    gen = torch.Generator().manual_seed(3)
    quantized: dict[str, torch.Tensor] = {}
    for name, (out_dim, in_dim) in {
        "gate_up_proj": (2 * INTER, HIDDEN),
        "down_proj": (HIDDEN, INTER),
    }.items():
        blocks = torch.randint(0, 256, (EXPERTS, out_dim, in_dim // 32, 16), generator=gen)
        scales = torch.randint(123, 127, (EXPERTS, out_dim, in_dim // 32), generator=gen)
        quantized[f"mlp.experts.{name}_blocks"] = blocks.to(torch.uint8)
        quantized[f"mlp.experts.{name}_scales"] = scales.to(torch.uint8)
        dense = convert_moe_packed_tensors(
            blocks.to(torch.uint8), scales.to(torch.uint8), dtype=torch.float32
        )
        getattr(hf.experts, name).data.copy_(dense)  # [E, in, out]
        ours = dequantize_mxfp4(blocks.to(torch.uint8), scales.to(torch.uint8))
        assert torch.equal(ours, dense.transpose(1, 2))
    tensors = {
        f"mlp.{n}": p.detach() for n, p in hf.named_parameters() if "proj" not in n or "bias" in n
    }
    block = MoeBlock(MoeSpec.from_config(cfg))
    load_moe_block_(block, {**tensors, **quantized}, "mlp")
    x = torch.randn(9, HIDDEN, generator=gen)
    with torch.no_grad():
        torch.testing.assert_close(block(x), _hf_out(hf, x), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral", "gpt_oss"])
def test_the_cpp_router_rounds_as_route_in_bf16(model_type: str, kernels: Any) -> None:
    """`MoeBlock` on the kernels routes in C++ (``MoeLayer``); in bf16 its weights round where
    `route` rounds them (Qwen and gpt-oss to bf16, Mixtral kept float32): the same experts on
    the same stacks give the block's output."""
    hf, cfg = _hf_block(model_type)
    ours = MoeBlock(MoeSpec.from_config(cfg), dtype=torch.bfloat16)
    prefix = "model.layers.0.mlp"
    load_moe_block_(ours, _checkpoint(hf, model_type, prefix), prefix)
    stacks = (ours.gate_up, ours.gate_up_bias, ours.down, ours.down_bias)
    experts = CpuExperts.pack(kernels, *(None if t is None else t.clone() for t in stacks),
                              ours.spec.act)  # fmt: skip
    ours.use_cpu_kernels(kernels)
    x = torch.randn(TOKENS[-1], HIDDEN, generator=torch.Generator().manual_seed(3)).bfloat16()
    weights, ids = route(ours.router_run(x), ours.spec)
    expected = experts(x, ids, weights)
    got = ours(x)
    torch.testing.assert_close(got, expected, atol=1e-2, rtol=1e-2)
    assert (got == expected).float().mean() > 0.99


def test_sparse_layers_and_unsupported_configs() -> None:
    cfg = {
        "model_type": "qwen3_moe",
        "num_experts": 8,
        "decoder_sparse_step": 2,
        "mlp_only_layers": [3],
    }
    assert [is_moe_layer(cfg, i) for i in range(6)] == [False, True, False, False, False, True]
    assert is_moe_layer({"model_type": "mixtral"}, 0)
    with pytest.raises(ValueError, match="not an MoE family"):
        MoeSpec.from_config({"model_type": "llama"})
    with pytest.raises(ValueError, match="hidden_act 'gelu'"):
        MoeSpec.from_config(
            {
                "model_type": "mixtral",
                "hidden_act": "gelu",
                "hidden_size": 8,
                "intermediate_size": 8,
            }
        )


def test_a_wrong_shape_names_the_tensor() -> None:
    hf, cfg = _hf_block("mixtral")
    tensors = _checkpoint(hf, "mixtral", "m")
    good = tensors["m.experts.2.w2.weight"]
    tensors["m.experts.2.w2.weight"] = good[:, :-1]
    with pytest.raises(ValueError, match=r"m\.experts\.2\.w2\.weight: shape"):
        load_moe_block_(MoeBlock(MoeSpec.from_config(cfg)), tensors, "m")
    tensors["m.experts.2.w2.weight"] = good
    del tensors["m.experts.5.w1.weight"]
    with pytest.raises(KeyError, match=r"m\.experts\.5\.w1\.weight"):
        load_moe_block_(MoeBlock(MoeSpec.from_config(cfg)), tensors, "m")
