"""The mixture-of-experts block: a router, every expert's gated MLP, and a shared expert where
the family has one. Qwen2-MoE, Qwen3-MoE, Mixtral and gpt-oss differ only in values
(`MoeSpec.from_config` reads them from a ``config.json``) and in how their checkpoints name
the experts' tensors (`load_moe_block_`).

Routing, as transformers computes it (float32 greedy is what the family tests compare):
- ``softmax`` (Qwen-MoE, Mixtral): softmax over every expert in float32, the top k, divided by
  their sum where the family renormalises (Mixtral always, Qwen by ``norm_topk_prob``); Qwen
  rounds the weights to the model's dtype, Mixtral keeps them float32.
- ``topk_softmax`` (gpt-oss): the top k of the logits (the router has a bias), softmax over
  those k in the model's dtype.

The experts run grouped by expert (`mstar.kernels.moe_experts`): on CPU the C++ kernel over
weights packed once by `use_cpu_kernels`, with the router's top-k in C++ as well (the kernels'
``MoeLayer``, which a fused decode step runs inside `decode_layers`: `FusedMoe`); elsewhere
torch's grouped GEMM, the router's top-k on the device (`route`). The expert weights are
held stacked, gate rows then up rows (``gate_up`` [E, 2I, H], ``down`` [E, H, I]): gpt-oss's
interleaved gate/up columns are reordered at load, once, and MXFP4 expert weights are
dequantized at load.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

from mstar.engine.model.linear import DenseLinearMethod, LinearSpec
from mstar.engine.model.moe_cuda import Experts, cuda_experts
from mstar.kernels.cpu_gemm import PackedLinear
from mstar.kernels.moe_experts import CpuExperts, ExpertAct, ExpertActivation, grouped_experts

#: the model types whose config.json `MoeSpec.from_config` reads
MOE_MODEL_TYPES = ("qwen2_moe", "qwen3_moe", "mixtral", "gpt_oss")


@dataclass(frozen=True)
class MoeSpec:
    """One MoE block's shape and arithmetic, from the checkpoint's config."""

    model_type: str
    hidden: int
    inter: int
    num_experts: int
    top_k: int
    scoring: Literal["softmax", "topk_softmax"]
    renormalize: bool
    #: routing weights rounded to the model's dtype (Qwen) or kept float32 (Mixtral)
    weights_in_model_dtype: bool
    router_bias: bool = False
    expert_bias: bool = False
    act: ExpertAct = field(default_factory=ExpertAct)
    #: the shared expert's width (Qwen2-MoE, with a sigmoid gate); 0: none
    shared_inter: int = 0

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any]) -> MoeSpec:
        """From a ``config.json`` dict (transformers' defaults where a key is absent);
        ValueError naming what is unsupported."""
        model_type = cfg.get("model_type")
        if model_type not in MOE_MODEL_TYPES:
            raise ValueError(f"model_type {model_type!r} is not an MoE family here")
        act = cfg.get("hidden_act", "silu")
        if model_type != "gpt_oss" and act != "silu":
            raise ValueError(f"{model_type}: hidden_act {act!r} is not supported (silu only)")
        hidden = int(cfg["hidden_size"])
        # Qwen's config.json says num_experts; transformers 5's to_dict num_local_experts.
        experts = int(cfg.get("num_experts", cfg.get("num_local_experts", 0)))
        if model_type in ("qwen2_moe", "qwen3_moe"):
            return cls(
                model_type,
                hidden,
                int(cfg["moe_intermediate_size"]),
                experts,
                int(cfg.get("num_experts_per_tok", 4 if model_type == "qwen2_moe" else 8)),
                "softmax",
                renormalize=bool(cfg.get("norm_topk_prob", False)),
                weights_in_model_dtype=True,
                shared_inter=int(cfg.get("shared_expert_intermediate_size") or 0)
                if model_type == "qwen2_moe"
                else 0,
            )
        experts = experts or (8 if model_type == "mixtral" else 128)
        if model_type == "mixtral":
            top_k = int(cfg.get("num_experts_per_tok", 2))
            return cls(model_type, hidden, int(cfg["intermediate_size"]), experts, top_k,
                       "softmax", renormalize=True, weights_in_model_dtype=False)  # fmt: skip
        top_k = int(cfg.get("num_experts_per_tok", cfg.get("experts_per_token", 4)))
        swiglu = ExpertAct(
            ExpertActivation.CLAMPED_SWIGLU,
            alpha=float(cfg.get("swiglu_alpha", 1.702)),
            limit=float(cfg.get("swiglu_limit", 7.0)),
        )
        return cls(model_type, hidden, int(cfg["intermediate_size"]), experts, top_k,
                   "topk_softmax", renormalize=False, weights_in_model_dtype=True,
                   router_bias=True, expert_bias=True, act=swiglu)  # fmt: skip

    def params(self, experts: int) -> int:
        """The block's parameters counting ``experts`` routed experts (router, biases and the
        shared expert included): `num_experts` of them are held, `top_k` active per token,
        the two figures the issue asks `/metrics` and the log to report."""
        expert = 3 * self.hidden * self.inter + (2 * self.inter + self.hidden) * self.expert_bias
        router = self.num_experts * (self.hidden + self.router_bias)
        shared = (3 * self.shared_inter + 1) * self.hidden if self.shared_inter else 0
        return experts * expert + router + shared


def is_moe_layer(cfg: Mapping[str, Any], layer: int) -> bool:
    """Whether decoder layer ``layer`` has the MoE block (Qwen-MoE: ``decoder_sparse_step``
    and ``mlp_only_layers`` leave some layers a dense MLP) or the dense one."""
    if cfg.get("model_type") not in ("qwen2_moe", "qwen3_moe"):
        return True
    step = int(cfg.get("decoder_sparse_step", 1))
    dense = layer in (cfg.get("mlp_only_layers") or [])
    experts = int(cfg.get("num_experts", cfg.get("num_local_experts", 0)))
    return not dense and experts > 0 and (layer + 1) % step == 0


def route(logits: torch.Tensor, spec: MoeSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights float32 [T, k], expert ids int64 [T, k]) from router logits [T, E]; on the
    logits' device, no host sync."""
    if spec.scoring == "softmax":
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, spec.top_k, dim=-1)
        if spec.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
    else:
        top, ids = torch.topk(logits, spec.top_k, dim=-1)
        weights = torch.softmax(top, dim=-1, dtype=top.dtype)
    if spec.weights_in_model_dtype:
        weights = weights.to(logits.dtype)
    return weights.float(), ids


class MoeBlock(nn.Module):
    """x [T, H] -> [T, H]: the routed experts' weighted sum (+ the gated shared expert)."""

    def __init__(
        self,
        spec: MoeSpec,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__()
        self.spec = spec
        e, h, i = spec.num_experts, spec.hidden, spec.inter
        kw: dict[str, Any] = {"dtype": dtype, "device": device}
        self.router = nn.Linear(h, e, bias=spec.router_bias, **kw)
        self.gate_up = nn.Parameter(torch.empty(e, 2 * i, h, **kw), requires_grad=False)
        self.down = nn.Parameter(torch.empty(e, h, i, **kw), requires_grad=False)
        self.gate_up_bias: nn.Parameter | None = None
        self.down_bias: nn.Parameter | None = None
        if spec.expert_bias:
            self.gate_up_bias = nn.Parameter(torch.empty(e, 2 * i, **kw), requires_grad=False)
            self.down_bias = nn.Parameter(torch.empty(e, h, **kw), requires_grad=False)
        self.shared_gate_up: nn.Linear | None = None
        self.shared_down: nn.Linear | None = None
        self.shared_gate: nn.Linear | None = None
        if spec.shared_inter:
            self.shared_gate_up = nn.Linear(h, 2 * spec.shared_inter, bias=False, **kw)
            self.shared_down = nn.Linear(spec.shared_inter, h, bias=False, **kw)
            self.shared_gate = nn.Linear(h, 1, bias=False, **kw)
        #: what runs the router: ``router`` itself, or its `PackedLinear` (`use_cpu_kernels`)
        self.router_run: nn.Module = self.router
        #: the kernels' ``MoeLayer`` (`use_cpu_kernels`: the experts packed, the routing in
        #: C++, as the fused decode step runs it), or None: torch's path
        self.cpu_layer: Any | None = None
        #: the `cpu_kernels` extension ``cpu_layer`` belongs to
        self.cpu_kernels: Any | None = None
        self.requires_grad_(False)

    def use_cpu_kernels(self, kernels: Any, method: DenseLinearMethod | None = None) -> None:
        """Packs the experts once for `cpu_kernels`' grouped kernel and drops the plain stacks
        (an MoE model's weights are nearly all experts: two copies would double its memory).
        ``method`` (the decoder's dense projections') finalises the router as it does every
        other projection: torch's bf16 ``F.linear`` of one row by the router's [E, H] took
        60 us where the small-batch kernel takes 4 (16 layers: ~1 ms of a batch-1 decode
        step)."""
        if method is not None:
            r = self.router
            spec = LinearSpec("router", r.in_features, r.out_features, r.bias is not None)
            self.router_run = method.finalize(spec, r)
        s = self.spec
        self.cpu_kernels = kernels
        experts = CpuExperts.pack(
            kernels, self.gate_up, self.gate_up_bias, self.down, self.down_bias, s.act
        )
        softmax_first = s.scoring == "softmax"
        self.cpu_layer = experts.with_routing(
            s.top_k, softmax_first, s.renormalize, s.weights_in_model_dtype
        )
        self.gate_up = nn.Parameter(self.gate_up.new_empty(0), requires_grad=False)
        self.down = nn.Parameter(self.down.new_empty(0), requires_grad=False)

    @torch.no_grad()
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.router_run(x)
        if self.cpu_layer is not None:
            out: torch.Tensor = self.cpu_layer.forward(x.contiguous(), logits.contiguous())
        elif x.device.type == "cuda":  # capturable in the decode graph (`moe_cuda`)
            weights, ids = route(logits, self.spec)
            experts = Experts(
                self.gate_up, self.gate_up_bias, self.down, self.down_bias, self.spec.act
            )
            out = cuda_experts(x, ids, weights, experts)
        else:
            weights, ids = route(logits, self.spec)
            out = grouped_experts(
                x, ids, weights, self.gate_up, self.gate_up_bias, self.down, self.down_bias,
                self.spec.act,
            )  # fmt: skip
        if self.shared_gate_up is not None:
            assert self.shared_down is not None and self.shared_gate is not None
            shared = self.shared_down(ExpertAct()(self.shared_gate_up(x)))
            out = out + torch.sigmoid(self.shared_gate(x)) * shared
        return out


@dataclass(frozen=True)
class FusedMoe:
    """Every MoE layer of a model for `cpu_kernels.decode_layers` (the kernels' ``MoeDecode``:
    between its ``begin`` and ``end`` those layers' MLP is router, top-k and experts in C++,
    and each layer's attention takes its sinks: gpt-oss), and the most rows the routers'
    small-batch kernel takes."""

    kernel: Any
    max_rows: int

    @staticmethod
    def gather(layers: Sequence[Any]) -> FusedMoe | None:
        """From the layers' ``moe`` blocks (None where a layer has none); None where a block
        runs outside the C++ kernels (`MoeBlock.use_cpu_kernels` not called), has a shared
        expert, or its router keeps no small-batch packed weight."""
        index: list[int] = []
        blocks: list[Any] = []
        routers: list[torch.Tensor] = []
        biases: list[torch.Tensor | None] = []
        max_rows = 1 << 30
        kernels: Any = None
        for i, layer in enumerate(layers):
            block: MoeBlock | None = layer.moe
            if block is None:
                continue
            router = block.router_run
            small = getattr(router, "small_batch_weight", None)
            if block.cpu_layer is None or block.shared_gate_up is not None or small is None:
                return None
            assert isinstance(router, PackedLinear)
            kernels = block.cpu_kernels
            index.append(i)
            blocks.append(block.cpu_layer)
            routers.append(small)
            biases.append(None if router.bias is None else router.bias.detach())
            max_rows = min(max_rows, router.small_batch_max_rows)
        if not blocks:
            return None
        sinks = [getattr(layer, "sinks", None) for layer in layers]  # gpt-oss's attention's
        return FusedMoe(kernels.MoeDecode(index, blocks, routers, biases, sinks), max_rows)

    @contextmanager
    def step(self) -> Iterator[None]:
        """A `decode_layers` call on this thread inside runs the MoE layers."""
        self.kernel.begin()
        try:
            yield
        finally:
            self.kernel.end()


# -- loading a checkpoint's tensors --------------------------------------------------------------

_FP4_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
#: the FP4 (E2M1) values of MXFP4's 4-bit codes (the top bit is the sign)
FP4_VALUES = _FP4_MAGNITUDES + tuple(-v for v in _FP4_MAGNITUDES)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """MXFP4 -> float32: blocks uint8 [..., G, 16] (two codes a byte, low nibble first), scales
    uint8 [..., G] (a power of two, biased by 127, per 32 values) -> [..., G * 32]."""
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).long()
    values = lut[codes].flatten(-2)
    exponent = scales.to(torch.int32).sub(127).unsqueeze(-1).float()
    return torch.ldexp(values, exponent).flatten(-2)


def _copy(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"{name}: shape {tuple(src.shape)}, expected {tuple(dst.shape)}")
    dst.copy_(src)


def load_moe_block_(block: MoeBlock, tensors: Mapping[str, torch.Tensor], prefix: str) -> None:
    """Fills ``block`` from the checkpoint's tensors of one layer's MoE module at ``prefix``
    (e.g. ``model.layers.3.mlp``; Mixtral's ``...block_sparse_moe``), in the family's own
    names; KeyError naming a missing tensor, ValueError a wrong shape. Each expert is copied
    into the stacks once; nothing is kept of the checkpoint's tensors."""
    spec, p = block.spec, prefix
    if spec.model_type == "gpt_oss":
        _load_gpt_oss(block, tensors, p)
        return
    _copy(block.router.weight, tensors[f"{p}.gate.weight"], f"{p}.gate.weight")
    names = (
        ("w1", "w3", "w2")
        if spec.model_type == "mixtral"
        else ("gate_proj", "up_proj", "down_proj")
    )
    i = spec.inter
    if f"{p}.experts.gate_up_proj" in tensors:  # transformers 5's fused stacks
        _copy(block.gate_up, tensors[f"{p}.experts.gate_up_proj"], f"{p}.experts.gate_up_proj")
        _copy(block.down, tensors[f"{p}.experts.down_proj"], f"{p}.experts.down_proj")
    else:
        for e in range(spec.num_experts):
            gate, up, down = (f"{p}.experts.{e}.{n}.weight" for n in names)
            _copy(block.gate_up[e, :i], tensors[gate], gate)
            _copy(block.gate_up[e, i:], tensors[up], up)
            _copy(block.down[e], tensors[down], down)
    if block.shared_gate_up is not None:
        assert block.shared_down is not None and block.shared_gate is not None
        s, shared = spec.shared_inter, f"{p}.shared_expert"
        _copy(block.shared_gate_up.weight[:s], tensors[f"{shared}.gate_proj.weight"], shared)
        _copy(block.shared_gate_up.weight[s:], tensors[f"{shared}.up_proj.weight"], shared)
        _copy(block.shared_down.weight, tensors[f"{shared}.down_proj.weight"], shared)
        _copy(block.shared_gate.weight, tensors[f"{p}.shared_expert_gate.weight"], shared)


def _load_gpt_oss(block: MoeBlock, tensors: Mapping[str, torch.Tensor], p: str) -> None:
    """gpt-oss: router weight and bias; experts ``gate_up_proj`` [E, H, 2I] with gate and up
    interleaved column by column and ``down_proj`` [E, I, H] (x @ W), with biases; or, MXFP4,
    ``*_blocks`` / ``*_scales`` of [E, out, in] (dequantized here, one expert at a time)."""
    assert block.gate_up_bias is not None and block.down_bias is not None
    _copy(block.router.weight, tensors[f"{p}.router.weight"], f"{p}.router.weight")
    _copy(block.router.bias, tensors[f"{p}.router.bias"], f"{p}.router.bias")
    x = f"{p}.experts"
    quantized = f"{x}.gate_up_proj_blocks" in tensors
    for e in range(block.spec.num_experts):
        if quantized:
            gate_up = dequantize_mxfp4(
                tensors[f"{x}.gate_up_proj_blocks"][e], tensors[f"{x}.gate_up_proj_scales"][e]
            )  # [2I, H], rows interleaved
            down = dequantize_mxfp4(
                tensors[f"{x}.down_proj_blocks"][e], tensors[f"{x}.down_proj_scales"][e]
            )  # [H, I]
        else:
            gate_up = tensors[f"{x}.gate_up_proj"][e].t()
            down = tensors[f"{x}.down_proj"][e].t()
        _copy(block.gate_up[e], torch.cat((gate_up[0::2], gate_up[1::2])), f"{x}.gate_up_proj")
        _copy(block.down[e], down, f"{x}.down_proj")
    bias = tensors[f"{x}.gate_up_proj_bias"]
    _copy(
        block.gate_up_bias,
        torch.cat((bias[:, 0::2], bias[:, 1::2]), dim=1),
        f"{x}.gate_up_proj_bias",
    )
    _copy(block.down_bias, tensors[f"{x}.down_proj_bias"], f"{x}.down_proj_bias")
